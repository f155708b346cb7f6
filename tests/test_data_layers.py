"""Data layers: HDF5Data on Caffe's own test files (test_hdf5data_layer.cpp's values, shapes
and file order), HDF5Output, ImageData (test_image_data_layer.cpp's facts), Data over LMDB
through a Net (each net its own cursor, transforms, prefetch), WindowData, and their errors."""
from __future__ import annotations

import shutil

import cv2
import h5py
import numpy as np
import pytest
import torch

import brewnet
from brewnet.data.convert import convert_imageset
from brewnet.data.db import open_writer
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from helpers import GOLDEN, MODELS, make_layer, need

TEST_DATA = MODELS / "bvlc" / "src" / "caffe" / "test" / "test_data"
IMAGES = MODELS / "bvlc" / "examples" / "images"
LMDB_DIR = GOLDEN / "lmdb" / "fashion_mnist_test_lmdb"
REF = GOLDEN / "lmdb" / "fashion_mnist_test_reference.npz"


# -- HDF5Data ----------------------------------------------------------------------------------
def test_hdf5_data_caffe_test_read(monkeypatch):
    # The list names files relative to Caffe's root, as Caffe's test runs them.
    monkeypatch.chdir(MODELS / "bvlc")
    layer, tops = make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "label" top: "label2" '
                             f'hdf5_data_param {{ source: "{need(TEST_DATA)}/sample_data_list.txt" '
                             'batch_size: 5 }', [])
    assert tops == [(5, 8, 6, 5), (5, 1), (5, 1)]
    size = 8 * 6 * 5
    for it in range(10):
        data, label, label2 = (t.numpy() for t in layer.forward([]))
        label_off = 1 + (0 if it % 2 == 0 else 5)
        np.testing.assert_array_equal(label.ravel(), label_off + np.arange(5))
        np.testing.assert_array_equal(label2.ravel(), label_off + 1 + np.arange(5))
        data_off = 0 if it % 2 == 0 else 5 * size
        file_off = 0 if it % 4 < 2 else 2400    # second file (gzip, uint8 labels): data + 2400
        np.testing.assert_array_equal(data.ravel(), file_off + data_off + np.arange(5 * size))
        assert data.dtype == np.float32 and label.dtype == np.float32


def test_hdf5_data_paths_relative_to_list_and_shuffle(tmp_path):
    for f in ("sample_data.h5", "sample_data_2_gzip.h5"):
        shutil.copy(need(TEST_DATA) / f, tmp_path / f)
    (tmp_path / "list.txt").write_text("sample_data.h5\nsample_data_2_gzip.h5\n")
    torch.manual_seed(3)
    layer, _ = make_layer(f'name: "h" type: "HDF5Data" top: "data" top: "label" '
                          f'hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: 4 shuffle: true }}', [])
    rows = []
    for _ in range(5):                       # 20 rows = one pass over both files
        data, label = (t.numpy() for t in layer.forward([]))
        rows += [(float(d[0, 0, 0]), float(l[0])) for d, l in zip(data, label)]
    # Each row once; rows stay intact (data start = file offset + 240 * (label - 1)).
    assert sorted(rows) == sorted((f + 240.0 * (k - 1), float(k)) for f in (0.0, 2400.0) for k in range(1, 11))
    assert [r[1] for r in rows] != [float(k) for _ in range(2) for k in range(1, 11)]


def test_hdf5_data_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(LayerError, match="at least 1 HDF5 filename"):
        make_layer(f'name: "h" type: "HDF5Data" top: "data" '
                   f'hdf5_data_param {{ source: "{tmp_path}/empty.txt" batch_size: 2 }}', [])
    (tmp_path / "list.txt").write_text(f"{need(TEST_DATA)}/sample_data.h5\n")
    with pytest.raises(LayerError, match="no dataset 'targets'.*'data', 'label', 'label2'"):
        make_layer(f'name: "h" type: "HDF5Data" top: "targets" '
                   f'hdf5_data_param {{ source: "{tmp_path}/list.txt" batch_size: 2 }}', [])
    with pytest.raises(LayerError, match="batch_size must be positive"):
        make_layer(f'name: "h" type: "HDF5Data" top: "data" hdf5_data_param {{ source: "{tmp_path}/list.txt" }}', [])


