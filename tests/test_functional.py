"""brewnet.layers.functional against slow numpy re-implementations of Caffe's CPU loops
(pooling_layer.cpp, lrn_layer.cpp, im2col.cpp, deconv), Caffe's literal test numbers, and
float64 gradient checks."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from brewnet.layers import functional as Fn
from brewnet.layers import pooling as Pool

FLT_MAX = float(np.finfo(np.float32).max)


# -- slow references (Caffe's loops, written out) -------------------------------------------------
def caffe_pooled(h, k, s, p, ceil_mode, any_pad):
    o = int(math.ceil((h + 2 * p - k) / s) if ceil_mode else math.floor((h + 2 * p - k) / s)) + 1
    if any_pad and (o - 1) * s >= h + p:
        o -= 1
    return o


def ref_pool(x, method, k, s, p, ceil_mode=True, top_diff=None):
    """Caffe CPU pooling on a numpy (N, C, H, W): returns top, mask, bottom_diff."""
    n, c, h, w = x.shape
    any_pad = p[0] != 0 or p[1] != 0
    oh = caffe_pooled(h, k[0], s[0], p[0], ceil_mode, any_pad)
    ow = caffe_pooled(w, k[1], s[1], p[1], ceil_mode, any_pad)
    top = np.zeros((n, c, oh, ow))
    mask = -np.ones((n, c, oh, ow))
    bdiff = np.zeros_like(x, dtype=np.float64)
    if top_diff is None:
        top_diff = np.zeros_like(top)
    for i, j, ph, pw in itertools.product(range(n), range(c), range(oh), range(ow)):
        hs, ws = ph * s[0] - p[0], pw * s[1] - p[1]
        if method == "MAX":
            he, we = min(hs + k[0], h), min(ws + k[1], w)
            hs, ws = max(hs, 0), max(ws, 0)
            best = -FLT_MAX
            for hh in range(hs, he):
                for ww in range(ws, we):
                    if x[i, j, hh, ww] > best:
                        best = x[i, j, hh, ww]
                        mask[i, j, ph, pw] = hh * w + ww
            top[i, j, ph, pw] = best
            if mask[i, j, ph, pw] >= 0:
                m = int(mask[i, j, ph, pw])
                bdiff[i, j, m // w, m % w] += top_diff[i, j, ph, pw]
        else:
            he, we = min(hs + k[0], h + p[0]), min(ws + k[1], w + p[1])
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            with np.errstate(divide="ignore", invalid="ignore"):   # empty window: 0/0 as Caffe
                top[i, j, ph, pw] = x[i, j, hs:he, ws:we].sum() / size
                bdiff[i, j, hs:he, ws:we] += top_diff[i, j, ph, pw] / size
    return top, mask, bdiff


def pool_configs(count, seed, max_pad_ok=True):
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        k = (rng.randint(1, 4), rng.randint(1, 4))
        s = (rng.randint(1, 4), rng.randint(1, 4))
        p = (rng.randint(0, k[0] - 1), rng.randint(0, k[1] - 1)) if rng.random() < 0.6 else (0, 0)
        hw = (rng.randint(max(1, k[0] - 2 * p[0]), 9), rng.randint(max(1, k[1] - 2 * p[1]), 9))
        ceil_mode = rng.random() < 0.75
        any_pad = any(p)
        o = [caffe_pooled(d, kk, ss, pp, ceil_mode, any_pad) for d, kk, ss, pp in zip(hw, k, s, p)]
        if min(o) > 0:
            out.append((hw, k, s, p, ceil_mode))
    return out


# -- output sizes ---------------------------------------------------------------------------------
def test_pool_out_shape_catalog():
    assert Pool.pool_out_shape((6, 5), (3, 3), (2, 2), (0, 0)) == (3, 2)      # TestSetup
    assert Pool.pool_out_shape((6, 5), (3, 3), (2, 2), (1, 1)) == (4, 3)      # TestSetupPadded
    assert Pool.pool_out_shape((8, 8), (3, 3), (2, 2), (0, 0)) == (4, 4)      # ceil rule 8 -> 4
    assert Pool.pool_out_shape((8, 8), (3, 3), (2, 2), (0, 0), False) == (3, 3)
    assert Pool.pool_out_shape((5, 5), (2, 2), (2, 2), (1, 1)) == (3, 3)      # pad clipping
    # no padding: no clipping, even when the last window starts past the image
    assert Pool.pool_out_shape((5, 5), (1, 1), (3, 3), (0, 0)) == (3, 3)
    # one non-zero pad turns clipping on for both dims
    assert Pool.pool_out_shape((5, 5), (2, 1), (2, 3), (1, 0)) == (3, 2)


def test_conv_deconv_out_size():
    assert Fn.conv_out_size(6, 3, 2, 0) == 2 and Fn.conv_out_size(4, 3, 2, 0) == 1
    assert Fn.conv_out_size(10, 3, 2, 0, 3) == 2 and Fn.conv_out_size(11, 3, 2, 0, 3) == 3
    assert Fn.conv_out_size(2, 3, 2, 0) == 1      # C++ division truncates -1/2 to 0
    assert Fn.conv_out_size(1, 5, 2, 0) == -1     # -4/2 + 1: no output, the layer refuses
    assert Fn.deconv_out_size(6, 3, 2, 0) == 13 and Fn.deconv_out_size(4, 3, 2, 0) == 9
    assert Fn.deconv_out_size(4, 4, 2, 1) == 8


# -- pooling against the reference ------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_max_pool_matches_caffe_loops(seed):
    native = general = 0
    for hw, k, s, p, ceil_mode in pool_configs(60, seed):
        rng = np.random.default_rng(seed)
        x = rng.integers(-3, 4, size=(1, 2) + hw).astype(np.float64)   # many ties
        g = rng.standard_normal((1, 2) + Pool.pool_out_shape(hw, k, s, p, ceil_mode))
        top, mask, bdiff = ref_pool(x, "MAX", k, s, p, ceil_mode, g)
        xt = torch.tensor(x, requires_grad=True)
        y, m = Pool.max_pool2d(xt, k, s, p, ceil_mode, return_mask=True)
        (y * torch.tensor(g)).sum().backward()
        where = f"hw={hw} k={k} s={s} p={p} ceil={ceil_mode}"
        np.testing.assert_array_equal(y.detach().numpy(), top, err_msg=where)
        np.testing.assert_array_equal(m.numpy(), mask, err_msg=where)
        np.testing.assert_allclose(xt.grad.numpy(), bdiff, atol=1e-12, err_msg=where)
        out_hw = Pool.pool_out_shape(hw, k, s, p, ceil_mode)
        if Pool._native_pool_ok(hw, out_hw, k, s, p, ceil_mode):
            native += 1
        else:
            general += 1
    assert native and general   # both code paths were exercised


@pytest.mark.parametrize("seed", [2, 3])
def test_ave_pool_matches_caffe_loops(seed):
    native = general = 0
    for hw, k, s, p, ceil_mode in pool_configs(60, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((2, 1) + hw)
        out_hw = Pool.pool_out_shape(hw, k, s, p, ceil_mode)
        g = rng.standard_normal((2, 1) + out_hw)
        top, _, bdiff = ref_pool(x, "AVE", k, s, p, ceil_mode, g)
        xt = torch.tensor(x, requires_grad=True)
        y = Pool.ave_pool2d(xt, k, s, p, ceil_mode)
        (y * torch.tensor(g)).nan_to_num().sum().backward()
        where = f"hw={hw} k={k} s={s} p={p} ceil={ceil_mode}"
        np.testing.assert_allclose(y.detach().numpy(), top, rtol=1e-12, atol=1e-12, err_msg=where)
        np.testing.assert_allclose(xt.grad.numpy(), np.nan_to_num(bdiff), atol=1e-12,
                                   err_msg=where)
        if Pool._native_pool_ok(hw, out_hw, k, s, p, ceil_mode):
            native += 1
        else:
            general += 1
    assert native and general


def test_native_ave_divisor_is_caffes():
    """Where torch's padded avg_pool2d is used, its count_include_pad divisor equals Caffe's
    window clipped to [-p, H+p), e.g. 2 (not 3) rows for the last ceil-rule window of 8 -> 4."""
    checked = 0
    for hw, k, s, p, ceil_mode in pool_configs(200, 7):
        out_hw = Pool.pool_out_shape(hw, k, s, p, ceil_mode)
        if not Pool._native_pool_ok(hw, out_hw, k, s, p, ceil_mode):
            continue
        ones = torch.ones((1, 1) + hw, dtype=torch.float64)
        inside = torch.nn.functional.avg_pool2d(ones, k, s, p, ceil_mode=ceil_mode,
                                                divisor_override=1)[0, 0]
        div = Pool.ave_pool_divisor(hw, out_hw, k, s, p, dtype=torch.float64)
        torch.testing.assert_close(Pool.ave_pool2d(ones, k, s, p, ceil_mode)[0, 0], inside / div)
        checked += 1
    assert checked > 50
    d = Pool.ave_pool_divisor((8, 8), (4, 4), (3, 3), (2, 2), (0, 0))
    assert d[3, 3] == 4 and d[0, 0] == 9 and d[0, 3] == 6


def test_max_pool_caffe_literals():
    row = [[1, 2, 5, 2, 3], [9, 4, 1, 4, 8], [1, 2, 5, 2, 3]]
    x = torch.tensor([[row, row], [row, row]], dtype=torch.float32)         # 2x2x3x5
    y, m = Pool.max_pool2d(x, (2, 2), (1, 1), (0, 0), return_mask=True)
    assert y[1, 1].tolist() == [[9, 5, 5, 8], [9, 5, 5, 8]]
    assert m[0, 1].tolist() == [[5, 2, 2, 9], [5, 12, 12, 9]]
    magic = torch.tensor([[35, 1, 6, 26, 19, 24], [3, 32, 7, 21, 23, 25], [31, 9, 2, 22, 27, 20],
                          [8, 28, 33, 17, 10, 15], [30, 5, 34, 12, 14, 16],
                          [4, 36, 29, 13, 18, 11]], dtype=torch.float32)[None, None]
    y, m = Pool.max_pool2d(magic, (3, 2), (1, 1), (0, 0), return_mask=True)    # RectHigh
    assert y[0, 0].tolist() == [[35, 32, 26, 27, 27], [32, 33, 33, 27, 27],
                                [31, 34, 34, 27, 27], [36, 36, 34, 18, 18]]
    assert m[0, 0].tolist() == [[0, 7, 3, 16, 16], [7, 20, 20, 16, 16], [12, 26, 26, 16, 16],
                                [31, 31, 26, 34, 34]]
    y, m = Pool.max_pool2d(magic, (2, 3), (1, 1), (0, 0), return_mask=True)    # RectWide
    assert y[0, 0].tolist() == [[35, 32, 26, 26], [32, 32, 27, 27], [33, 33, 33, 27],
                                [34, 34, 34, 17], [36, 36, 34, 18]]
    one_based = [[1, 8, 4, 4], [8, 8, 17, 17], [21, 21, 21, 17], [27, 27, 27, 22],
                 [32, 32, 27, 35]]
    assert (m[0, 0] + 1).tolist() == one_based
    x = torch.tensor([[1, 2, 4], [2, 3, 2], [4, 2, 1]], dtype=torch.float32)[None, None]
    y, _ = Pool.max_pool2d(x, (3, 3), (2, 2), (2, 2))                          # MaxPadded
    assert y[0, 0].tolist() == [[1, 4, 4], [4, 4, 4], [4, 4, 1]]


def test_ave_pool_caffe_literal():
    y = Pool.ave_pool2d(torch.full((1, 1, 3, 3), 2.0, dtype=torch.float64), (3, 3), (1, 1), (1, 1))
    expect = torch.tensor([[8 / 9, 4 / 3, 8 / 9], [4 / 3, 2, 4 / 3], [8 / 9, 4 / 3, 8 / 9]],
                          dtype=torch.float64)
    torch.testing.assert_close(y[0, 0], expect)


def test_max_pool_empty_and_minus_inf_windows():
    # H=5, k=1, s=3, no pad: Caffe's third window starts at 6 (no clipping without padding)
    x = torch.arange(25.0).view(1, 1, 5, 5)
    y, m = Pool.max_pool2d(x, (1, 1), (3, 3), (0, 0), return_mask=True)
    assert y.shape == (1, 1, 3, 3) and y[0, 0, 2, 2].item() == -FLT_MAX
    assert m[0, 0, :, 2].tolist() == [-1, -1, -1] and m[0, 0, 1, 1].item() == 18
    x = torch.full((1, 1, 2, 2), float("-inf"))
    y, m = Pool.max_pool2d(x, (2, 2), (2, 2), (0, 0), return_mask=True)
    assert y.item() == -FLT_MAX and m.item() == -1


def test_max_pool_training_path_floor_gradient_and_bits():
    """With a gradient MAX pooling runs its own Function: a window of -inf only gives -FLT_MAX
    and no gradient (Caffe's mask -1), the rest the first maximum's; float64 gradcheck; float32:
    the no-gradient path's top, and the same bits on 1, 2 and 4 threads."""
    x = torch.arange(32.0, dtype=torch.float64).view(1, 2, 4, 4).flip(-1).clone()
    x[0, 1, :2, :2] = float("-inf")
    xg = x.clone().requires_grad_()
    y, m = Pool.max_pool2d(xg, (2, 2), (2, 2), (0, 0), return_mask=True)
    y.backward(torch.ones_like(y))
    assert y[0, 1, 0, 0].item() == -FLT_MAX and m[0, 1, 0, 0].item() == -1
    assert xg.grad[0, 1, :2, :2].abs().sum() == 0 and xg.grad.sum() == y.numel() - 1
    x = torch.randn(2, 3, 7, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: Pool.max_pool2d(t, (3, 2), (2, 2), (1, 0))[0], (x,))
    x32 = torch.randn(8, 20, 24, 24).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(8, 20, 12, 12)
    runs = on_1_2_4_threads(lambda t: Pool.max_pool2d(t, (2, 2), (2, 2), (0, 0))[0], x32, dy)
    assert torch.equal(runs[0][0], Pool.max_pool2d(x32, (2, 2), (2, 2), (0, 0))[0])
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0]))


