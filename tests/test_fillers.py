"""Fillers: the distributions Caffe's ``filler.hpp`` defines (means, variances, bounds, fans),
checked statistically with seeded draws; bilinear against its closed form; bad params."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import brewnet
from brewnet.fillers import FILLERS, fill
from brewnet.proto import caffe_pb2 as pb

SHAPE = (1000, 2, 4, 5)          # test_filler.cpp's blob: fan_in 2*4*5 = 40, fan_out 1000*4*5


def draw(text: str, shape=SHAPE, seed=1701) -> np.ndarray:
    brewnet.set_random_seed(seed)
    t = torch.empty(shape)
    fill(t, text_format.Parse(text, pb.FillerParameter()))
    return t.numpy().astype(np.float64)


def assert_stats(x, mean, std, sigmas=5.0):
    """Sample mean within ``sigmas`` standard errors; sample std within ``sigmas`` standard
    errors of a normal-ish sample's std (std / sqrt(2n))."""
    n = x.size
    assert abs(x.mean() - mean) < sigmas * std / math.sqrt(n) + 1e-12, (x.mean(), mean)
    assert abs(x.std() - std) < sigmas * std / math.sqrt(2 * n) * 1.5, (x.std(), std)


def test_constant():
    assert (draw('type: "constant" value: 10') == 10).all()
    assert (draw('type: "constant"') == 0).all()       # default value 0 (and default type)


def test_uniform():
    x = draw('type: "uniform" min: 1 max: 2')
    assert x.min() >= 1 and x.max() <= 2
    assert_stats(x, 1.5, math.sqrt(1 / 12))
    assert x.min() < 1.001 and x.max() > 1.999
    x = draw('type: "uniform"')                          # defaults U(0, 1)
    assert_stats(x, 0.5, math.sqrt(1 / 12))


def test_gaussian():
    assert_stats(draw('type: "gaussian" mean: 10 std: 0.1'), 10, 0.1)
    assert_stats(draw('type: "gaussian"'), 0, 1)          # defaults N(0, 1)


def test_gaussian_sparse_keeps_sparse_over_num_outputs():
    # An InnerProduct weight (num_output 100, 200 inputs): on average `sparse` non-zero inputs
    # per output, i.e. each weight kept with probability sparse / shape(0).
    x = draw('type: "gaussian" std: 1 sparse: 20', shape=(100, 200))
    p = 20 / 100
    kept = (x != 0).mean()
    assert abs(kept - p) < 5 * math.sqrt(p * (1 - p) / x.size)
    assert_stats(x[x != 0], 0, 1)
    assert (draw('type: "gaussian" sparse: 0', shape=(10, 20)) == 0).all()


def test_positive_unitball_rows_sum_to_one():
    x = draw('type: "positive_unitball"')
    assert x.min() >= 0 and x.max() <= 1
    np.testing.assert_allclose(x.reshape(SHAPE[0], -1).sum(1), 1, atol=1e-5)
    x = draw('type: "positive_unitball"', shape=(7,))    # 1-D: each row is one element
    np.testing.assert_allclose(x, 1)


FANS = {"FAN_IN": 40, "FAN_OUT": 20000, "AVERAGE": (40 + 20000) / 2}


@pytest.mark.parametrize("norm", FANS)
def test_xavier_bounds_and_variance(norm):
    n = FANS[norm]
    a = math.sqrt(3 / n)
    x = draw(f'type: "xavier" variance_norm: {norm}')
    assert np.abs(x).max() <= a * (1 + 1e-6) and np.abs(x).max() > 0.999 * a
    assert_stats(x, 0, math.sqrt(1 / n))     # U(-a, a) has variance a^2 / 3 = 1 / n


@pytest.mark.parametrize("norm", FANS)
def test_msra_variance(norm):
    n = FANS[norm]
    assert_stats(draw(f'type: "msra" variance_norm: {norm}'), 0, math.sqrt(2 / n))


@pytest.mark.parametrize("shape, fan_in, fan_out", [
    ((30, 40), 40, 30),                  # InnerProduct weight (num_output, inputs)
    ((16, 3, 5, 5), 75, 400),            # Convolution weight (out, in/group, kh, kw)
    ((50,), 1, 50),                      # 1-D: fan_in = count / shape(0), fan_out = count
    ((4, 6, 2, 3, 5), 180, 120),         # N-D: count / shape(0), count / shape(1)
])
def test_fans_as_caffe_computes_them(shape, fan_in, fan_out):
    for norm, n in (("FAN_IN", fan_in), ("FAN_OUT", fan_out), ("AVERAGE", (fan_in + fan_out) / 2)):
        bound = math.sqrt(3 / n)
        x = draw(f'type: "xavier" variance_norm: {norm}', shape=shape)
        assert np.abs(x).max() <= bound * (1 + 1e-6)
        if x.size >= 1000:
            assert np.abs(x).max() > 0.98 * bound


def test_layer_fillers_use_caffe_layouts():
    net = brewnet.Net(text_format.Parse("""
        layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
        layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param {
          num_output: 64 kernel_size: 5 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.2 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y" inner_product_param {
          num_output: 50 weight_filler { type: "msra" variance_norm: FAN_OUT } } }
    """, pb.NetParameter()), brewnet.TEST)
    w = net.layer_by_name["conv"].blobs[0].detach().numpy()
    bound = math.sqrt(3 / 75)                               # fan_in = 3 * 5 * 5
    assert np.abs(w).max() <= bound * (1 + 1e-6) and np.abs(w).max() > 0.95 * bound
    assert (net.layer_by_name["conv"].blobs[1].detach().numpy() == np.float32(0.2)).all()
    ip = net.layer_by_name["ip"].blobs[0].detach().numpy().astype(np.float64)
    assert ip.shape == (50, 64 * 4 * 4)
    assert_stats(ip, 0, math.sqrt(2 / 50))                  # fan_out = num_output


@pytest.mark.parametrize("k", [3, 4, 6, 7])
def test_bilinear_closed_form(k):
    x = draw('type: "bilinear"', shape=(3, 2, k, k))
    f = math.ceil(k / 2)
    c = (k - 1) / (2 * f)
    w1 = np.array([1 - abs(i / f - c) for i in range(k)])
    np.testing.assert_allclose(x, np.broadcast_to(np.outer(w1, w1), x.shape), rtol=1e-6)
    if k == 4:       # upsampling by 2: the classic [1 3 3 1]/4 kernel
        np.testing.assert_allclose(x[0, 0, 0], [1 / 16, 3 / 16, 3 / 16, 1 / 16], rtol=1e-6)


def test_seeded_fills_repeat():
    a = draw('type: "gaussian"', seed=5)
    b = draw('type: "gaussian"', seed=5)
    c = draw('type: "gaussian"', seed=6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_bad_filler_params():
    with pytest.raises(ValueError, match="Unknown filler type 'he'. Known: bilinear, constant, "
                                         "gaussian, msra, positive_unitball, uniform, xavier"):
        draw('type: "he"')
    with pytest.raises(ValueError, match="sparse is only supported by the gaussian filler"):
        draw('type: "xavier" sparse: 3')
    with pytest.raises(ValueError, match="bilinear filler needs a 4-D blob with square kernels"):
        draw('type: "bilinear"', shape=(2, 2, 3, 4))
    with pytest.raises(ValueError, match="sparse"):
        draw('type: "gaussian" sparse: 30', shape=(10, 5))   # keep probability 3 > 1
    assert sorted(FILLERS) == ["bilinear", "constant", "gaussian", "msra", "positive_unitball",
                               "uniform", "xavier"]
