"""The data layers' batch paths. Data (records read per batch, raw Datums read as one array,
the transform on the whole batch): against a record-by-record reference: Caffe's transform applied
to one protobuf-parsed Datum at a time, with the random choices drawn as the layer draws them
(every crop row, then every crop column, then every mirror flip of the batch). HDF5Data:
batches of any size make the same row stream as batches of one."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from google.protobuf import text_format

import brewnet
from brewnet.data import db
from brewnet.data.datums import raw_batch, raw_layout
from brewnet.data.db import decode_datum, open_db, open_writer
from brewnet.data.transform import datum_to_chw
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_binaryproto, write_binaryproto
from helpers import make_layer

C, H, W = 3, 8, 10
LABELS = [0, 1, 127, 128, 300, 16383, 16384, 70000, 5, 9, 2 ** 31 - 1]   # 1 to 5 varint bytes


def _write(path, datums):
    with open_writer(path) as w:
        for i, d in enumerate(datums):
            w.put(f"{i:08d}", d if isinstance(d, bytes) else d.SerializeToString())
    return path


def _raw(rng, n, labels=LABELS, shape=(C, H, W)):
    return [pb.Datum(channels=shape[0], height=shape[1], width=shape[2], label=labels[i % len(labels)],
                     data=rng.integers(0, 256, int(np.prod(shape)), dtype=np.uint8).tobytes())
            for i in range(n)]


def _net(source, batch, transform="", data="", phase=pb.TRAIN):
    return brewnet.Net(f'''layer {{ name: "d" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} {data} }}
  transform_param {{ {transform} }} }}''', phase)


def reference(values, t: pb.TransformationParameter, phase, rng, start, batch):
    """One batch from record ``start`` on (wrapping), a record at a time."""
    idx = [(start + i) % len(values) for i in range(batch)]
    datums = [decode_datum(values[i]) for i in idx]
    imgs = [datum_to_chw(d, t.force_color, t.force_gray) for d in datums]
    c, hh, ww = imgs[0].shape
    h, w = (t.crop_size, t.crop_size) if t.crop_size else (hh, ww)
    if t.crop_size and phase == pb.TRAIN:
        hs, ws = rng.integers(0, hh - h + 1, batch), rng.integers(0, ww - w + 1, batch)
    else:
        hs, ws = [(hh - h) // 2] * batch, [(ww - w) // 2] * batch
    flips = rng.integers(0, 2, batch).astype(bool) if t.mirror else [False] * batch
    mean = None
    if t.HasField("mean_file"):
        mean = read_binaryproto(t.mean_file)[0]
    out = []
    for img, a, b, flip in zip(imgs, hs, ws, flips):
        x = img[:, a:a + h, b:b + w]
        if mean is not None:
            y = np.subtract(x, mean[:, a:a + h, b:b + w].astype(np.float32), dtype=np.float32)
        elif len(t.mean_value):
            y = np.subtract(x, np.asarray(t.mean_value, np.float32).reshape(-1, 1, 1), dtype=np.float32)
        else:
            y = x.astype(np.float32)
        if t.scale != 1:
            y = y * np.float32(t.scale)
        out.append(y[..., ::-1] if flip else y)
    return np.stack(out), np.array([d.label for d in datums], np.float32)


def _check(source, batch, transform="", data="", phase=pb.TRAIN, rounds=3, prefetch=0):
    """The layer's batches equal the reference's, bit for bit; returns the first start."""
    keys, values = zip(*open_db(source).items())
    net = _net(source, batch, transform, f"{data} prefetch: {prefetch}", phase)
    layer = net.layer_list[0]
    start = first_start = keys.index(layer.loader.cursor.peek()[0])   # where rand_skip put it
    rng = np.random.default_rng()
    rng.bit_generator.state = layer.loader.tf.rng.bit_generator.state
    t = pb.TransformationParameter()
    text_format.Merge(transform, t)
    for _ in range(rounds):
        out = net.forward()
        want, want_labels = reference(values, t, phase, rng, start, batch)
        assert out["data"].dtype == np.float32 and out["data"].shape == want.shape
        np.testing.assert_array_equal(out["data"], want, strict=True)
        np.testing.assert_array_equal(out["label"], want_labels)
        start = (start + batch) % len(values)
    return first_start


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    rng = np.random.default_rng(3)
    mean = rng.uniform(0, 255, (1, C, H, W)).astype(np.float32)
    write_binaryproto(tmp / "mean.binaryproto", mean)
    unique = _raw(rng, len(LABELS), labels=list(range(len(LABELS))))  # labels name the records
    nolabel = [pb.Datum(channels=C, height=H, width=W,
                        data=rng.integers(0, 256, C * H * W, dtype=np.uint8).tobytes())
               for _ in range(4)]
    floats = [pb.Datum(channels=C, height=H, width=W, label=i,
                       float_data=rng.uniform(-2, 2, C * H * W).astype(np.float32).tolist())
              for i in range(5)]
    # Records the one-array read must leave to protobuf: an explicit `encoded: false`, fields
    # out of order, a negative label; between plain ones.
    odd = _raw(rng, 6, labels=list(range(6)))
    odd[1] = odd[1].SerializeToString() + pb.Datum(encoded=False).SerializeToString()
    odd[3] = pb.Datum(label=3).SerializeToString() + pb.Datum(
        channels=C, height=H, width=W, data=odd[3].data).SerializeToString()
    odd[4].label = -4
    bgr = rng.integers(0, 256, (5, H, W, 3), dtype=np.uint8)
    enc = [pb.Datum(encoded=True, label=i, data=cv2.imencode(".png", img)[1].tobytes())
           for i, img in enumerate(bgr)]
    digits = _raw(rng, 23, labels=list(range(10)))           # one length: read as one array
    d = digits[13]           # the same length, but the label before the pixels: protobuf's
    digits[13] = (pb.Datum(label=d.label).SerializeToString()
                  + pb.Datum(channels=C, height=H, width=W, data=d.data).SerializeToString())
    return {"raw": _write(tmp / "raw", _raw(rng, 37)), "digits": _write(tmp / "digits", digits),
            "unique": _write(tmp / "unique", unique),
            "nolabel": _write(tmp / "nolabel", nolabel), "float": _write(tmp / "float", floats),
            "odd": _write(tmp / "odd", odd), "enc": _write(tmp / "enc", enc),
            "mean": tmp / "mean.binaryproto"}


TRANSFORMS = ["", "scale: 0.00390625", "mean_value: 100", "mean_value: 10 mean_value: 20 mean_value: 30",
              "crop_size: 5", "crop_size: 5 mirror: true scale: 0.5", "mirror: true",
              "mean_file: 'MEAN' crop_size: 6 mirror: true scale: 0.017",
              "mean_file: 'MEAN'", "mean_value: 3.5 crop_size: 8 scale: 2"]


@pytest.fixture(autouse=True, params=["in memory", "streamed"])
def memory(request, monkeypatch):
    """Every test on a database read into memory (db.MEMORY_BYTES) and on one read as it goes."""
    if request.param == "streamed":
        monkeypatch.setattr(db, "MEMORY_BYTES", 0)
    return request.param


@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST], ids=["train", "test"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_raw_batches_equal_record_by_record(dbs, transform, phase):
    _check(dbs["raw"], 16, transform.replace("MEAN", str(dbs["mean"])), phase=phase)


@pytest.mark.parametrize("transform", TRANSFORMS[3:6])
def test_records_of_one_length(dbs, transform):
    # batches of 6 and 7 from 23 records: some wrap, some hold record 13, which only protobuf reads
    _check(dbs["digits"], 6, transform, rounds=5)
    _check(dbs["digits"], 7, transform, data="rand_skip: 14", rounds=4)


@pytest.mark.parametrize("kind", ["unique", "nolabel", "float", "odd"])
def test_other_records_and_a_db_shorter_than_the_batch(dbs, kind):
    # 11, 4, 5 and 6 records in batches of 7: each batch wraps, some twice
    _check(dbs[kind], 7, f"mean_file: '{dbs['mean']}' crop_size: 7 mirror: true scale: 0.25", rounds=4)
    _check(dbs[kind], 7, "scale: 3", phase=pb.TEST, rounds=4)


@pytest.mark.parametrize("force", ["", "force_color: true", "force_gray: true"])
def test_encoded_records(dbs, force):
    _check(dbs["enc"], 3, f"{force} crop_size: 6 mirror: true mean_value: 9", rounds=3)


def test_rand_skip_and_prefetch_thread(dbs):
    torch.manual_seed(2)
    starts = {_check(dbs["unique"], 4, "mirror: true", "rand_skip: 9", rounds=3, prefetch=p)
              for p in (0, 2) for _ in range(3)}
    assert starts <= set(range(9)) and len(starts) > 1


@pytest.mark.parametrize("kind", ["raw", "odd", "enc"])
def test_leveldb(dbs, kind, tmp_path, memory):
    pytest.importorskip("plyvel")
    if memory == "streamed":
        pytest.skip("LevelDB is always read as it goes")
    with open_writer(tmp_path / "ldb", backend="leveldb") as w:
        for k, v in open_db(dbs[kind]).items():
            w.put(k, v)
    _check(tmp_path / "ldb", 7, "crop_size: 5 mirror: true scale: 0.5", rounds=7)


def test_raw_batch_reads_only_what_protobuf_reads():
    rng = np.random.default_rng(0)
    base = _raw(rng, 1)[0]
    layout = raw_layout(base)
    for label in LABELS + [-1, -(2 ** 31)]:
        d = pb.Datum()
        d.CopyFrom(base)
        d.label = label
        values = [d.SerializeToString(), base.SerializeToString()]
        got = raw_batch(values, layout)
        if label < 0:
            assert got is None
            continue
        np.testing.assert_array_equal(got[0], np.frombuffer(d.data + base.data, np.uint8).reshape(2, -1))
        np.testing.assert_array_equal(got[1], np.float32([label, base.label]))
    other = pb.Datum(channels=C, height=W, width=H, data=base.data, label=1)   # another shape
    assert raw_batch([base.SerializeToString(), other.SerializeToString()], layout) is None
    assert raw_layout(pb.Datum(encoded=True, data=b"png")) is None


def test_a_corrupt_record_mid_batch_names_db_and_key(tmp_path):
    rng = np.random.default_rng(1)
    records = [d.SerializeToString() for d in _raw(rng, 5)]
    records[3] = records[3][:-40]                # truncated inside the pixels
    src = _write(tmp_path / "db", records)
    with pytest.raises(LayerError, match=f"Layer 'd' \\(type Data\\): {src}: record '00000003' is "
                                         "not a valid Datum"):
        _net(src, 5, data="prefetch: 0").forward()
    short = [d for d in _raw(rng, 3)]
    short[2] = pb.Datum(channels=C, height=H, width=W - 1, data=short[2].data[:C * H * (W - 1)])
    with pytest.raises(LayerError, match="record '00000002' \\(item 2 of the batch\\) has shape"):
        _net(_write(tmp_path / "db2", short), 3, data="prefetch: 0").forward()
    swapped = _raw(rng, 4, labels=[1])       # one length: the database is read as one array
    swapped[1] = pb.Datum(channels=C, height=W, width=H, data=swapped[1].data, label=1)
    with pytest.raises(LayerError, match="record '00000001' \\(item 1 of the batch\\) has shape "
                                         "\\(3, 10, 8\\), the batch's first has \\(3, 8, 10\\)"):
        _net(_write(tmp_path / "db3", swapped), 2, data="prefetch: 0").forward()


# -- HDF5Data: batches inside a file in one step, batches that wrap or change file row by row ----
def _h5_rows(tmp_path, batch, shuffle, total=90, seed=7):
    torch.manual_seed(seed)
    layer, _ = make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "label" hdf5_data_param '
                          f'{{ source: "{tmp_path}/list.txt" batch_size: {batch} shuffle: {shuffle} }}', [])
    data, labels = [], []
    while len(labels) * batch < total:
        d, l = layer.forward([])
        assert d.dtype == torch.float32 and d.shape == (batch, 2, 3)
        data.append(d.numpy())
        labels.append(l.numpy())
    return np.concatenate(data)[:total], np.concatenate(labels)[:total]


@pytest.mark.parametrize("shuffle", ["false", "true"])
def test_hdf5_batches_are_the_row_by_row_stream(tmp_path, shuffle, memory):
    if memory == "streamed":
        pytest.skip("no database")
    import h5py

    sizes, row = (5, 8, 13), 0
    for k, n in enumerate(sizes):
        with h5py.File(tmp_path / f"f{k}.h5", "w") as f:      # row r: label r, data r + 0..5
            f["label"] = np.arange(row, row + n, dtype=np.float64)
            f["data"] = (np.arange(row, row + n)[:, None, None] + np.arange(6).reshape(1, 2, 3)).astype(np.float32)
        row += n
    (tmp_path / "list.txt").write_text("".join(f"f{k}.h5\n" for k in range(3)))
    one, one_labels = _h5_rows(tmp_path, 1, shuffle)
    np.testing.assert_array_equal(one, one_labels[:, None, None] + np.arange(6, dtype=np.float32).reshape(1, 2, 3))
    if shuffle == "false":        # file order, row order, wrapping
        np.testing.assert_array_equal(one_labels, np.arange(90) % 26)
    else:                         # each epoch: every row once
        assert sorted(one_labels[:26]) == list(range(26)) and list(one_labels[:26]) != list(range(26))
    for batch in (3, 4, 8, 13, 30):
        d, l = _h5_rows(tmp_path, batch, shuffle)
        np.testing.assert_array_equal(d, one, strict=True)
        np.testing.assert_array_equal(l, one_labels, strict=True)
    layer, _ = make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "label" hdf5_data_param '
                          f'{{ source: "{tmp_path}/list.txt" batch_size: 2 }}', [])
    d, _ = layer.to(dtype=torch.float64).forward([])
    assert d.dtype == torch.float64
