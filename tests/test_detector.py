"""pycaffe's caffe.Detector: the context-padded crop equals a hand computation of pycaffe's rule,
detect_windows on the R-CNN deploy net equals forwarding the crops prepared by hand, and
selective search says what is missing."""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from helpers import MODELS, need

MEAN = np.array([104.0, 117.0, 123.0])      # BGR, as the ImageNet nets take it
TINY = """name: "tiny" input: "data" input_shape { dim: 2 dim: 3 dim: 32 dim: 32 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 2 kernel_size: 5 stride: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }"""


def detector(tmp_path, model=None, context_pad=4):
    if model is None:
        model = tmp_path / "tiny.prototxt"
        model.write_text(TINY)
    return caffe.Detector(str(model), None, mean=MEAN, raw_scale=255, channel_swap=(2, 1, 0),
                          context_pad=context_pad)


def test_crop_with_context_pad_by_hand(tmp_path):
    det = detector(tmp_path)
    im = np.random.default_rng(0).random((20, 30, 3)).astype(np.float32)
    rgb_mean = MEAN[::-1] / 255                     # the mean back in load_image's space
    np.testing.assert_allclose(det.crop_mean.reshape(-1), rgb_mean)
    # Window (0, 0, 11, 8), input 32, pad 4: scale 32/24; half sizes 6, 4.5 about centre (6, 4.5);
    # box = np.round(-2, -1.5, 14, 10.5) = (-2, -2, 14, 10) (halves to even); 17 x 13 box:
    # scale_h 32/17, scale_w 32/13; pad_y = round(2 * 32/17 = 3.76) = 4, pad_x = round(4.92) = 5;
    # clipped box (0, 0, 14, 10): 15 x 11 -> crop 28 x 27 (round(28.2), round(27.1)).
    crop = det.crop(im, (0, 0, 11, 8))
    assert crop.shape == (32, 32, 3)
    np.testing.assert_allclose(crop[:4], np.broadcast_to(rgb_mean, (4, 32, 3)), rtol=1e-6)
    np.testing.assert_allclose(crop[:, :5], np.broadcast_to(rgb_mean, (32, 5, 3)), rtol=1e-6)
    np.testing.assert_array_equal(crop[4:, 5:], caffe.io.resize_image(im[0:14, 0:10], (28, 27)))
    # Window (5, 8, 12, 20) inside: box np.round(3.67, 5.83, 14.33, 23.17) = (4, 6, 14, 23), no pad,
    # 11 x 18 -> the whole 32 x 32 input is im[4:14, 6:23] (pycaffe's slice drops the last row).
    np.testing.assert_array_equal(det.crop(im, (5, 8, 12, 20)),
                                  caffe.io.resize_image(im[4:14, 6:23], (32, 32)))
    plain = detector(tmp_path, context_pad=None)
    np.testing.assert_array_equal(plain.crop(im, (2, 3, 9, 17)), im[2:9, 3:17])
    with pytest.raises(ValueError, match="outside the 20x30 image"):
        det.crop(im, (40, 40, 45, 50))


def test_detect_windows_equals_forwarding_the_crops(tmp_path):
    """R-CNN ILSVRC13 deploy (227 input, 200 classes) with random weights, context pad 16."""
    model = need(MODELS / "bvlc/models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt")
    images = sorted(need(MODELS / "images").glob("*.png"))
    det = detector(tmp_path, model, context_pad=16)
    rng = np.random.default_rng(1)
    for name, blobs in det.params.items():
        w = blobs[0].data
        w[...] = rng.standard_normal(w.shape) / np.sqrt(np.prod(w.shape[1:]))
        blobs[1].data[...] = 0.01
    windows = [(0, 0, 120, 150), (40, 60, 200, 260), (100, 10, 299, 200)]
    todo = [(str(p), windows[k:] + windows[:k][:1]) for k, p in enumerate(images)]
    got = det.detect_windows(todo)
    assert [(d["filename"], tuple(d["window"])) for d in got] == [(f, w) for f, ws in todo for w in ws]
    crops = [det.crop(caffe.io.load_image(f), w) for f, ws in todo for w in ws]
    # by hand: warp to 227 x 227, HWC -> CHW, RGB -> BGR, [0, 255], minus the mean
    x = np.stack([caffe.io.resize_image(c, (227, 227)).transpose(2, 0, 1)[::-1] * 255 - MEAN[:, None, None]
                  for c in crops]).astype(np.float32)
    want = []
    for b in range(0, len(x), 10):
        part = np.concatenate([x[b:b + 10], np.zeros((max(0, b + 10 - len(x)),) + x.shape[1:], np.float32)])
        want.append(det.forward(data=part)["fc-rcnn"][:len(x) - b].copy())
    want = np.concatenate(want)
    assert want.shape == (len(crops), 200) and np.ptp(want) > 0
    np.testing.assert_allclose(np.stack([d["prediction"] for d in got]), want, rtol=1e-5, atol=1e-5)


def test_selective_search_names_what_is_missing(tmp_path):
    with pytest.raises(NotImplementedError, match="selective_search_ijcv_with_python"):
        detector(tmp_path).detect_selective_search(["a.jpg"])