def on_1_2_4_threads(fn, x, dy) -> list:
    """(output, input gradient) of ``fn`` on ``x`` with top gradient ``dy``, on 1, 2, 4 threads."""
    runs = []
    for n in (1, 2, 4):
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            xg = x.clone().requires_grad_()
            y = fn(xg)
            y.backward(dy)
        finally:
            torch.set_num_threads(before)
        runs.append((y.detach(), xg.grad))
    return runs


# -- stochastic pooling -----------------------------------------------------------------------------
def test_stochastic_test_is_weighted_average():
    rng = np.random.default_rng(0)
    x = rng.random((2, 3, 5, 6))
    y = Pool.stochastic_pool2d(torch.tensor(x), (3, 2), (2, 2), train=False)
    assert y.shape == (2, 3, 2, 3)
    for ph, pw in itertools.product(range(2), range(3)):
        win = x[:, :, ph * 2:ph * 2 + 3, pw * 2:pw * 2 + 2]
        ref = (win ** 2).sum((2, 3)) / (win.sum((2, 3)) + Pool.FLT_MIN)
        np.testing.assert_allclose(y[:, :, ph, pw].numpy(), ref, rtol=1e-12)


def test_stochastic_train_samples_by_value():
    x = torch.tensor([[1.0, 0.0, 3.0], [0.0, 4.0, 2.0]]).view(1, 1, 2, 3)
    gen = torch.Generator().manual_seed(0)
    xs = x.expand(4000, 1, 2, 3).contiguous()
    y = Pool.stochastic_pool2d(xs, (2, 3), (1, 1), train=True, generator=gen)
    assert y.shape == (4000, 1, 1, 1)
    values, counts = torch.unique(y, return_counts=True)
    assert set(values.tolist()) <= {1.0, 3.0, 4.0, 2.0}           # never the zeros
    freq = dict(zip(values.tolist(), (counts / 4000.0).tolist()))
    for v in (1.0, 3.0, 4.0, 2.0):
        assert abs(freq[v] - v / 10.0) < 0.03, freq
    # the gradient goes to the sampled element only
    xg = x.clone().requires_grad_(True)
    out = Pool.stochastic_pool2d(xg, (2, 3), (1, 1), train=True,
                               generator=torch.Generator().manual_seed(3))
    out.sum().backward()
    assert xg.grad.sum().item() == 1.0 and x.view(-1)[xg.grad.view(-1).argmax()] == out.item()


