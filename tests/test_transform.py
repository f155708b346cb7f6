"""Caffe's DataTransformer rules: test_data_transformer.cpp's facts (datum 3x4x5, crop 2,
mirror, mean value(s), mean file), centre crop at TEST, random crop/mirror at TRAIN, mean
before scale, the mean image indexed at the crop offset, BGR order of decoded colour images."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from brewnet.data.transform import DataTransformer, TransformError, datum_to_chw, decode_image
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import write_binaryproto
from helpers import MODELS, need

C, H, W = 3, 4, 5


def fill_datum(label=0, unique=False):
    """Caffe's FillDatum: pixels j (unique) or all equal to the label."""
    data = bytes(j if unique else label for j in range(C * H * W))
    return pb.Datum(channels=C, height=H, width=W, label=label, data=data)


def tf(phase=pb.TEST, seed=1701, **kw):
    param = pb.TransformationParameter(**{k: v for k, v in kw.items() if k != "mean_value"})
    param.mean_value.extend(kw.get("mean_value", []))
    return DataTransformer(param, phase, rng=np.random.default_rng(seed))


def run(t, datum, n=1):
    img = t.image(datum)
    return t.transform([img] * n)


def test_empty_transform_is_identity():
    assert np.all(run(tf(), fill_datum(label=0)) == 0)
    out = run(tf(), fill_datum(unique=True))
    assert out.shape == (1, C, H, W) and out.dtype == np.float32
    np.testing.assert_array_equal(out.ravel(), np.arange(C * H * W))


def test_crop_size_shape_and_values():
    out = run(tf(crop_size=2), fill_datum(label=0), n=10)
    assert out.shape == (10, C, 2, 2) and np.all(out == 0)


def test_crop_test_is_centred_and_repeats():
    # Centre offset (H - crop) / 2 = 1 rows, (W - crop) / 2 = 1 columns (integer division).
    out = run(tf(crop_size=2), fill_datum(unique=True), n=10)
    full = np.arange(C * H * W).reshape(C, H, W)
    for o in out:
        np.testing.assert_array_equal(o, full[:, 1:3, 1:3])
    out = run(tf(crop_size=3), fill_datum(unique=True))
    np.testing.assert_array_equal(out[0], full[:, 0:3, 1:4])    # (4-3)//2 = 0, (5-3)//2 = 1


def test_crop_train_is_random_and_in_bounds():
    out = run(tf(pb.TRAIN, crop_size=2), fill_datum(unique=True), n=200)
    full = np.arange(C * H * W).reshape(C, H, W)
    offsets = set()
    for o in out:
        h0, w0 = divmod(int(o[0, 0, 0]), W)
        np.testing.assert_array_equal(o, full[:, h0:h0 + 2, w0:w0 + 2])
        offsets.add((h0, w0))
    assert offsets == {(h, w) for h in range(H - 1) for w in range(W - 1)}   # Rand(H - crop + 1)


@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST])
def test_mirror_is_random_in_both_phases(phase):
    out = run(tf(phase, mirror=True), fill_datum(unique=True), n=100)
    full = np.arange(C * H * W, dtype=np.float32).reshape(C, H, W)
    flipped = [bool(np.array_equal(o, full[:, :, ::-1])) for o in out]
    assert all(f or np.array_equal(o, full) for f, o in zip(flipped, out))
    assert 20 < sum(flipped) < 80


def test_crop_mirror_test_mirrors_the_centre_crop():
    out = run(tf(crop_size=2, mirror=True), fill_datum(unique=True), n=50)
    centre = np.arange(C * H * W, dtype=np.float32).reshape(C, H, W)[:, 1:3, 1:3]
    kinds = {(bool(np.array_equal(o, centre)), bool(np.array_equal(o, centre[:, :, ::-1]))) for o in out}
    assert kinds == {(True, False), (False, True)}


def test_mean_value_one_for_all_channels():
    out = run(tf(mean_value=[2]), fill_datum(label=0))
    assert np.all(out == -2)


def test_mean_values_per_channel():
    out = run(tf(mean_value=[0, 1, 2]), fill_datum(label=0))
    for c in range(C):
        assert np.all(out[0, c] == -c)
    with pytest.raises(TransformError, match="either 1 mean_value or as many as channels"):
        run(tf(mean_value=[1, 2]), fill_datum())


def test_mean_file_all_zero(tmp_path):
    mean = np.arange(C * H * W, dtype=np.float32).reshape(1, C, H, W)
    write_binaryproto(tmp_path / "mean.binaryproto", mean, legacy=True)
    out = run(tf(mean_file=str(tmp_path / "mean.binaryproto")), fill_datum(unique=True))
    assert np.all(out == 0)