def test_hdf5_output_writes_and_appends(tmp_path):
    out = tmp_path / "out.h5"
    layer, tops = make_layer(f'name: "o" type: "HDF5Output" bottom: "data" bottom: "label" '
                             f'hdf5_output_param {{ file_name: "{out}" }}', [(10, 8, 6, 5), (10, 1)])
    assert tops == []
    with h5py.File(need(TEST_DATA) / "sample_data.h5") as f:
        data, label = f["data"][()], f["label"][()]
    assert layer.forward([torch.from_numpy(data), torch.from_numpy(label)]) == []
    with h5py.File(out) as f:     # Caffe's test_hdf5_output_layer: read back equal, 4-D label
        np.testing.assert_array_equal(f["data"][()], data)
        assert f["label"].shape == (10, 1, 1, 1)
        np.testing.assert_array_equal(f["label"][()].reshape(10, 1), label)
    layer.forward([torch.from_numpy(data[:2]), torch.from_numpy(label[:2])])
    with h5py.File(out) as f:
        assert f["data"].shape == (12, 8, 6, 5)
    with pytest.raises(LayerError, match="same num"):
        make_layer(f'name: "o" type: "HDF5Output" bottom: "a" bottom: "b" hdf5_output_param {{ file_name: "{out}" }}',
                   [(10, 2), (9, 1)])


# -- ImageData ---------------------------------------------------------------------------------
def _image_layer(tmp_path, names, extra="", phase=pb.TEST, batch=None):
    lst = tmp_path / "list.txt"
    lst.write_text("".join(f"{n} {i}\n" for i, n in enumerate(names)))
    params = f'source: "{lst}" root_folder: "{need(IMAGES)}/" batch_size: {batch or len(names)} {extra}'
    return make_layer(f'name: "img" type: "ImageData" top: "data" top: "label" '
                      f'image_data_param {{ {params} }}', [], phase)


def test_image_data_read_and_resize(tmp_path):
    layer, tops = _image_layer(tmp_path, ["cat.jpg"] * 5)
    assert tops == [(5, 3, 360, 480), (5,)]
    for _ in range(2):
        data, label = layer.forward([])
        np.testing.assert_array_equal(label.numpy(), np.arange(5))
    bgr = cv2.imread(str(IMAGES / "cat.jpg"), cv2.IMREAD_COLOR).transpose(2, 0, 1)
    np.testing.assert_array_equal(data.numpy()[0], bgr)
    layer, tops = _image_layer(tmp_path, ["cat.jpg"] * 5, "new_height: 256 new_width: 256")
    assert tops == [(5, 3, 256, 256), (5,)]
    assert tuple(layer.forward([])[0].shape) == (5, 3, 256, 256)


def test_image_data_reshapes_per_batch(tmp_path):
    layer, tops = _image_layer(tmp_path, ["cat.jpg", "fish-bike.jpg"], batch=1)
    assert tops == [(1, 3, 360, 480), (1,)]
    assert tuple(layer.forward([])[0].shape) == (1, 3, 360, 480)
    assert tuple(layer.forward([])[0].shape) == (1, 3, 323, 481)


def test_image_data_shuffle_and_gray(tmp_path):
    torch.manual_seed(0)
    layer, tops = _image_layer(tmp_path, ["cat.jpg"] * 5, "shuffle: true is_color: false new_height: 8 new_width: 8")
    assert tops == [(5, 1, 8, 8), (5,)]
    orders = [tuple(layer.forward([])[1].numpy().astype(int)) for _ in range(4)]
    assert all(sorted(o) == [0, 1, 2, 3, 4] for o in orders) and len(set(orders)) > 1


