"""Neuron layers: numpy references, Caffe's gradients at kinks, float64 gradient checks, and
the literal facts of Caffe's test_neuron_layer.cpp / test_threshold_layer.cpp."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from helpers import gradcheck_layer, make_layer


def layer(type_, params="", shape=(2, 3, 4, 5), phase=pb.TEST):
    text = f'name: "n" type: "{type_}" bottom: "x" top: "y" {params}'
    return make_layer(text, [shape], phase)[0]


def run(l, x):
    return l.forward([x])[0]


def grad(l, x):
    """d sum(y) / dx for a float64 leaf copy of x."""
    x = x.detach().double().requires_grad_(True)
    run(l, x).sum().backward()
    return x.grad


def away_from(x, points, margin=0.05):
    """Shift entries within ``margin`` of any kink in ``points`` (Caffe's checker skips kinks)."""
    for p in points:
        near = (x - p).abs() < margin
        x = torch.where(near, x + 2 * margin, x)
    return x


@pytest.fixture
def x():
    torch.manual_seed(1701)
    return torch.randn(2, 3, 4, 5, dtype=torch.float64)


GRADCHECK = [
    ("ReLU", "", [0.0]),
    ("ReLU", "relu_param { negative_slope: 0.01 }", [0.0]),
    ("ELU", "elu_param { alpha: 0.5 }", [0.0]),
    ("Sigmoid", "", []),
    ("TanH", "", []),
    ("AbsVal", "", [0.0]),
    ("BNLL", "", []),
    ("Power", "power_param { power: 2 scale: 0.83 shift: -2.4 }", []),
    ("Power", "power_param { power: 0.37 scale: 0.83 shift: 2.4 }", []),
    ("Power", "power_param { power: 1 scale: 0.83 shift: -2.4 }", []),
    ("Exp", "exp_param { base: 2 scale: 3 shift: 1 }", []),
    ("Log", "log_param { base: 2 scale: 3 shift: 10 }", []),
    ("Clip", "clip_param { min: -1 max: 2 }", [-1.0, 2.0]),
    ("Swish", "swish_param { beta: 1.5 }", []),
    ("Dropout", "", []),  # TEST phase: identity
]


@pytest.mark.parametrize("type_,params,kinks", GRADCHECK, ids=[f"{t}:{p}" for t, p, _ in GRADCHECK])
def test_gradcheck(type_, params, kinks, x):
    assert gradcheck_layer(layer(type_, params), [away_from(x, kinks)])


@pytest.mark.parametrize("shared", [False, True])
def test_prelu_gradcheck_and_blob_shape(shared, x):
    l = layer("PReLU", f"prelu_param {{ channel_shared: {str(shared).lower()} }}")
    assert tuple(l.blobs[0].shape) == (() if shared else (3,))
    assert torch.all(l.blobs[0] == 0.25)  # Caffe's default filler: constant 0.25
    with torch.no_grad():
        l.blobs[0].copy_(torch.tensor(0.3) if shared else torch.tensor([0.1, -0.4, 0.7]))
    assert gradcheck_layer(l, [away_from(x, [0.0])])


def test_prelu_equals_leaky_relu(x):
    """Caffe: PReLU with slope 0.25 gives ReLU(negative_slope 0.25)'s forward and backward."""
    x = torch.cat([x.flatten(), torch.zeros(6, dtype=x.dtype)]).reshape(2, 3, 21)
    p, r = layer("PReLU", shape=(2, 3, 21)), layer("ReLU", "relu_param { negative_slope: 0.25 }")
    p.blobs = [b.double() for b in p.blobs]
    assert torch.equal(run(p, x), run(r, x))
    assert torch.equal(grad(p, x), grad(r, x))


def test_prelu_slope_per_channel_and_diff():
    l = layer("PReLU", shape=(2, 3, 2))
    l.blobs = [torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64, requires_grad=True)]
    x = torch.tensor([[[-1.0, 2.0], [-3.0, 0.0], [-2.0, 1.0]]] * 2, dtype=torch.float64)
    want = np.array([[[-0.5, 2.0], [-6.0, 0.0], [2.0, 1.0]]] * 2)
    y = run(l, x)
    np.testing.assert_array_equal(y.detach().numpy(), want)
    y.sum().backward()
    # slope diff = sum of x where x <= 0 (x == 0 contributes 0)
    np.testing.assert_array_equal(l.blobs[0].grad.numpy(), [-2.0, -6.0, -4.0])


