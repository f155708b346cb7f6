"""Databases and converters against the real Caffe: the LMDB written by Caffe's
convert_mnist_data decodes record for record, compute-mean equals Caffe's compute_image_mean
file byte for byte, convert-mnist writes Caffe's records, convert-imageset round trips images;
bad input (missing/empty databases, corrupt records, missing list files) fails clearly."""
from __future__ import annotations

import gzip
import logging
import struct

import cv2
import lmdb
import numpy as np
import pytest
from PIL import Image

from brewnet import cli
from brewnet.data import db as dbmod
from brewnet.data.convert import compute_mean, convert_imageset, convert_mnist
from brewnet.data.db import DBError, decode_datum, open_db, open_writer
from brewnet.data.transform import datum_to_chw
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_binaryproto
from helpers import GOLDEN, MODELS, need

LMDB_DIR = GOLDEN / "lmdb" / "fashion_mnist_test_lmdb"
MEAN_FILE = GOLDEN / "lmdb" / "fashion_mnist_test_mean.binaryproto"
REF = GOLDEN / "lmdb" / "fashion_mnist_test_reference.npz"
MNIST = MODELS / "trained" / "mnist_t10k" / "data" / "mnist"
IMAGES = [MODELS / "images" / n for n in ("astronaut.png", "chelsea.png", "coffee.png")] + \
         [MODELS / "bvlc" / "examples" / "images" / n for n in ("cat.jpg", "cat_gray.jpg", "fish-bike.jpg")]


@pytest.fixture(scope="module")
def caffe_records():
    return list(open_db(need(LMDB_DIR)).items())


# -- Caffe's LMDB ------------------------------------------------------------------------------
def test_caffe_lmdb_decodes_record_for_record(caffe_records):
    ref = np.load(REF)
    assert len(caffe_records) == len(open_db(LMDB_DIR)) == 10000
    assert [k for k, _ in caffe_records] == [b"%08d" % i for i in range(10000)]
    datums = [decode_datum(v) for _, v in caffe_records]
    assert all((d.channels, d.height, d.width, d.encoded) == (1, 28, 28, False) for d in datums)
    np.testing.assert_array_equal([d.label for d in datums], ref["labels"])
    images = np.stack([datum_to_chw(d)[0] for d in datums])
    np.testing.assert_array_equal(images[:64], ref["first_images"])
    assert int(images.sum(dtype=np.int64)) == int(ref["pixel_sum"])


def test_compute_mean_equals_caffe_file(tmp_path, caplog):
    out = tmp_path / "mean.binaryproto"
    with caplog.at_level(logging.INFO, logger="brewnet"):
        assert cli.main(["compute-mean", "-backend=lmdb", str(need(LMDB_DIR)), str(out)]) == 0
    assert out.read_bytes() == MEAN_FILE.read_bytes()          # the very bytes Caffe wrote
    np.testing.assert_array_equal(read_binaryproto(out), np.load(REF)["mean"])
    assert "mean_value channel [0]: 73.14" in caplog.text