def test_image_data_missing_file_names_line(tmp_path):
    with pytest.raises(LayerError, match="list.txt line 1: could not open or find file .*nope.jpg"):
        _image_layer(tmp_path, ["nope.jpg", "cat.jpg"])
    layer, _ = _image_layer(tmp_path, ["cat.jpg", "cat.jpg", "nope.jpg"], batch=2)
    layer.forward([])
    with pytest.raises(LayerError, match=r"Layer 'img' \(type ImageData\): .*list.txt line 3: .*nope.jpg"):
        layer.forward([])


# -- Data (LMDB) through a Net -----------------------------------------------------------------
def data_net(extra_data="", transform="scale: 0.00390625", batch=64, source=None, phase=pb.TEST):
    return brewnet.Net(f'''name: "d"
layer {{ name: "mnist" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source or need(LMDB_DIR)}" batch_size: {batch} backend: LMDB {extra_data} }}
  transform_param {{ {transform} }} }}''', phase)


def test_data_layer_through_net():
    ref = np.load(need(REF))
    net = data_net()
    assert net.blobs["data"].shape == (64, 1, 28, 28) and net.blobs["label"].shape == (64,)
    out = net.forward()
    np.testing.assert_array_equal(out["data"][:, 0], ref["first_images"] * np.float32(0.00390625))
    np.testing.assert_array_equal(out["label"], ref["labels"][:64])
    np.testing.assert_array_equal(net.forward()["label"], ref["labels"][64:128])
    # Another net on the same source starts at the first record: its own cursor.
    np.testing.assert_array_equal(data_net(phase=pb.TRAIN).forward()["label"], ref["labels"][:64])


def test_data_layer_wraps_and_prefetch_off_is_identical():
    ref = np.load(need(REF))["labels"]
    a, b = data_net("prefetch: 4", batch=3000), data_net("prefetch: 0", batch=3000)
    for k in range(4):                      # 12000 records: wraps after 10000
        la, lb = a.forward()["label"], b.forward()["label"]
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_array_equal(la, np.take(ref, np.arange(3000 * k, 3000 * (k + 1)) % 10000))
    assert b.layer_list[0].data_wait_s > 0      # prefetch 0: the loading happens in forward


def test_data_layer_centre_crop_at_test_and_rand_skip():
    ref = np.load(need(REF))
    out = data_net(transform="crop_size: 24").forward()["data"]
    np.testing.assert_array_equal(out[:, 0], ref["first_images"][:, 2:26, 2:26])
    torch.manual_seed(5)
    labels = data_net("rand_skip: 100", batch=8).forward()["label"]
    start = next(s for s in range(100) if np.array_equal(ref["labels"][s:s + 8], labels))
    assert 0 <= start < 100


def test_data_layer_dtype_hook():
    net = data_net(batch=4).to(dtype=torch.float64)
    net.forward()
    assert net.blobs["data"].tensor.dtype == torch.float64