# -- LRN -----------------------------------------------------------------------------------------
def ref_lrn(x, size, alpha, beta, k, region):
    n, c, h, w = x.shape
    y = np.empty_like(x)
    half = (size - 1) // 2
    for i, j, hh, ww in itertools.product(range(n), range(c), range(h), range(w)):
        if region == "ACROSS":
            lo, hi = max(0, j - half), min(c, j + half + 1)
            scale = k + alpha / size * (x[i, lo:hi, hh, ww] ** 2).sum()
        else:
            h0, h1 = max(0, hh - half), min(h, hh + half + 1)
            w0, w1 = max(0, ww - half), min(w, ww + half + 1)
            scale = 1 + alpha / size ** 2 * (x[i, j, h0:h1, w0:w1] ** 2).sum()
        y[i, j, hh, ww] = x[i, j, hh, ww] * scale ** -beta
    return y


@pytest.mark.parametrize("size,alpha,beta,k", [(5, 1.0, 0.75, 1.0), (15, 0.5, 0.6, 2.0),
                                               (3, 0.1, 0.75, 1.0)])
def test_lrn_across_channels(size, alpha, beta, k):
    x = np.random.default_rng(size).standard_normal((2, 7, 3, 3))
    y = Fn.lrn_across_channels(torch.tensor(x), size, alpha, beta, k)
    np.testing.assert_allclose(y.numpy(), ref_lrn(x, size, alpha, beta, k, "ACROSS"), rtol=1e-12)


