"""The CPU speed paths give the same numbers as the plain formulas: oneDNN inner products (to
float rounding, and on Caffe's golden cases), the allocator setting, the fused SGD update (bit
for bit), 1-channel inputs in NHWC and LRN in channels_last."""
from __future__ import annotations

import json
import os
import platform

import numpy as np
import pytest
import torch

import test_golden_layers as golden
from brewnet.execution import determinism
from brewnet.layers import functional as Fn
from brewnet.runtime import keep_freed_memory
from brewnet.solvers import fused, sgd
from test_solvers import golden_solver

needs_dnn = pytest.mark.skipif(Fn._dnn_linear() is None, reason="torch without oneDNN")


# -- inner product ----------------------------------------------------------------------------
@needs_dnn
@pytest.mark.parametrize("grads", ["mkl", "onednn"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_dnn_inner_product_matches_float64(transpose, bias, grads, monkeypatch):
    """Both ways to the gradients: MKL's products (strict mode, as ``import brewnet`` sets it)
    and oneDNN's, where MKL ran before brewnet could ask for strict mode."""
    if grads == "onednn":
        monkeypatch.setattr(determinism, "mkl_strict", lambda: False)
    elif not determinism.mkl_strict():
        pytest.skip("MKL ran in this process before brewnet was imported: not in strict mode")
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
@pytest.mark.parametrize("m,k,n,transpose", [(64, 800, 500, False), (10, 2048, 1024, False),
                                             (3, 1024, 512, True)])
def test_dnn_inner_product_gradients_same_bits_on_1_2_4_threads(m, k, n, transpose):
    """LeNet's ip1, a CaffeNet-like fc at batch 10 (smaller), a few rows (MKL on one thread)."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(m, k, generator=g)
    w0 = torch.randn((k, n) if transpose else (n, k), generator=g) * 0.05
    dy = torch.randn(m, n, generator=g)
    before, got = torch.get_num_threads(), []
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            Fn.inner_product(x, w, None, transpose).backward(dy)
            got.append((x.grad, w.grad))
    finally:
        torch.set_num_threads(before)
    for dx, dw in got[1:]:
        assert torch.equal(dx, got[0][0]) and torch.equal(dw, got[0][1])


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


# -- fused SGD update -------------------------------------------------------------------------
needs_fused = pytest.mark.skipif(not fused.fused_sgd_matches(),
                                 reason="torch's fused SGD kernel differs here: plain ops used")


def _plain(monkeypatch):
    monkeypatch.setattr(sgd, "fused_sgd_matches", lambda: False)
    monkeypatch.setattr(sgd, "sgd_update", None)             # would fail if still reached


@needs_fused
@pytest.mark.parametrize("case, extra", [
    ("type_sgd", ""),
    ("policy_step", ""),                                    # rate changes mid-run
    ("type_sgd", 'iter_size: 2'),
    ("type_sgd", 'clip_gradients: 0.01'),
])
def test_fused_sgd_is_bitwise_the_plain_update(case, extra, monkeypatch):
    fused, _ = golden_solver(case, extra)
    fused.step(4)
    fused.step(3)
    _plain(monkeypatch)
    plain, _ = golden_solver(case, extra)
    plain.step(7)
    for a, b in zip(fused.net.learnable, plain.net.learnable):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(a.grad, b.grad)                  # the diff holds the step after step()
    for a, b in zip(fused.history, plain.history):
        assert torch.equal(a, b)


@needs_fused
def test_fused_sgd_on_large_odd_params(monkeypatch):
    # sizes whose thread chunks and tails fall mid-vector (CaffeNet's conv1: 34848)
    shapes = [(96, 3, 11, 11), (384, 256, 3, 3), (1000, 4096), (1000,), (7,)]
    g = torch.Generator().manual_seed(1)
    results = []
    for plain in (False, True):
        if plain:
            _plain(monkeypatch)
        s, _ = golden_solver("type_sgd")
        g.manual_seed(1)
        params = [torch.randn(sh, generator=g).mul_(0.01) for sh in shapes]
        s.net.learnable[:] = params
        s.net.lr_mults[:], s.net.decay_mults[:] = [1, 2, 1, 2, 1], [1, 0, 1, 0, 1]
        s.history = [torch.zeros_like(p) for p in params]
        for k in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            s.apply_update()
        results.append((params, s.history))
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_diff_holds_the_step_after_step_and_in_snapshots(tmp_path):
    s, _ = golden_solver("type_sgd", f'snapshot: 2 snapshot_prefix: "{tmp_path}/s" '
                                     'snapshot_diff: true')
    s.step(3)
    for t, h in zip(s.net.learnable, s.history):
        assert torch.equal(t.grad, h)                       # SGD's step is the new history
    # the snapshot at iteration 2 was written mid-loop: its diffs are that update's steps
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import read_binary
    net = read_binary(tmp_path / "s_iter_2.caffemodel", pb.NetParameter())
    st = read_binary(tmp_path / "s_iter_2.solverstate", pb.SolverState())
    diffs = [np.asarray(b.diff, np.float32) for lp in net.layer for b in lp.blobs]
    hist = [np.asarray(b.data, np.float32) for b in st.history]
    assert len(diffs) == len(hist) > 0
    for d, h in zip(diffs, hist):
        np.testing.assert_array_equal(d, h)


# -- channels_last ----------------------------------------------------------------------------
ONE_CHANNEL = """
layer { name: "data" type: "Input" top: "data" top: "target"
  input_param { shape { dim: 4 dim: 1 dim: 12 dim: 12 } shape { dim: 4 dim: 5 dim: 5 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "pool" bottom: "target" top: "loss" }
"""


def test_one_channel_input_still_computes_in_nhwc():
    from brewnet import Net
    from brewnet.proto import caffe_pb2 as pb
    net = Net(ONE_CHANNEL, pb.TRAIN)
    g = torch.Generator().manual_seed(0)
    net.blobs["data"].data[...] = torch.randn(4, 1, 12, 12, generator=g).numpy()
    net.blobs["target"].data[...] = torch.randn(4, 5, 5, 5, generator=g).numpy()
    outs = []
    for nhwc in (True, False):
        net._channels_last = nhwc
        net.clear_param_diffs()
        net.forward()
        net.backward()
        conv = net.blobs["conv"].tensor
        assert conv.is_contiguous(memory_format=torch.channels_last) == nhwc
        assert (conv.stride(1) == 1) == nhwc
        outs.append((net.blobs["pool"].data.copy(), net.params["conv"][0].diff.copy()))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-6)


def test_lrn_across_channels_in_nhwc_matches_nchw():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 10, 5, 7, generator=g) * 5).requires_grad_()
    dy = torch.randn(3, 10, 5, 7, generator=g)
    xc = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    y = Fn.lrn_across_channels(x, 5, 1e-2, 0.75, 2.0)
    yc = Fn.lrn_across_channels(xc, 5, 1e-2, 0.75, 2.0)
    y.backward(dy)
    yc.backward(dy)
    assert yc.is_contiguous(memory_format=torch.channels_last)
    # same sums in the same order; elementwise kernels may round a tail element by an ulp
    torch.testing.assert_close(yc, y, rtol=1e-6, atol=0)
    torch.testing.assert_close(xc.grad, x.grad, rtol=1e-6, atol=1e-7)
    # and the formula itself, in float64 numpy: x / (k + alpha/n sum_window x^2)^beta
    xd = x.detach().double().numpy()
    sq = np.pad(xd ** 2, ((0, 0), (2, 2), (0, 0), (0, 0)))
    win = sum(sq[:, i:i + 10] for i in range(5))
    np.testing.assert_allclose(yc.detach().numpy(), xd / (2.0 + 1e-2 / 5 * win) ** 0.75,
                               rtol=1e-5, atol=1e-6)