def test_data_layer_encoded_records_equal_raw(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("cat.jpg 0\nfish-bike.jpg 1\n")
    common = dict(resize_height=40, resize_width=50, progress=False)
    convert_imageset(f"{need(IMAGES)}/", lst, tmp_path / "enc", encode_type="png", **common)
    convert_imageset(f"{IMAGES}/", lst, tmp_path / "raw", **common)
    enc = data_net(batch=2, source=tmp_path / "enc", transform="mean_value: 104 mean_value: 117 mean_value: 123")
    raw = data_net(batch=2, source=tmp_path / "raw", transform="mean_value: 104 mean_value: 117 mean_value: 123")
    np.testing.assert_array_equal(enc.forward()["data"], raw.forward()["data"])


def test_data_layer_errors(tmp_path):
    with pytest.raises(LayerError, match=f"Layer 'mnist' \\(type Data\\): {tmp_path}/none: no such database"):
        data_net(source=tmp_path / "none")
    with open_writer(tmp_path / "db") as w:
        w.put("00000000", pb.Datum(channels=1, height=2, width=2, data=b"abcd").SerializeToString())
        w.put("00000001", b"\x08\x01\x12")
    net = data_net(batch=1, source=tmp_path / "db")
    net.forward()
    with pytest.raises(LayerError, match="record '00000001' is not a valid Datum"):
        net.forward()
    with pytest.raises(LayerError, match="mean.binaryproto"):
        data_net(source=tmp_path / "db", transform=f'mean_file: "{tmp_path}/missing/mean.binaryproto"')


# -- WindowData --------------------------------------------------------------------------------
def _window_setup(tmp_path, extra="", mirror=False):
    img = np.zeros((40, 60, 3), np.uint8)
    img[10:20, 20:30] = (10, 20, 30)          # BGR square, the foreground object
    cv2.imwrite(str(tmp_path / "im.png"), img)
    (tmp_path / "windows.txt").write_text(
        "# 0\nim.png\n3\n40\n60\n3\n"
        "1 0.9 20 10 29 19\n"              # fg, exactly the object (10x10)
        "0 0.1 0 0 9 9\n"                  # bg
        "2 0.4 0 0 59 39\n")               # between thresholds: dropped
    p = (f'name: "w" type: "WindowData" top: "data" top: "label" '
         f'window_data_param {{ source: "{tmp_path}/windows.txt" root_folder: "{tmp_path}/" '
         f'batch_size: 8 fg_threshold: 0.5 bg_threshold: 0.3 fg_fraction: 0.25 {extra} }} '
         f'transform_param {{ crop_size: 10 mirror: {str(mirror).lower()} }}')
    return make_layer(p, [], pb.TRAIN)


def test_window_data_samples_and_warps(tmp_path):
    layer, tops = _window_setup(tmp_path, "scale: 0.5")
    assert tops == [(8, 3, 10, 10), (8,)]
    data, label = (t.numpy() for t in layer.forward([]))
    np.testing.assert_array_equal(label, [0] * 6 + [1] * 2)     # background first, then fg
    assert np.all(data[:6] == 0)
    for c, v in enumerate((10, 20, 30)):                        # 10x10 window: no resampling
        assert np.all(data[6:, c] == v * 0.5)


def test_window_data_context_pad_outside_the_image_stays_zero(tmp_path):
    img = np.full((40, 60, 3), 50, np.uint8)
    img[0:10, 0:10] = (10, 20, 30)            # the object in the top-left corner
    cv2.imwrite(str(tmp_path / "corner.png"), img)
    (tmp_path / "w.txt").write_text("# 0\ncorner.png\n3\n40\n60\n2\n1 0.9 0 0 9 9\n0 0.0 30 20 39 29\n")
    layer, _ = make_layer(
        f'name: "w" type: "WindowData" top: "data" top: "label" window_data_param {{ '
        f'source: "{tmp_path}/w.txt" root_folder: "{tmp_path}/" batch_size: 4 fg_fraction: 0.5 '
        f'context_pad: 2 }} transform_param {{ crop_size: 10 }}', [], pb.TRAIN)
    fg = layer.forward([])[0].numpy()[2:]
    # Grown by 10/6 around the box: x, y in [-3, 13]; warped by 10/17, the 3 pixels beyond the
    # image become round(3 * 10/17) = 2 rows and columns of zeros, the rest is image.
    assert np.all(fg[:, :, :2, :] == 0) and np.all(fg[:, :, :, :2] == 0)
    assert np.all(fg[:, :, 2:, 2:] > 0)
    np.testing.assert_array_equal(fg[:, :, 2, 2], [[10, 20, 30]] * 2)


def test_window_data_errors(tmp_path):
    (tmp_path / "w.txt").write_text("# 0\nim.png\n3\n40\n60\n1\n0 0.1 0 0 9 9\n")
    p = (f'name: "w" type: "WindowData" top: "data" top: "label" window_data_param {{ '
         f'source: "{tmp_path}/w.txt" batch_size: 4 }} transform_param {{ crop_size: 8 }}')
    with pytest.raises(LayerError, match="0 foreground and 1 background"):
        make_layer(p, [])
    with pytest.raises(LayerError, match="crop_size must be positive"):
        make_layer(p.replace("crop_size: 8", "mirror: true"), [])


# -- prefetch ----------------------------------------------------------------------------------
def test_prefetcher_bounded_ordered_and_reraises():
    import threading

    from brewnet.data.prefetch import Prefetcher

    made, made_3 = [], threading.Event()

    def make():
        made.append(len(made))
        if len(made) == 4:
            made_3.set()
        if len(made) == 8:
            raise KeyError("record 7")
        return made[-1]

    p = Prefetcher(make, depth=2)
    assert p.get() == 0
    # The producer puts 1 and 2, makes 3 and blocks on the full queue: nothing more is made
    # until the consumer takes one (the timeout only bounds a failure).
    assert made_3.wait(60) and p.ready == 2 and len(made) == 4
    assert [p.get() for _ in range(6)] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(KeyError, match="record 7"):
        p.get()
    assert p.batches >= 7 and p.wait_s > 0
    assert not any(t.name == "brewnet-prefetch" and t.is_alive() for t in threading.enumerate())


def test_prefetch_thread_stops_when_net_is_dropped():
    import gc
    import threading

    before = set(threading.enumerate())
    net = data_net("prefetch: 2", batch=2)
    net.forward()
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "brewnet-mnist"]
    del net
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()


