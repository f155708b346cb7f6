"""The L2Normalize plugin's tests, as a Caffe layer's gtest would be: forward against a numpy
reference, backward against the formula and Caffe's gradient checker. Run: pytest examples/new_layer"""
from __future__ import annotations

import l2_normalize  # noqa: F401  (registers L2Normalize; an installed plugin needs no import)
import numpy as np
import pytest
import torch

from brewnet.layers import create_layer
from brewnet.testing import GradientChecker

LAYER = 'name: "norm" type: "L2Normalize" bottom: "x" top: "y" python_param { param_str: "%s" }'


def layer(param_str=""):
    return create_layer(LAYER % param_str)


def reference(x, eps=1e-10):
    n = np.sqrt((x.reshape(len(x), -1) ** 2).sum(1) + eps).reshape((-1,) + (1,) * (x.ndim - 1))
    return x / n


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4, 5)])
def test_forward_matches_numpy(shape):
    x = np.random.default_rng(0).standard_normal(shape)
    l = layer()
    assert l.set_up([shape]) == [shape]
    y = l.forward([torch.from_numpy(x)])[0].numpy()
    np.testing.assert_allclose(y, reference(x), rtol=1e-12)
    np.testing.assert_allclose((y.reshape(shape[0], -1) ** 2).sum(1), 1, rtol=1e-9)  # eps: 1e-10 off


def test_backward_matches_the_formula():
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    l = layer("eps=0")
    l.set_up([x.shape])
    t = torch.from_numpy(x).requires_grad_(True)
    l.forward([t])[0].backward(torch.from_numpy(dy))
    y, n = reference(x, 0), np.sqrt((x ** 2).sum((1, 2), keepdims=True))
    dx = (dy - y * (y * dy).sum((1, 2), keepdims=True)) / n
    np.testing.assert_allclose(t.grad.numpy(), dx, rtol=1e-12)


@pytest.mark.parametrize("dtype,step,threshold", [(torch.float32, 1e-2, 1e-3), (torch.float64, 1e-6, 1e-8)])
def test_gradient_checker(dtype, step, threshold):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 2, 2, dtype=dtype)
    result = GradientChecker(step, threshold).check_gradient_exhaustive(layer(), [x])
    assert result.compared == 24 * 24 and result.skipped == 0


def test_bad_param_str_names_the_layer():
    with pytest.raises(ValueError, match=r"Layer 'norm' \(type L2Normalize\).*'eps' must be float"):
        layer("eps=tiny").set_up([(2, 3)])
