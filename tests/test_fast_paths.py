"""The CPU speed paths give the same numbers as the plain formulas: oneDNN inner products (to
float rounding, and on Caffe's golden cases), the allocator setting, the fused SGD update (bit
for bit) and LRN in channels_last."""
from __future__ import annotations

import json
import os
import platform

import numpy as np
import pytest
import torch

import test_golden_layers as golden
from brewnet.layers import functional as Fn
from brewnet.memory import keep_freed_memory

needs_dnn = pytest.mark.skipif(Fn._dnn_linear() is None, reason="torch without oneDNN")


# -- inner product ----------------------------------------------------------------------------
@needs_dnn
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_dnn_inner_product_matches_float64(transpose, bias):
    g = torch.Generator().manual_seed(0)
    m, n, k = 7, 600, 500                      # 300k weights: above DNN_MIN_WEIGHT
    x = torch.randn(m, k, generator=g, requires_grad=True)
    w = (torch.randn((k, n) if transpose else (n, k), generator=g) * 0.1).requires_grad_()
    b = torch.randn(n, generator=g, requires_grad=True) if bias else None
    y = Fn.inner_product(x, w, b, transpose)
    assert type(y.grad_fn).__name__ == "_DnnInnerProductBackward"
    dy = torch.randn(m, n, generator=g)
    y.backward(dy)
    # float64 reference with numpy, not the same torch call
    xd, wd, dyd = x.detach().double().numpy(), w.detach().double().numpy(), dy.double().numpy()
    wnk = wd.T if transpose else wd
    ref = xd @ wnk.T + (b.detach().double().numpy() if bias else 0)
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dyd @ wnk, rtol=1e-5, atol=1e-5)
    dw = dyd.T @ xd
    np.testing.assert_allclose(w.grad.numpy(), dw.T if transpose else dw, rtol=1e-5, atol=1e-5)
    if bias:
        np.testing.assert_allclose(b.grad.numpy(), dyd.sum(0), rtol=1e-5, atol=1e-5)


@needs_dnn
def test_dnn_inner_product_follows_weight_changes_and_frozen_inputs():
    x = torch.randn(3, 1024)
    w = torch.randn(512, 1024, requires_grad=True)
    y1 = Fn.inner_product(x, w, None)
    with torch.no_grad():
        w.mul_(2)
    y2 = Fn.inner_product(x, w, None)
    torch.testing.assert_close(y2, 2 * y1, rtol=1e-6, atol=1e-4)
    y2.sum().backward()                        # x needs no gradient: only the weight's
    torch.testing.assert_close(w.grad, x.sum(0).expand(512, -1), rtol=1e-5, atol=1e-5)


def test_small_or_float64_inner_products_stay_on_blas():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    assert type(Fn.inner_product(x, w, None).grad_fn).__name__ == "MmBackward0"
    xd, wd = x.double(), torch.randn(600, 500, dtype=torch.float64)
    assert Fn.inner_product(xd[:, :8].repeat(1, 63)[:, :500], wd, None).dtype == torch.float64


IP_CASES = [c for c in golden.CASES if json.loads(str(np.load(golden.LAYERS / c["file"])["meta"]))
            ["type"] == "InnerProduct"]


@needs_dnn
@pytest.mark.parametrize("case", IP_CASES, ids=[c["file"][:-4] for c in IP_CASES])
def test_dnn_inner_product_on_caffe_golden_cases(case, monkeypatch):
    monkeypatch.setattr(Fn, "DNN_MIN_WEIGHT", 0)
    golden.test_golden_layer(case)


# -- allocator --------------------------------------------------------------------------------
def test_keep_freed_memory_on_glibc():
    first = keep_freed_memory()
    assert keep_freed_memory() is first        # once per process
    if platform.libc_ver()[0] == "glibc" and os.environ.get("BREWNET_KEEP_MEMORY", "1") != "0":
        assert first is True