def test_plan_threads(monkeypatch):
    from brewnet.data import prefetch

    monkeypatch.setattr(prefetch, "usable_cores", lambda: 2)
    assert prefetch.plan_threads(0.05, apply=False) == 2      # light producer: share the cores
    assert prefetch.plan_threads(0.6, apply=False) == 1       # busy producer: a core of its own
    monkeypatch.setattr(prefetch, "usable_cores", lambda: 16)
    assert prefetch.plan_threads(2.5, apply=False) == 13
    monkeypatch.setattr(prefetch, "usable_cores", lambda: 1)
    assert prefetch.plan_threads(1, apply=False) == 1
    net = data_net("prefetch: 4", batch=500)
    for _ in range(3):
        net.forward()
    assert 0 < prefetch.data_busy([net], 1.0) < 1.0


def test_unset_prefetch_times_the_loading_then_chooses(monkeypatch):
    from brewnet.data import source

    def same(nets, batches):
        ref = data_net("prefetch: 0", batch=50)
        for i in range(batches):
            want = ref.forward()
            where = {k: v for k, v in ref.layer_list[0].cursor_state().items() if k != "rng"}
            for net in nets:
                out = net.forward()
                np.testing.assert_array_equal(out["data"], want["data"])
                np.testing.assert_array_equal(out["label"], want["label"])
                assert {k: v for k, v in net.layer_list[0].cursor_state().items() if k != "rng"} == where
            yield i

    # (the thresholds are patched: a test must not depend on the machine's speed)
    n = source.AUTO_BATCHES + 1
    monkeypatch.setattr(source, "AUTO_MIN_S", float("inf"))
    light = data_net(batch=50)             # loading never long enough: stays in the forward
    assert light.layer_list[0].prefetcher is None and light.layer_list[0].auto
    for _ in same([light], n + 2):
        pass
    assert light.layer_list[0].prefetcher is None and not light.layer_list[0].auto
    monkeypatch.setattr(source, "AUTO_MIN_S", 0.0)
    monkeypatch.setattr(source, "AUTO_SHARE", 0.0)
    heavy = data_net(batch=50)             # always long enough: a thread after n batches
    explicit = data_net("prefetch: 4", batch=50)
    assert explicit.layer_list[0].prefetcher is not None and not explicit.layer_list[0].auto
    for i in same([heavy, explicit], n + 5):
        assert (heavy.layer_list[0].prefetcher is not None) == (i >= n - 1)
    assert heavy.layer_list[0].prefetcher.batches == 5