def test_prelu_needs_two_axes():
    with pytest.raises(LayerError, match="at least 2 axes"):
        layer("PReLU", shape=(5,))


def test_kink_gradients_follow_caffe():
    x = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)
    assert grad(layer("ReLU"), x).tolist() == [0.0, 0.0, 1.0]
    slope = float(np.float32(0.01))  # proto floats are float32
    assert grad(layer("ReLU", "relu_param { negative_slope: 0.01 }"), x).tolist() == [slope, slope, 1.0]
    assert grad(layer("ELU", "elu_param { alpha: 0.5 }"), x)[1] == 0.5  # x <= 0 branch: alpha*e^0
    assert grad(layer("AbsVal"), x).tolist() == [-1.0, 0.0, 1.0]
    assert grad(layer("BNLL"), x)[1] == 0.5
    c = torch.tensor([-1.5, -1.0, 0.0, 2.0, 2.5], dtype=torch.float64)
    assert grad(layer("Clip", "clip_param { min: -1 max: 2 }"), c).tolist() == [0, 1, 1, 1, 0]


def test_relu_leaky_formula(x):
    y = run(layer("ReLU", "relu_param { negative_slope: 0.01 }"), x).numpy()
    xn = x.numpy()
    np.testing.assert_allclose(y, np.maximum(xn, 0) + 0.01 * np.minimum(xn, 0), rtol=1e-7)


def test_elu_sigmoid_tanh_absval_formulas(x):
    xn = x.numpy()
    np.testing.assert_allclose(run(layer("ELU", "elu_param { alpha: 0.5 }"), x).numpy(),
                               np.where(xn > 0, xn, 0.5 * (np.exp(xn) - 1)), rtol=1e-12)
    np.testing.assert_allclose(run(layer("Sigmoid"), x).numpy(), 1 / (1 + np.exp(-xn)), rtol=1e-12)
    np.testing.assert_allclose(run(layer("TanH"), x).numpy(), np.tanh(xn), rtol=1e-12)
    np.testing.assert_array_equal(run(layer("AbsVal"), x).numpy(), np.abs(xn))


def test_bnll_stable_and_above_relu():
    x = torch.tensor([-200.0, -30.0, -1.0, 0.0, 1.0, 30.0, 200.0])
    y = run(layer("BNLL"), x)
    assert torch.isfinite(y).all()
    assert torch.all(y >= torch.relu(x))  # Caffe's test: BNLL(x) >= max(0, x)
    np.testing.assert_allclose(y.numpy(), np.logaddexp(0, x.numpy()), rtol=1e-6)
    g = grad(layer("BNLL"), x)
    assert torch.isfinite(g).all() and g[-1] == 1.0 and g[0] < 1e-80


@pytest.mark.parametrize("p,scale,shift", [(0.37, 0.83, 2.4), (2, 0.83, -2.4), (1, 0.83, -2.4),
                                           (3, 1, 0), (0.5, 2, 3)])
def test_power_formula(p, scale, shift):
    x = torch.linspace(0.1, 2.0, 20, dtype=torch.float64)
    l = layer("Power", f"power_param {{ power: {p} scale: {scale} shift: {shift} }}")
    f32 = lambda v: float(np.float32(v))  # noqa: E731  (params are float32 in the proto)
    base = f32(shift) + f32(scale) * x.numpy()
    np.testing.assert_allclose(run(l, x).numpy(), base ** f32(p), rtol=1e-12)
    np.testing.assert_allclose(grad(l, x).numpy(), f32(p) * f32(scale) * base ** (f32(p) - 1), rtol=1e-10)


@pytest.mark.parametrize("params,value", [("power: 0 scale: 0.83 shift: -2.4", 1.0),
                                          ("power: 2 scale: 0 shift: 3", 9.0),
                                          ("power: 0", 1.0)])
def test_power_ignores_input_when_power_or_scale_is_zero(params, value):
    """Caffe: power * scale == 0 -> constant top (1 if power 0, else shift^power), zero diff."""
    x = torch.tensor([-1.0, 0.0, 2.0, float("inf")], requires_grad=True)
    y = run(layer("Power", f"power_param {{ {params} }}"), x)
    assert y.tolist() == [value] * 4
    assert not y.requires_grad  # nothing flows back: the net gives the bottom a zero diff


