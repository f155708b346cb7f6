"""pycaffe's caffe.io on brewnet: python/caffe/test/test_io.py's facts, Datum and BlobProto
conversions, the Transformer's order of operations and its inverse, image loading (RGB in
[0, 1]), resizing and 10-crop oversampling."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import brewnet as caffe
from brewnet.proto import caffe_pb2
from helpers import MODELS, need

IMAGES = MODELS / "bvlc" / "examples" / "images"


# -- pycaffe's test_io.py ----------------------------------------------------------------------
def test_blobproto_to_array_legacy_and_shape():
    blob = caffe_pb2.BlobProto()
    blob.data.extend(list(range(100)))
    blob.num, blob.channels, blob.height, blob.width = 1, 1, 10, 10
    arr = caffe.io.blobproto_to_array(blob)
    assert arr.shape == (1, 1, 10, 10) and arr.dtype == np.float64
    blob = caffe_pb2.BlobProto()
    blob.data.extend(list(range(100)))
    blob.shape.dim.extend([10, 10])
    assert caffe.io.blobproto_to_array(blob).shape == (10, 10)


def test_blobproto_without_shape():
    blob = caffe_pb2.BlobProto()
    blob.data.extend(list(range(100)))
    with pytest.raises(ValueError):
        caffe.io.blobproto_to_array(blob)
    blob = caffe_pb2.BlobProto()
    blob.data.append(123)
    assert caffe.io.blobproto_to_array(blob) == 123


def test_array_to_datum_with_label_is_larger():
    arr = np.zeros((1, 10, 10), np.uint8)
    assert len(caffe.io.array_to_datum(arr, 1).SerializeToString()) > \
        len(caffe.io.array_to_datum(arr).SerializeToString())


# -- conversions -------------------------------------------------------------------------------
def test_datum_round_trips():
    u8 = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    d = caffe.io.array_to_datum(u8, label=7)
    assert (d.channels, d.height, d.width, d.label) == (2, 3, 4, 7) and d.data == u8.tobytes()
    np.testing.assert_array_equal(caffe.io.datum_to_array(d), u8)
    f = np.linspace(-1, 1, 24).reshape(2, 3, 4)
    d = caffe.io.array_to_datum(f)
    assert not d.data and len(d.float_data) == 24
    np.testing.assert_allclose(caffe.io.datum_to_array(d), f, rtol=1e-7)
    with pytest.raises(ValueError, match="Incorrect array shape"):
        caffe.io.array_to_datum(np.zeros((2, 2)))


def test_blobproto_and_vector_round_trips():
    a = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    blob = caffe.io.array_to_blobproto(a, diff=2 * a)
    assert list(blob.shape.dim) == [2, 3, 4]
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob), a)
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob, return_diff=True), 2 * a)
    arrays = [a, np.ones((5,), np.float32)]
    s = caffe.io.arraylist_to_blobprotovector_str(arrays)
    back = caffe.io.blobprotovector_str_to_arraylist(s)
    assert len(back) == 2 and all(np.array_equal(x, y) for x, y in zip(back, arrays))


# -- Transformer -------------------------------------------------------------------------------
def _transformer():
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    t.set_input_scale("data", 0.5)
    return t


def test_transformer_order_of_operations():
    img = np.random.default_rng(1).random((4, 5, 3)).astype(np.float32)    # H x W x RGB in [0, 1]
    keep = img.copy()
    out = _transformer().preprocess("data", img)
    np.testing.assert_array_equal(img, keep)          # the caller's image is left alone
    bgr = img.transpose(2, 0, 1)[::-1]
    expected = (bgr * 255 - np.array([104, 117, 123], np.float32)[:, None, None]) * 0.5
    assert out.shape == (3, 4, 5) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(_transformer().deprocess("data", out[None]), img, atol=1e-6)


def test_transformer_resizes_and_checks():
    t = caffe.io.Transformer({"data": [1, 3, 8, 6]})
    assert t.preprocess("data", np.ones((4, 5, 3))).shape == (8, 6, 3)
    with pytest.raises(Exception, match="not one of the net inputs"):
        t.set_raw_scale("image", 255)
    with pytest.raises(Exception, match="Transpose order"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(Exception, match="Channel swap"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="Mean channels incompatible"):
        t.set_mean("data", np.zeros(4))
    with pytest.raises(ValueError, match="Mean shape incompatible"):
        t.set_mean("data", np.zeros((3, 4, 4)))
    with pytest.raises(ValueError, match="Mean shape incompatible"):
        t.set_mean("data", np.zeros((8, 6)))         # (H, W) means a 1-channel input
    caffe.io.Transformer({"g": (1, 1, 8, 6)}).set_mean("g", np.zeros((8, 6)))
    with pytest.raises(ValueError, match="Mean shape invalid"):
        t.set_mean("data", np.zeros((1, 3, 8, 6)))


# -- images ------------------------------------------------------------------------------------
def test_load_image_rgb_float_and_gray():
    img = caffe.io.load_image(need(MODELS / "images" / "chelsea.png"))
    ref = np.asarray(Image.open(MODELS / "images" / "chelsea.png").convert("RGB"))
    assert img.shape == (300, 451, 3) and img.dtype == np.float32
    np.testing.assert_allclose(img, ref / 255.0, atol=1e-7)      # RGB order, [0, 1]
    gray = caffe.io.load_image(IMAGES / "cat_gray.jpg", color=False)
    assert gray.shape == (360, 480, 1)
    tiled = caffe.io.load_image(IMAGES / "cat_gray.jpg")
    assert tiled.shape == (360, 480, 3) and np.array_equal(tiled[..., 0], tiled[..., 2])
    lum = caffe.io.load_image(MODELS / "images" / "chelsea.png", color=False)
    assert lum.shape == (300, 451, 1)
    np.testing.assert_allclose(lum[..., 0], ref @ np.array([0.2125, 0.7154, 0.0721]) / 255, atol=1e-6)
    with pytest.raises(IOError):
        caffe.io.load_image(IMAGES / "missing.jpg")


def test_resize_image():
    im = np.random.default_rng(2).random((10, 12, 3)).astype(np.float32)
    out = caffe.io.resize_image(im, (5, 6))
    assert out.shape == (5, 6, 3) and out.dtype == np.float32
    # Halving with bilinear weights at pixel centres averages each 2x2 block.
    np.testing.assert_allclose(out, im.reshape(5, 2, 6, 2, 3).mean((1, 3)), atol=1e-6)
    const = caffe.io.resize_image(np.full((4, 4, 1), 0.25), (7, 9))
    assert const.shape == (7, 9, 1) and np.all(const == 0.25)
    many = caffe.io.resize_image(np.random.default_rng(3).random((4, 4, 600)), (2, 2))
    assert many.shape == (2, 2, 600)


def test_oversample_ten_crops():
    im = np.arange(6 * 8, dtype=np.float32).reshape(6, 8, 1)
    crops = caffe.io.oversample([im, im + 100], (4, 4))
    assert crops.shape == (20, 4, 4, 1)
    starts = [(0, 0), (0, 4), (2, 0), (2, 4), (1, 2)]             # 4 corners, then centre
    for k, (i, j) in enumerate(starts):
        np.testing.assert_array_equal(crops[k], im[i:i + 4, j:j + 4])
        np.testing.assert_array_equal(crops[k + 5], im[i:i + 4, j:j + 4][:, ::-1])
    np.testing.assert_array_equal(crops[10:], crops[:10] + 100)