@pytest.mark.parametrize("size", [3, 5])
def test_lrn_within_channel_ignores_k(size):
    x = np.random.default_rng(size).standard_normal((2, 3, 5, 4))
    y = Fn.lrn_within_channel(torch.tensor(x), size, 0.3, 0.75)
    np.testing.assert_allclose(y.numpy(), ref_lrn(x, size, 0.3, 0.75, None, "WITHIN"),
                               rtol=1e-12)


def ref_lrn_across_backward(x, dy, size, alpha, beta, k):
    """Caffe's CrossChannelBackward_cpu, written out per channel window."""
    c, half = x.shape[1], (size - 1) // 2
    win = [slice(max(0, j - half), min(c, j + half + 1)) for j in range(c)]
    scale = np.stack([k + alpha / size * (x[:, w] ** 2).sum(1) for w in win], 1)
    y = x * scale ** -beta
    ratio = dy * y / scale
    acc = np.stack([ratio[:, w].sum(1) for w in win], 1)
    return dy * scale ** -beta - 2 * alpha * beta / size * x * acc


@pytest.mark.parametrize("size,nhwc", [(5, True), (3, False), (1, True), (15, False)])
def test_lrn_across_training_path_is_caffe_backward(size, nhwc):
    """With a gradient LRN runs its own Function (Caffe's backward formula): float64 against
    Caffe's loop and gradcheck; float32: the inference path's forward bits, and the same bits on
    1, 2 and 4 threads."""
    rng = np.random.default_rng(size)
    x, dy = rng.standard_normal((2, 7, 3, 4)), rng.standard_normal((2, 7, 3, 4))
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    xt = torch.tensor(x).contiguous(memory_format=fmt).requires_grad_()
    Fn.lrn_across_channels(xt, size, 0.5, 0.75, 2.0).backward(torch.tensor(dy))
    np.testing.assert_allclose(xt.grad.numpy(), ref_lrn_across_backward(x, dy, size, 0.5, 0.75,
                                                                        2.0), rtol=1e-10)
    assert torch.autograd.gradcheck(lambda t: Fn.lrn_across_channels(t, size, 0.5, 0.75, 2.0),
                                    (xt.detach().clone().requires_grad_(),))
    x32 = torch.randn(4, 96, 9, 9).contiguous(memory_format=fmt)
    dy32 = torch.randn(4, 96, 9, 9)
    runs = on_1_2_4_threads(lambda t: Fn.lrn_across_channels(t, size, 1e-4, 0.75, 1.0), x32, dy32)
    assert torch.equal(runs[0][0], Fn.lrn_across_channels(x32, size, 1e-4, 0.75, 1.0))
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0]))