def test_mean_file_indexed_at_the_crop_offset(tmp_path):
    # pixel j minus mean j is 0 wherever the crop lands, TRAIN offsets included.
    write_binaryproto(tmp_path / "m.binaryproto", np.arange(C * H * W, dtype=np.float32).reshape(1, C, H, W))
    for phase in (pb.TRAIN, pb.TEST):
        out = run(tf(phase, crop_size=2, mirror=True, mean_file=str(tmp_path / "m.binaryproto")),
                  fill_datum(unique=True), n=30)
        assert np.all(out == 0)


def test_mean_before_scale_in_float32(tmp_path):
    write_binaryproto(tmp_path / "m.binaryproto", np.full((1, C, H, W), 0.7, np.float32))
    datum = fill_datum(unique=True)
    out = run(tf(scale=0.017, mean_file=str(tmp_path / "m.binaryproto")), datum)
    pixels = np.frombuffer(datum.data, np.uint8).astype(np.float32)
    expected = (pixels - np.float32(0.7)) * np.float32(0.017)      # Caffe: (pixel - mean) * scale
    np.testing.assert_array_equal(out.ravel(), expected)
    assert not np.array_equal(out.ravel(), pixels * np.float32(0.017) - np.float32(0.7))
    out = run(tf(scale=0.5, mean_value=[3]), datum)
    np.testing.assert_array_equal(out.ravel(), (pixels - 3) * np.float32(0.5))


def test_mean_file_must_fit_the_image_not_the_crop(tmp_path):
    write_binaryproto(tmp_path / "crop.binaryproto", np.zeros((1, C, 2, 2), np.float32))
    t = tf(crop_size=2, mean_file=str(tmp_path / "crop.binaryproto"))
    with pytest.raises(TransformError, match=r"crop.binaryproto has shape \(3, 2, 2\) but the images are \(3, 4, 5\)"):
        run(t, fill_datum())


def test_bad_params():
    with pytest.raises(TransformError, match="mean_file and mean_value"):
        tf(mean_file="x", mean_value=[1])
    with pytest.raises(TransformError, match="force_color and force_gray"):
        tf(force_color=True, force_gray=True)
    with pytest.raises(TransformError, match="crop_size 6 is larger than the 4x5 image"):
        run(tf(crop_size=6), fill_datum())
    with pytest.raises(TransformError, match="image 1 of the batch has shape"):
        tf().transform([np.zeros((3, 4, 5), np.uint8), np.zeros((3, 4, 6), np.uint8)])


def test_float_data_datum():
    d = pb.Datum(channels=1, height=2, width=2, label=1)
    d.float_data.extend([0.5, -1.5, 2.25, 3.0])
    out = run(tf(scale=2.0, mean_value=[0.5]), d)
    np.testing.assert_array_equal(out.ravel(), [0.0, -4.0, 3.5, 5.0])


def _png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def test_encoded_colour_is_bgr_and_force_flags():
    rgb = np.zeros((2, 3, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 100, 10          # R, G, B
    datum = pb.Datum(data=_png(rgb), encoded=True, label=4)
    native = run(tf(), datum)
    assert native.shape == (1, 3, 2, 3)
    assert [float(native[0, c, 0, 0]) for c in range(3)] == [10, 100, 200]   # B, G, R
    gray = run(tf(force_gray=True), datum)
    assert gray.shape == (1, 1, 2, 3)
    # OpenCV's luminance: 0.299 R + 0.587 G + 0.114 B
    assert abs(float(gray[0, 0, 0, 0]) - (0.299 * 200 + 0.587 * 100 + 0.114 * 10)) <= 1
    gray_png = pb.Datum(data=_png(np.full((2, 2), 77, np.uint8)), encoded=True)
    assert run(tf(), gray_png).shape == (1, 1, 2, 2)
    forced = run(tf(force_color=True), gray_png)
    assert forced.shape == (1, 3, 2, 2) and np.all(forced == 77)


def test_encoded_jpeg_matches_caffes_test_image():
    # Caffe's test_io: cat.jpg decodes to 3x360x480, gray 1x360x480.
    data = need(MODELS / "bvlc" / "examples" / "images" / "cat.jpg").read_bytes()
    datum = pb.Datum(data=data, encoded=True)
    assert datum_to_chw(datum).shape == (3, 360, 480)
    assert datum_to_chw(datum, force_gray=True).shape == (1, 360, 480)
    assert decode_image(b"not an image") is None
    with pytest.raises(TransformError, match="does not decode"):
        datum_to_chw(pb.Datum(data=b"garbage", encoded=True), key=b"k1", source="db")