@pytest.mark.parametrize("base", [-1, 2])
@pytest.mark.parametrize("scale", [1, 3])
@pytest.mark.parametrize("shift", [0, 1])
def test_exp_and_log_formulas(base, scale, shift):
    """Caffe's test_neuron_layer: bases e and 2, shift 0/1, scale 1/3."""
    x = torch.linspace(0.5, 2.0, 16, dtype=torch.float64)
    b = math.e if base == -1 else base
    p = f"base: {base} scale: {scale} shift: {shift}"
    ye = run(layer("Exp", f"exp_param {{ {p} }}"), x).numpy()
    np.testing.assert_allclose(ye, b ** (shift + scale * x.numpy()), rtol=1e-6)
    yl = run(layer("Log", f"log_param {{ {p} }}"), x).numpy()
    np.testing.assert_allclose(yl, np.log(shift + scale * x.numpy()) / np.log(b), rtol=1e-6)


@pytest.mark.parametrize("type_", ["Exp", "Log"])
def test_exp_log_reject_bad_base(type_):
    with pytest.raises(LayerError, match="base must be strictly positive"):
        layer(type_, f"{type_.lower()}_param {{ base: -2 }}")


def test_threshold_strict_and_no_backward():
    x = torch.tensor([0.2, 0.5, 0.50001, 3.0], requires_grad=True)
    l = layer("Threshold", "threshold_param { threshold: 0.5 }")
    y = run(l, x)
    assert y.tolist() == [0.0, 0.0, 1.0, 1.0] and y.dtype == x.dtype
    assert not y.requires_grad and not l.allow_backward(0)
    z = torch.randn(100)
    assert set(run(layer("Threshold"), z).unique().tolist()) <= {0.0, 1.0}


def test_clip_formula_and_bad_params():
    x = torch.linspace(-3, 3, 13)
    np.testing.assert_array_equal(run(layer("Clip", "clip_param { min: -1 max: 2 }"), x).numpy(),
                                  np.clip(x.numpy(), -1, 2))
    with pytest.raises(LayerError, match="min"):
        layer("Clip", "clip_param { min: 3 max: 2 }")
    with pytest.raises(LayerError, match="needs both"):
        layer("Clip", "clip_param { max: 2 }")


def test_swish_formula_and_beta_zero(x):
    xn = x.numpy()
    y = run(layer("Swish", "swish_param { beta: 1.5 }"), x).numpy()
    np.testing.assert_allclose(y, xn / (1 + np.exp(-1.5 * xn)), rtol=1e-12)
    np.testing.assert_allclose(run(layer("Swish", "swish_param { beta: 0 }"), x).numpy(), xn / 2)


@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_dropout_train_statistics(ratio):
    """Caffe: kept values are x / (1 - ratio); the kept fraction is within 1.96 std errors."""
    torch.manual_seed(1701)
    x = torch.rand(20000) + 1.0
    l = layer("Dropout", f"dropout_param {{ dropout_ratio: {ratio} }}", phase=pb.TRAIN)
    y = run(l, x)
    kept = y != 0
    np.testing.assert_allclose(y[kept].numpy(), x[kept].numpy() / (1 - ratio), rtol=1e-6)
    n, p = x.numel(), 1 - ratio
    assert abs(kept.float().mean().item() - p) <= 1.96 * math.sqrt(p * (1 - p) / n)
    xg = x.clone().requires_grad_(True)
    torch.manual_seed(5)
    y = run(l, xg)
    y.sum().backward()
    np.testing.assert_allclose(xg.grad.numpy(), (y != 0).float().numpy() / np.float32(1 - ratio), rtol=1e-6)


def test_dropout_test_phase_identity_and_bad_ratio():
    x = torch.randn(3, 4)
    assert torch.equal(run(layer("Dropout", phase=pb.TEST), x), x)
    with pytest.raises(LayerError, match="dropout_ratio"):
        layer("Dropout", "dropout_param { dropout_ratio: 1.0 }")


@pytest.mark.parametrize("type_", ["ReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Power",
                                   "Exp", "Log", "Swish", "Threshold", "PReLU"])
def test_dtype_preserved(type_, x):
    l = layer(type_)
    l.blobs = [b.double() for b in l.blobs]
    assert run(l, x.abs() + 0.1).dtype == torch.float64