def _write_idx(path, arr: np.ndarray, gz: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


@pytest.mark.parametrize("gz", [False, True])
def test_convert_mnist_writes_caffes_records(tmp_path, caffe_records, gz):
    # idx files holding exactly what Caffe converted; our converter must write the same bytes.
    datums = [decode_datum(v) for _, v in caffe_records]
    images = np.stack([datum_to_chw(d)[0] for d in datums])
    labels = np.array([d.label for d in datums], np.uint8)
    sfx = ".gz" if gz else ""
    _write_idx(tmp_path / f"img{sfx}", images, gz)
    _write_idx(tmp_path / f"lab{sfx}", labels, gz)
    assert convert_mnist(tmp_path / f"img{sfx}", tmp_path / f"lab{sfx}", tmp_path / "db", progress=False) == 10000
    assert list(open_db(tmp_path / "db").items()) == caffe_records


def test_convert_mnist_cli_on_real_mnist(tmp_path):
    ref = np.load(need(GOLDEN / "models" / "lenet_mnist.npz"))
    rc = cli.main(["convert-mnist", str(need(MNIST) / "t10k-images-idx3-ubyte.gz"),
                   str(MNIST / "t10k-labels-idx1-ubyte.gz"), str(tmp_path / "mnist_test_lmdb"),
                   "--backend=lmdb"])
    assert rc == 0
    records = list(open_db(tmp_path / "mnist_test_lmdb").items())
    assert len(records) == 10000 and records[-1][0] == b"00009999"
    first = [decode_datum(v) for _, v in records[:256]]
    np.testing.assert_array_equal([d.label for d in first], ref["labels"])
    pixels = np.stack([datum_to_chw(d) for d in first]).astype(np.float32) * np.float32(0.00390625)
    np.testing.assert_array_equal(pixels, ref["input"])


def test_convert_mnist_mismatched_counts(tmp_path):
    _write_idx(tmp_path / "img", np.zeros((3, 2, 2)), False)
    _write_idx(tmp_path / "lab", np.zeros(4), False)
    with pytest.raises(ValueError, match="3 images .* 4 labels"):
        convert_mnist(tmp_path / "img", tmp_path / "lab", tmp_path / "db", progress=False)


# -- convert-imageset --------------------------------------------------------------------------
def _list(tmp_path, names, labels=None):
    lst = tmp_path / "list.txt"
    lst.write_text("".join(f"{n} {labels[i] if labels else i}\n" for i, n in enumerate(names)))
    return lst


def _read_back(path):
    return [(k.decode(), decode_datum(v)) for k, v in open_db(path).items()]


def test_convert_imageset_raw_matches_source_images(tmp_path):
    names = [str(need(p)) for p in IMAGES]
    rc = cli.main(["convert-imageset", "", str(_list(tmp_path, names)), str(tmp_path / "db")])
    assert rc == 0
    got = _read_back(tmp_path / "db")
    assert [k for k, _ in got] == [f"{i:08d}_{n}" for i, n in enumerate(names)]
    for i, ((_, d), path) in enumerate(zip(got, IMAGES)):
        assert d.label == i and not d.encoded
        img = datum_to_chw(d)
        if path.suffix == ".png":      # lossless: an independent decoder must agree exactly
            rgb = np.asarray(Image.open(path).convert("RGB"))
            np.testing.assert_array_equal(img, rgb[:, :, ::-1].transpose(2, 0, 1))
        else:                          # JPEG: the same decoder as Caffe's (OpenCV, BGR, colour)
            np.testing.assert_array_equal(img, cv2.imread(str(path), cv2.IMREAD_COLOR).transpose(2, 0, 1))
        assert img.shape[0] == 3       # cat_gray.jpg is read in colour too, as Caffe does


def test_convert_imageset_encoded_gray_resize(tmp_path):
    root = str(need(MODELS / "bvlc" / "examples" / "images")) + "/"
    lst = _list(tmp_path, ["cat.jpg", "fish-bike.jpg"], [3, 5])
    # -encoded keeps the file's own bytes when nothing changes them.
    assert cli.main(["convert-imageset", "-encoded", root, str(lst), str(tmp_path / "enc")]) == 0
    enc = _read_back(tmp_path / "enc")
    assert [k for k, _ in enc] == ["00000000_cat.jpg", "00000001_fish-bike.jpg"]
    assert enc[0][1].encoded and enc[0][1].data == (MODELS / "bvlc/examples/images/cat.jpg").read_bytes()
    assert [d.label for _, d in enc] == [3, 5]
    # -encode_type png re-encodes (lossless): decoded pixels equal the raw conversion.
    assert cli.main(["convert-imageset", "--encode_type=png", "-gray", "-resize_width=64",
                     "-resize_height=48", root, str(lst), str(tmp_path / "png")]) == 0
    assert cli.main(["convert-imageset", "-gray", "-resize_width=64", "-resize_height=48", root,
                     str(lst), str(tmp_path / "raw")]) == 0
    png, raw = _read_back(tmp_path / "png"), _read_back(tmp_path / "raw")
    assert png[0][1].data[:4] == b"\x89PNG"
    for (_, p), (_, r) in zip(png, raw):
        assert datum_to_chw(r).shape == (1, 48, 64)
        np.testing.assert_array_equal(datum_to_chw(p), datum_to_chw(r))
    gray = cv2.imread(root + "cat.jpg", cv2.IMREAD_GRAYSCALE)
    np.testing.assert_array_equal(datum_to_chw(raw[0][1])[0], cv2.resize(gray, (64, 48)))


def test_convert_imageset_shuffle_keeps_labels(tmp_path):
    names = [f"{need(IMAGES[3])}"] * 12
    lst = tmp_path / "list.txt"
    lst.write_text("".join(f"{n} {i}\n" for i, n in enumerate(names)))
    convert_imageset("", lst, tmp_path / "db", shuffle=True, resize_height=8, resize_width=8,
                     progress=False)
    got = _read_back(tmp_path / "db")
    labels = [d.label for _, d in got]
    assert sorted(labels) == list(range(12)) and labels != list(range(12))
    assert [k[:9] for k, _ in got] == [f"{i:08d}_" for i in range(12)]


def test_convert_imageset_missing_file_names_line(tmp_path, caplog):
    lst = tmp_path / "list.txt"
    lst.write_text(f"{need(IMAGES[3])} 0\n\n{tmp_path}/nope.jpg 1\n{IMAGES[5]} 2\n")
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        stats = convert_imageset("", lst, tmp_path / "db", progress=False)
    assert stats["written"] == 2 and stats["skipped"] == [(3, f"{tmp_path}/nope.jpg")]
    assert "line 3" in caplog.text and "nope.jpg" in caplog.text
    assert [k[:8] for k, _ in _read_back(tmp_path / "db")] == ["00000000", "00000002"]


def test_convert_imageset_check_size(tmp_path):
    lst = _list(tmp_path, [str(need(IMAGES[3])), str(IMAGES[5])])
    with pytest.raises(ValueError, match="line 2.*fish-bike.jpg.*(3, 323, 481).*(3, 360, 480)"):
        convert_imageset("", lst, tmp_path / "db", check_size=True, progress=False)


def test_convert_imageset_bad_list_line(tmp_path):
    lst = tmp_path / "list.txt"
    lst.write_text(f"{need(IMAGES[3])} 0\n{IMAGES[3]}\n")
    assert cli.main(["convert-imageset", "", str(lst), str(tmp_path / "db")]) == 1


# -- bad databases -----------------------------------------------------------------------------
def test_missing_database_names_path(tmp_path):
    with pytest.raises(DBError, match=f"{tmp_path}/nowhere: no such database"):
        open_db(tmp_path / "nowhere")
    assert cli.main(["compute-mean", str(tmp_path / "nowhere")]) == 1


def test_empty_lmdb_names_path(tmp_path):
    lmdb.open(str(tmp_path / "empty")).close()
    with pytest.raises(DBError, match=f"{tmp_path}/empty: .*empty"):
        open_db(tmp_path / "empty")


def test_corrupt_record_names_key(tmp_path):
    with open_writer(tmp_path / "db") as w:
        w.put("00000000", pb.Datum(channels=1, height=2, width=2, data=b"abcd").SerializeToString())
        w.put("00000001", b"\xff\xff\xff garbage")
        w.put("00000002", pb.Datum(channels=1, height=2, width=2, data=b"abc").SerializeToString())
    items = list(open_db(tmp_path / "db").items())
    assert decode_datum(items[0][1]).data == b"abcd"
    with pytest.raises(DBError, match="record '00000001' is not a valid Datum"):
        decode_datum(items[1][1], items[1][0], "db")
    with pytest.raises(DBError, match=r"record '00000002' is a corrupt Datum: shape 1x2x2 needs 4 values, it holds 3"):
        decode_datum(items[2][1], items[2][0], "db")
    with pytest.raises(DBError, match="00000001"):
        compute_mean(tmp_path / "db", progress=False)


def test_writer_refuses_existing_path(tmp_path):
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "data.mdb").write_bytes(b"x")
    with pytest.raises(DBError, match="already exists"):
        open_writer(tmp_path / "db")


