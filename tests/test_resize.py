"""caffe.io.resize_image follows pycaffe's rule (scale to [0, 1], scikit-image's resize with
constant-zero borders, scale back), enlarging and shrinking, edges included: against a per-pixel
numpy reference written from scikit-image's bilinear/nearest formulas, against scikit-image
itself where it is installed (the test extra), and pycaffe's scipy.ndimage.zoom path for other
channel counts."""
from __future__ import annotations

import math

import numpy as np
import pytest

import brewnet as caffe

SIZES = [((7, 9), (16, 21)), ((16, 21), (7, 9)), ((10, 12), (10, 5)), ((5, 5), (227, 227)),
         ((256, 300), (224, 224))]


def skimage_formula(im01: np.ndarray, out_hw, order: int) -> np.ndarray:
    """scikit-image's old ``resize(mode='constant', cval=0)`` pixel by pixel: the output pixel
    (r, c) samples (r + .5) * H / H' - .5, (c + .5) * W / W' - .5; bilinear reads the floor and
    ceil neighbours (get_pixel2d: 0 outside the image), nearest the C-rounded one."""
    H, W = im01.shape[:2]
    h, w = out_hw
    out = np.zeros((h, w, im01.shape[2]))

    def px(i, j):
        return im01[i, j] if 0 <= i < H and 0 <= j < W else 0.0

    for r in range(h):
        y = (r + 0.5) * H / h - 0.5
        for c in range(w):
            x = (c + 0.5) * W / w - 0.5
            if order == 0:
                out[r, c] = px(int(math.copysign(math.floor(abs(y) + 0.5), y)),
                               int(math.copysign(math.floor(abs(x) + 0.5), x)))
                continue
            y0, y1, x0, x1 = math.floor(y), math.ceil(y), math.floor(x), math.ceil(x)
            dy, dx = y - y0, x - x0
            top = (1 - dx) * px(y0, x0) + dx * px(y0, x1)
            bottom = (1 - dx) * px(y1, x0) + dx * px(y1, x1)
            out[r, c] = (1 - dy) * top + dy * bottom
    return out


def pycaffe(im, out_hw, order, resize01):
    lo, hi = im.min(), im.max()
    return (resize01((im - lo) / (hi - lo), out_hw, order) * (hi - lo) + lo).astype(np.float32)


@pytest.mark.parametrize("order", [1, 0])
@pytest.mark.parametrize("k", [3, 1])
@pytest.mark.parametrize("src,dst", SIZES[:4])
def test_equals_the_skimage_formula(src, dst, k, order):
    im = np.random.default_rng(0).uniform(-150, 150, src + (k,)).astype(np.float32)
    got = caffe.io.resize_image(im, dst, interp_order=order)
    want = pycaffe(im.astype(np.float64), dst, order, skimage_formula)
    assert got.shape == dst + (k,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)     # float32 output of a +-150 image


def test_enlarged_edges_fade_to_the_minimum():
    """The border term: the last row of a 2x enlargement reads 3/4 of the last input row and
    1/4 of 0, the image's minimum after pycaffe's scaling (OpenCV would repeat 30)."""
    im = np.array([[10.0, 10.0], [30.0, 30.0]])[..., None] * np.ones(3)
    out = caffe.io.resize_image(im, (4, 4))
    np.testing.assert_allclose(out[:, 1, 0], [10, 15, 25, 25], atol=1e-5)
    np.testing.assert_allclose(out[:, 0, 0], [10, 13.75, 21.25, 21.25], atol=1e-5)   # both borders


@pytest.mark.parametrize("order", [1, 0])
@pytest.mark.parametrize("src,dst", SIZES)
def test_equals_scikit_image(src, dst, order):
    """scikit-image >= 0.15 without its (new) anti-aliasing computes the old rule."""
    transform = pytest.importorskip("skimage.transform")
    im = np.random.default_rng(1).uniform(0, 255, src + (3,)).astype(np.float32)

    def sk(x, hw, o):
        return transform.resize(x, hw, order=o, mode="constant", anti_aliasing=False)

    np.testing.assert_allclose(caffe.io.resize_image(im, dst, order), pycaffe(im, dst, order, sk),
                               rtol=0, atol=3e-5)


@pytest.mark.parametrize("src,dst", [((6, 7), (11, 13)), ((11, 13), (4, 5))])
def test_other_channel_counts_follow_ndimage_zoom(src, dst):
    ndimage = pytest.importorskip("scipy.ndimage")
    im = np.random.default_rng(2).uniform(-1, 1, src + (4,))
    want = ndimage.zoom(im, (dst[0] / src[0], dst[1] / src[1], 1), order=1)
    np.testing.assert_allclose(caffe.io.resize_image(im, dst), want, atol=1e-6)