# -- convolution, deconvolution, im2col ---------------------------------------------------------
def ref_im2col(x, kernel, stride, pad, dil):
    """Caffe's im2col_nd for one image (C, *spatial) -> (C * prod(kernel), *out)."""
    c, spatial = x.shape[0], x.shape[1:]
    out = [Fn.conv_out_size(*a) for a in zip(spatial, kernel, stride, pad, dil)]
    cols = np.zeros((c,) + tuple(kernel) + tuple(out))
    for ch in range(c):
        for koff in itertools.product(*(range(k) for k in kernel)):
            for o in itertools.product(*(range(m) for m in out)):
                pos = [oo * s - p + kk * d for oo, s, p, kk, d in zip(o, stride, pad, koff, dil)]
                if all(0 <= q < n for q, n in zip(pos, spatial)):
                    cols[(ch,) + koff + o] = x[(ch,) + tuple(pos)]
    return cols.reshape((-1,) + tuple(out))


def ref_conv(x, w, b, stride, pad, dil, group):
    n, c = x.shape[:2]
    o = w.shape[0]
    outs = []
    for i in range(n):
        cols = ref_im2col(x[i], w.shape[2:], stride, pad, dil)
        out_sp = cols.shape[1:]
        cols = cols.reshape(group, -1, int(np.prod(out_sp)))
        wg = w.reshape(group, o // group, -1)
        y = np.einsum("gok,gkl->gol", wg, cols).reshape((o,) + out_sp)
        outs.append(y if b is None else y + b.reshape((-1,) + (1,) * len(out_sp)))
    return np.stack(outs)


def ref_deconv(x, w, b, stride, pad, dil, group):
    """Scatter each input value times the kernel into the output (Caffe's col2im path)."""
    n, c = x.shape[:2]
    og = w.shape[1]
    kernel = w.shape[2:]
    full = [s * (m - 1) + d * (k - 1) + 1 for m, k, s, d in zip(x.shape[2:], kernel, stride, dil)]
    y = np.zeros((n, og * group) + tuple(full))
    for i, ch in itertools.product(range(n), range(c)):
        g = ch // (c // group)
        for pos in itertools.product(*(range(m) for m in x.shape[2:])):
            for koff in itertools.product(*(range(k) for k in kernel)):
                q = tuple(p * s + kk * d for p, s, kk, d in zip(pos, stride, koff, dil))
                y[(i, slice(g * og, (g + 1) * og)) + q] += x[(i, ch) + pos] * w[(ch, slice(None)) + koff]
    crop = tuple(slice(p, f - p) for p, f in zip(pad, full))
    y = y[(slice(None), slice(None)) + crop]
    return y if b is None else y + b.reshape((-1,) + (1,) * len(kernel))


CONV_CASES = [  # (input shape, C_out, kernel, stride, pad, dilation, group)
    ((2, 4, 7, 6), 6, (3, 2), (2, 1), (1, 0), (1, 2), 2),
    ((2, 3, 9), 4, (3,), (2,), (1,), (2,), 1),
    ((1, 2, 4, 5, 4), 2, (2, 3, 2), (1, 2, 1), (1, 0, 1), (1, 1, 2), 2),
    ((1, 2, 4, 3, 4, 3), 3, (2, 2, 1, 2), (2, 1, 1, 1), (1, 0, 0, 1), (1, 1, 1, 2), 1),
    ((2, 3, 2), 2, (3,), (2,), (0,), (1,), 1),        # kernel overhangs: Caffe still gives 1
    ((3, 4), 2, (), (), (), (), 2),                   # 0-D: a grouped matrix product
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{len(c[0]) - 2}d")
def test_conv_nd_matches_im2col_gemm(case):
    shape, o, k, s, p, d, g = case
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape)
    w = rng.standard_normal((o, shape[1] // g) + k)
    b = rng.standard_normal(o)
    y = Fn.conv_nd(torch.tensor(x), torch.tensor(w), torch.tensor(b), s, p, d, g)
    np.testing.assert_allclose(y.numpy(), ref_conv(x, w, b, s, p, d, g), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [c for c in CONV_CASES if c[2] and c[0][2] > 2],
                         ids=lambda c: f"{len(c[0]) - 2}d")
def test_deconv_nd_matches_scatter(case):
    shape, o, k, s, p, d, g = case
    rng = np.random.default_rng(len(shape) + 10)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((shape[1], o // g) + k)
    b = rng.standard_normal(o)
    y = Fn.deconv_nd(torch.tensor(x), torch.tensor(w), torch.tensor(b), s, p, d, g)
    np.testing.assert_allclose(y.numpy(), ref_deconv(x, w, b, s, p, d, g), rtol=1e-10, atol=1e-12)


def test_deconv_is_adjoint_of_conv():
    for shape, o, k, s, p, d, g in CONV_CASES:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        w = torch.randn((o, shape[1] // g) + k, generator=gen, dtype=torch.float64)
        y = Fn.conv_nd(x, w, None, s, p, d, g)
        t = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        back = Fn.deconv_nd(t, w, None, s, p, d, g)
        if back.shape != x.shape:       # truncated-size case: deconv covers fewer positions
            continue
        torch.testing.assert_close((y * t).sum(), (x * back).sum())


@pytest.mark.parametrize("shape,k,s,p,d", [((2, 3, 6, 5), (3, 3), (2, 2), (1, 1), (1, 1)),
                                           ((1, 2, 10, 11), (3, 2), (2, 3), (0, 1), (3, 2)),
                                           ((2, 2, 7), (3,), (2,), (1,), (2,)),
                                           ((1, 2, 4, 5, 3), (2, 3, 2), (2, 1, 1), (1, 1, 0),
                                            (1, 1, 2))])
def test_im2col_matches_caffe_order(shape, k, s, p, d):
    x = np.random.default_rng(0).standard_normal(shape)
    y = Fn.im2col(torch.tensor(x), k, s, p, d)
    ref = np.stack([ref_im2col(x[i], k, s, p, d) for i in range(shape[0])])
    np.testing.assert_array_equal(y.numpy(), ref)


# -- float64 gradient checks ------------------------------------------------------------------
def _distinct(shape, seed=0):
    """Values far from ties, so MAX pooling has no kinks under finite differences."""
    n = int(np.prod(shape))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).double()
    return (perm / n + 0.05).view(shape).requires_grad_(True)


@pytest.mark.parametrize("k,s,p", [((3, 3), (2, 2), (1, 1)), ((3, 2), (2, 3), (2, 1)),
                                   ((1, 1), (3, 3), (0, 0))])
def test_gradcheck_pooling(k, s, p):
    x = _distinct((2, 2, 7, 6))
    assert torch.autograd.gradcheck(lambda t: Pool.max_pool2d(t, k, s, p)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: Pool.ave_pool2d(t, k, s, p).nan_to_num(), (x,))
    if not any(p):
        assert torch.autograd.gradcheck(lambda t: Pool.stochastic_pool2d(t, k, s, False), (x,))
        assert torch.autograd.gradcheck(
            lambda t: Pool.stochastic_pool2d(t, k, s, True, generator=torch.Generator()
                                           .manual_seed(5)), (x,))


def test_gradcheck_lrn_conv_im2col():
    x = torch.randn(2, 5, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: Fn.lrn_across_channels(t, 3, 0.7, 0.75, 2.0), (x,))
    assert torch.autograd.gradcheck(lambda t: Fn.lrn_within_channel(t, 3, 0.7, 0.75), (x,))
    assert torch.autograd.gradcheck(lambda t: Fn.im2col(t, (2, 3), (2, 1), (1, 1), (1, 1)), (x,))
    # the 4-D path (no torch kernel), small
    shape, o, k, s, p, d, g = (1, 2, 3, 2, 3, 2), 2, (2, 1, 2, 2), (2, 1, 1, 1), (1, 0, 0, 1), \
        (1, 1, 2, 1), 2
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn((o, shape[1] // g) + k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: Fn.conv_nd(a, b, None, s, p, d, g), (x, w))
    y = torch.randn(Fn.conv_nd(x, w, None, s, p, d, g).shape, dtype=torch.float64,
                    requires_grad=True)
    wt = torch.randn((o, shape[1] // g) + k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: Fn.deconv_nd(a, b, None, s, p, d, g), (y, wt))