def test_lmdb_map_grows(tmp_path):
    with dbmod.LMDBWriter(str(tmp_path / "db"), commit_every=50, map_size=1 << 16) as w:
        for i in range(400):
            w.put(f"{i:08d}", bytes(1000))
    assert len(open_db(tmp_path / "db")) == 400


def test_cursors_are_independent_and_wrap(tmp_path):
    with open_writer(tmp_path / "db") as w:
        for i in range(5):
            w.put(f"{i:08d}", bytes([i]))
    db = open_db(tmp_path / "db")
    a, b = db.cursor(), open_db(tmp_path / "db").cursor()
    assert [a.next()[1][0] for _ in range(7)] == [0, 1, 2, 3, 4, 0, 1] and a.epochs == 1
    assert [b.next()[1][0] for _ in range(2)] == [0, 1]


# -- LevelDB -----------------------------------------------------------------------------------
def test_leveldb_round_trip_or_clear_error(tmp_path, monkeypatch):
    try:
        import plyvel  # noqa: F401
    except ImportError:
        plyvel = None
    if plyvel is not None:
        convert_mnist(need(MNIST) / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz",
                      tmp_path / "ldb", backend="leveldb", progress=False)
        convert_mnist(MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz",
                      tmp_path / "lmdb", progress=False)
        db = open_db(tmp_path / "ldb", pb.DataParameter.LEVELDB)
        assert db.backend == "leveldb" and len(db) == 10000
        assert list(db.items()) == list(open_db(tmp_path / "lmdb").items())
        assert [db.cursor().next()[0] for _ in range(2)] == [b"00000000"] * 2
    monkeypatch.setitem(__import__("sys").modules, "plyvel", None)   # as if not installed
    with pytest.raises(DBError, match="pip install plyvel"):
        open_writer(tmp_path / "ldb2", "leveldb")
