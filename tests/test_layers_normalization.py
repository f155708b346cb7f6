"""BatchNorm, Scale, Bias, MVN against numpy references and Caffe's C++ test facts; float64
gradient checks (MVN's normalize-variance backward against a numpy copy of Caffe's formula)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brewnet.layers.base import LayerError
from brewnet.proto import caffe_pb2 as pb
from helpers import gradcheck_layer, make_layer

RNG = np.random.default_rng(1701)


def randn(*shape, mean=0.0, std=1.0):
    return torch.tensor(RNG.normal(mean, std, shape))


def bn(params, shape, phase=pb.TRAIN):
    return make_layer(f'name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                      f'batch_norm_param {{ {params} }}', [shape], phase)[0]


# -- BatchNorm -------------------------------------------------------------------------------------
def test_batchnorm_train_mean0_var1():
    # test_batch_norm_layer.cpp: 5x2x3x4 gaussian -> each channel has mean ~0, variance ~1.
    layer = bn("", (5, 2, 3, 4))
    y = layer.forward([randn(5, 2, 3, 4, mean=3, std=2).float()])[0].detach().double()
    for c in range(2):
        v = y[:, c].reshape(-1)
        assert abs(v.mean()) < 1e-3
        assert abs(v.var(unbiased=False) - 1) < 1e-3


def test_batchnorm_running_blobs_follow_caffe_sums():
    layer = bn("moving_average_fraction: 0.9 eps: 1e-4", (4, 3, 2, 2))
    blobs = [torch.tensor(RNG.normal(size=3), dtype=torch.float32),
             torch.tensor(RNG.uniform(0.5, 2, size=3), dtype=torch.float32), torch.tensor([2.0])]
    with torch.no_grad():
        for b, v in zip(layer.blobs, blobs):
            b.copy_(v)
    x = randn(4, 3, 2, 2, mean=0.5, std=1.5).float()
    y = layer.forward([x])[0]
    xn = x.double().numpy().transpose(1, 0, 2, 3).reshape(3, -1)
    mean, var = xn.mean(1), xn.var(1)            # biased variance normalizes the batch
    m = xn.shape[1]
    np.testing.assert_allclose(layer.blobs[2].numpy(), [0.9 * 2 + 1], rtol=1e-6)
    np.testing.assert_allclose(layer.blobs[0].numpy(), mean + 0.9 * blobs[0].numpy(), rtol=1e-5)
    np.testing.assert_allclose(layer.blobs[1].numpy(), m / (m - 1) * var + 0.9 * blobs[1].numpy(),
                               rtol=1e-5)
    ref = (xn - mean[:, None]) / np.sqrt(var[:, None] + 1e-4)
    np.testing.assert_allclose(y.detach().numpy().transpose(1, 0, 2, 3).reshape(3, -1), ref,
                               rtol=1e-4, atol=1e-5)


def test_batchnorm_global_stats_divide_by_factor():
    layer = bn("eps: 1e-3", (3, 4, 2, 2), phase=pb.TEST)   # TEST: global stats by default
    assert layer.use_global_stats
    with torch.no_grad():
        layer.blobs[0].copy_(torch.tensor([1.0, -2.0, 0.5, 3.0]))
        layer.blobs[1].copy_(torch.tensor([2.0, 4.0, 1.0, 0.5]))
        layer.blobs[2].fill_(2.5)
    before = [b.clone() for b in layer.blobs]
    x = randn(3, 4, 2, 2)
    y = layer.forward([x])[0]
    mean = np.array([1.0, -2.0, 0.5, 3.0]) / 2.5
    var = np.array([2.0, 4.0, 1.0, 0.5]) / 2.5
    ref = (x.numpy() - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-3)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.blobs))   # not updated


def test_batchnorm_zero_factor_means_zero_stats():
    layer = bn("use_global_stats: true", (2, 3))
    x = randn(2, 3)
    np.testing.assert_allclose(layer.forward([x])[0].numpy(), x.numpy() / np.sqrt(1e-5), rtol=1e-6)


def test_batchnorm_use_global_stats_false_in_test_updates():
    layer = bn("use_global_stats: false", (4, 2), phase=pb.TEST)
    layer.forward([randn(4, 2)])
    assert layer.blobs[2].item() == 1.0


def test_batchnorm_2d_and_5d_inputs():
    for shape in [(6, 3), (2, 3, 2, 2, 3)]:
        layer = bn("", shape)
        x = randn(*shape)
        y = layer.forward([x])[0]
        dims = tuple(d for d in range(len(shape)) if d != 1)
        xn = x.numpy()
        ref = (xn - xn.mean(dims, keepdims=True)) / np.sqrt(xn.var(dims, keepdims=True) + 1e-5)
        np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-6, atol=1e-7)


def test_batchnorm_blobs_get_no_gradient():
    layer = bn("", (4, 3, 2))
    assert all(not b.requires_grad for b in layer.blobs)
    x = randn(4, 3, 2).float().requires_grad_(True)
    (layer.forward([x])[0] * randn(4, 3, 2).float()).sum().backward()
    assert x.grad is not None
    assert all(b.grad is None and b.grad_fn is None for b in layer.blobs)


def test_batchnorm_float64_input_keeps_float32_blobs():
    layer = bn("", (4, 3))
    layer.forward([randn(4, 3)])
    assert all(b.dtype == torch.float32 for b in layer.blobs)


def test_batchnorm_rejects_learnable_stats():
    with pytest.raises(LayerError, match="lr_mult"):
        make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" param { lr_mult: 1 }',
                   [(2, 3)], pb.TRAIN)


def test_batchnorm_channel_mismatch():
    layer = bn("", (2, 3, 4))
    with pytest.raises(LayerError, match=r"\(2, 5, 4\)"):
        layer.reshape([(2, 5, 4)])


@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST])
def test_batchnorm_gradcheck(phase):
    layer = bn("eps: 1e-3", (3, 2, 2, 2), phase)
    with torch.no_grad():
        layer.blobs[0].copy_(torch.tensor([0.3, -0.2]))
        layer.blobs[1].copy_(torch.tensor([1.5, 0.7]))
        layer.blobs[2].fill_(1.5)
    assert gradcheck_layer(layer, [randn(3, 2, 2, 2)], check_params=False)


# -- Scale / Bias ----------------------------------------------------------------------------------
BROADCASTS = [((2, 3, 4, 5), 0), ((2, 3), 0), ((3, 4), 1), ((4, 5), 2), ((), 1)]


@pytest.mark.parametrize("operand,axis", BROADCASTS)
@pytest.mark.parametrize("kind", ["Scale", "Bias"])
def test_two_bottom_broadcast(kind, operand, axis):
    # test_scale_layer.cpp / test_bias_layer.cpp shapes: eltwise, begin, middle, end, scalar.
    field = "scale_param" if kind == "Scale" else "bias_param"
    layer, tops = make_layer(f'name: "s" type: "{kind}" bottom: "x" bottom: "s" top: "y" '
                             f'{field} {{ axis: {axis} }}', [(2, 3, 4, 5), operand])
    assert tops == [(2, 3, 4, 5)]
    x, s = randn(2, 3, 4, 5), randn(*operand)
    a = 0 if not operand else axis
    sb = s.numpy().reshape((1,) * a + operand + (1,) * (4 - a - len(operand)))
    ref = x.numpy() * sb if kind == "Scale" else x.numpy() + sb
    np.testing.assert_allclose(layer.forward([x, s])[0].numpy(), ref, rtol=1e-12)
    assert gradcheck_layer(layer, [x, s])


def test_scale_learned_defaults_and_param_order():
    layer, _ = make_layer('name: "s" type: "Scale" bottom: "x" top: "y" scale_param { axis: 1 '
                          'num_axes: 2 bias_term: true bias_filler { type: "constant" value: 0.5 } }',
                          [(2, 3, 4, 5)])
    assert [tuple(b.shape) for b in layer.blobs] == [(3, 4), (3, 4)]
    assert torch.all(layer.blobs[0] == 1) and torch.all(layer.blobs[1] == 0.5)
    x = randn(2, 3, 4, 5).float()
    np.testing.assert_allclose(layer.forward([x])[0].detach().numpy(), x.numpy() + 0.5, rtol=1e-6)


@pytest.mark.parametrize("num_axes,shape", [(-1, (3, 4, 5)), (0, ()), (1, (3,))])
def test_scale_num_axes(num_axes, shape):
    layer, _ = make_layer(f'name: "s" type: "Scale" bottom: "x" top: "y" scale_param {{ '
                          f'num_axes: {num_axes} filler {{ type: "gaussian" }} bias_term: true }}',
                          [(2, 3, 4, 5)])
    assert [tuple(b.shape) for b in layer.blobs] == [shape, shape]
    with torch.no_grad():
        layer.blobs[1].normal_()
    assert gradcheck_layer(layer, [randn(2, 3, 4, 5)])


def test_scale_two_bottom_bias_gradcheck():
    layer, _ = make_layer('name: "s" type: "Scale" bottom: "x" bottom: "s" top: "y" scale_param '
                          '{ axis: 0 bias_term: true bias_filler { type: "gaussian" std: 0.3 } }',
                          [(2, 3, 2), (2, 3)])
    assert [tuple(b.shape) for b in layer.blobs] == [(2, 3)]      # the bias only
    assert gradcheck_layer(layer, [randn(2, 3, 2), randn(2, 3)])


def test_bias_learned_default_zero_and_gradcheck():
    layer, _ = make_layer('name: "b" type: "Bias" bottom: "x" top: "y" bias_param { axis: -2 }',
                          [(2, 3, 4)])
    assert tuple(layer.blobs[0].shape) == (3,) and torch.all(layer.blobs[0] == 0)
    with torch.no_grad():
        layer.blobs[0].normal_()
    assert gradcheck_layer(layer, [randn(2, 3, 4)])


@pytest.mark.parametrize("kind", ["Scale", "Bias"])
def test_operand_shape_mismatch(kind):
    with pytest.raises(LayerError, match=r"\(3, 5\).*\(2, 3, 4, 5\)"):
        make_layer(f'name: "s" type: "{kind}" bottom: "x" bottom: "s" top: "y"',
                   [(2, 3, 4, 5), (3, 5)])


def test_scale_bad_num_axes():
    with pytest.raises(LayerError, match="num_axes"):
        make_layer('name: "s" type: "Scale" bottom: "x" top: "y" scale_param { num_axes: -2 }',
                   [(2, 3)])
    with pytest.raises(LayerError, match="extends past"):
        make_layer('name: "s" type: "Scale" bottom: "x" top: "y" scale_param { axis: 1 num_axes: 3 }',
                   [(2, 3, 4)])


# -- MVN -------------------------------------------------------------------------------------------
def mvn_layer(params, shape):
    return make_layer(f'name: "m" type: "MVN" bottom: "x" top: "y" mvn_param {{ {params} }}',
                      [shape])[0]


def mvn_ref(x, normalize_variance, across, eps):
    n, c = x.shape[:2]
    rows = x.reshape(n, -1) if across else x.reshape(n * c, -1)
    z = rows - rows.mean(1, keepdims=True)
    std = np.sqrt((z ** 2).mean(1, keepdims=True))
    y = z / (std + eps) if normalize_variance else z
    return y.reshape(x.shape), std


@pytest.mark.parametrize("params,nv,across,eps", [("", True, False, 1e-9),
                                                  ("normalize_variance: false", False, False, 1e-9),
                                                  ("across_channels: true eps: 0.5", True, True, 0.5)])
def test_mvn_forward(params, nv, across, eps):
    x = randn(2, 3, 4, 5, mean=2, std=3)
    y = mvn_layer(params, (2, 3, 4, 5)).forward([x])[0].detach().numpy()
    np.testing.assert_allclose(y, mvn_ref(x.numpy(), nv, across, eps)[0], rtol=1e-10, atol=1e-12)
    rows = y.reshape(2, -1) if across else y.reshape(6, -1)
    np.testing.assert_allclose(rows.mean(1), 0, atol=1e-10)          # test_mvn_layer.cpp checks
    if nv and eps < 1e-6:
        np.testing.assert_allclose(rows.var(1), 1, rtol=1e-6)


def test_mvn_backward_is_caffes_formula():
    # Caffe: dx = (dy - mean(dy) - mean(dy*y)*y) / (std + eps); with a large eps this differs
    # from the exact derivative, so compare with that formula, not with finite differences.
    eps = 0.25                      # exact in float32 (the proto field is a float)
    x, dy = randn(2, 3, 4, mean=1, std=2), randn(2, 3, 4)
    x.requires_grad_(True)
    (mvn_layer(f"eps: {eps}", (2, 3, 4)).forward([x])[0] * dy).sum().backward()
    y, std = mvn_ref(x.detach().numpy(), True, False, eps)
    y, d = y.reshape(6, -1), dy.numpy().reshape(6, -1)
    ref = (d - d.mean(1, keepdims=True) - (d * y).mean(1, keepdims=True) * y) / (std + eps)
    np.testing.assert_allclose(x.grad.numpy().reshape(6, -1), ref, rtol=1e-10)


@pytest.mark.parametrize("params", ["", "normalize_variance: false",
                                    "across_channels: true"])
def test_mvn_gradcheck(params):
    # With the default eps 1e-9 Caffe's formula equals the exact derivative to ~1e-9.
    assert gradcheck_layer(mvn_layer(params, (2, 3, 2, 3)), [randn(2, 3, 2, 3, mean=1, std=2)])
