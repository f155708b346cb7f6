"""Caffe math as pure torch functions (convolution, inner product, LRN, ...), tested alone.

Every function works on any float dtype and device and is differentiable by autograd; the
gradients are Caffe's (Caffe's backward for these ops is the true derivative, with MAX pooling's
gradient going to the first maximum). Sizes follow Caffe's integer rules, which differ from
torch's in a few corners: each such place says so.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Sequence

import torch
import torch.nn.functional as F

from ..execution import determinism, threads, wgrad

Ints = Sequence[int]


def grad_needed(*tensors: torch.Tensor | None) -> bool:
    """True when autograd would record an op on ``tensors``: the layers then keep the form whose
    backward is Caffe's; otherwise they may use a cheaper inference form with the same values."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- output sizes ------------------------------------------------------------------------------
def _trunc_div(a: int, b: int) -> int:
    """C++ integer division (rounds toward zero)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def conv_out_size(size: int, kernel: int, stride: int, pad: int, dilation: int = 1) -> int:
    """Caffe's convolution / im2col rule ``(size + 2p - extent) / stride + 1`` in C++ integer
    division: a kernel up to ``stride - 1`` wider than the padded input still gives one output
    (torch refuses this; Caffe reads zeros past the padding)."""
    extent = dilation * (kernel - 1) + 1
    return _trunc_div(size + 2 * pad - extent, stride) + 1


def deconv_out_size(size: int, kernel: int, stride: int, pad: int, dilation: int = 1) -> int:
    """Caffe's deconvolution rule ``stride (size - 1) + extent - 2 pad``."""
    return stride * (size - 1) + dilation * (kernel - 1) + 1 - 2 * pad


# -- inner product ---------------------------------------------------------------------------
DNN_MIN_WEIGHT = 1 << 18   # smaller weights: BLAS is as fast and starts sooner


@functools.cache
def _dnn_linear():
    """oneDNN's inner product (``mkldnn::_linear_pointwise``), or None where torch lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        op(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    return lambda x, w, b: op(x, w, b, "none", [], "")


class _DnnInnerProduct(torch.autograd.Function):
    """x (M, K), stored weight (N, K) or, with ``transpose``, (K, N), bias (N,) or None ->
    x W^T + b: the forward as oneDNN's inner product; the gradients as MKL products on torch's
    threads where MKL runs in strict mode (the same bits on any thread count; oneDNN took 1.1-3.6x
    longer on CaffeNet's and LeNet's shapes, benchmarks/train_speed.py), else oneDNN's too."""

    @staticmethod
    def forward(ctx, x, w, b, transpose):
        ctx.save_for_backward(x, w)
        ctx.transpose, ctx.has_bias = transpose, b is not None
        return _dnn_linear()(x, w.t() if transpose else w, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw = (_mkl_grads if determinism.mkl_strict() else _dnn_grads)(
            dy, x, w, ctx.transpose, need_dx, need_dw)
        db = dy.sum(0) if ctx.has_bias and need_db else None
        return dx, dw, db, None


def _mkl_grads(dy, x, w, transpose: bool, need_dx: bool, need_dw: bool):
    """(dx, dw) as MKL products: on torch's threads when large, else on one (strict mode still
    splits tiny products by thread count)."""
    large = 2 * x.numel() * dy.shape[1] >= threads.TINY_FLOPS
    with determinism.blas_on_torch_threads() if large else determinism.blas_on_one_thread_here():
        dx = dy @ (w.t() if transpose else w) if need_dx else None
        dw = (x.t() @ dy if transpose else dy.t() @ x) if need_dw else None
    return dx, dw


def _dnn_grads(dy, x, w, transpose: bool, need_dx: bool, need_dw: bool):
    """(dx, dw) as oneDNN inner products (dx = dy W: the weight argument is W^T, the stored one;
    dw = dy^T x (N, K), or x^T dy (K, N) when transposed)."""
    lin = _dnn_linear()
    dx = lin(dy, w if transpose else w.t(), None) if need_dx else None
    dw = None
    if need_dw:
        dyt, xt = dy.t().contiguous(), x.t().contiguous()
        dw = lin(xt, dyt, None) if transpose else lin(dyt, xt, None)
    return dx, dw


def inner_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  transpose: bool = False) -> torch.Tensor:
    """``x W^T + b`` for x (M, K) and Caffe's stored weight: (N, K), or (K, N) with ``transpose``.

    On the CPU in float32, weights of ``DNN_MIN_WEIGHT`` elements or more go through oneDNN's
    inner product: 2-3x faster than the BLAS matrix products torch uses for the skinny shapes of
    small batches (CaffeNet fc6 at batch 10: ~16 ms instead of ~50 for forward and backward).
    The sums are the same, in another order: the results differ by float rounding only.
    """
    # Not inside torch.export/compile: a traced graph keeps portable ops (ONNX, other devices).
    if (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and w.numel() >= DNN_MIN_WEIGHT and (b is None or b.dtype == torch.float32)
            and _dnn_linear() is not None):
        return _DnnInnerProduct.apply(x, w, b, transpose)
    wt = w if transpose else w.t()
    tiny = (x.device.type == "cpu" and not torch.compiler.is_compiling()   # no guard on a traced batch
            and 2 * x.shape[0] * wt.shape[0] * wt.shape[1] < threads.TINY_FLOPS)
    # a tiny product: MKL on one thread, for the same bits on any thread count
    with determinism.blas_on_one_thread_here() if tiny else contextlib.nullcontext():
        return x @ wt if b is None else torch.addmm(b, x, wt)


# -- LRN -------------------------------------------------------------------------------------
def lrn_across_channels(x: torch.Tensor, size: int, alpha: float, beta: float,
                        k: float) -> torch.Tensor:
    """``x / (k + alpha/size * sum of x^2 over channels [c - (size-1)/2, c + (size-1)/2])^beta``
    with channels outside the blob counting as zero (Caffe ACROSS_CHANNELS, odd ``size``)."""
    n, c = x.shape[:2]
    nhwc = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and \
        not x.is_contiguous()
    if not grad_needed(x):
        return _lrn_scale(x, _channel_window_mean(x * x, size, nhwc), alpha, k, beta)
    if not torch.compiler.is_compiling():
        return _LRNAcross.apply(x, size, alpha, beta, k, nhwc)
    if nhwc:
        # NHWC memory: channels are the last axis, so the windows need no layout copy
        sq = (x * x).permute(0, 2, 3, 1).reshape(-1, 1, c)
        mean = F.avg_pool1d(sq, size, stride=1, padding=(size - 1) // 2, count_include_pad=True)
        mean = mean.view(n, x.shape[2], x.shape[3], c).permute(0, 3, 1, 2)
    else:
        sq = (x * x).reshape(n, 1, c, -1)
        mean = F.avg_pool2d(sq, (size, 1), stride=1, padding=((size - 1) // 2, 0),
                            count_include_pad=True).view_as(x)
    return _lrn_scale(x, mean, alpha, k, beta)


class _LRNAcross(torch.autograd.Function):
    """LRN across channels with Caffe's backward formula (lrn_layer.cpp) instead of autograd's
    chain through the pooling, pow and products: with ``scale = k + alpha/size * window sum of
    x^2``, ``dx = dy * scale^-beta - 2 alpha beta / size * x * window sum of dy * y / scale``.
    The forward is the inference path's (the pooling kernels' bits) keeping ``scale``."""

    @staticmethod
    def forward(ctx, x, size, alpha, beta, k, nhwc):
        scale = _channel_window_mean(x * x, size, nhwc).mul_(alpha).add_(k)
        p = scale.pow(-beta)
        y = p * x
        ctx.save_for_backward(x, y, scale, p)
        ctx.lrn = (size, 2.0 * alpha * beta / size, nhwc)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, y, scale, p = ctx.saved_tensors
        size, ratio, nhwc = ctx.lrn
        acc = _channel_window_sum((dy * y).div_(scale), size, nhwc)
        return (dy * p).addcmul_(x, acc, value=-ratio), None, None, None, None, None


def _channel_window_mean(sq: torch.Tensor, size: int, nhwc: bool) -> torch.Tensor:
    """The zero-padded mean of ``sq`` over ``size`` neighbouring channels, as the sums of shifted
    slices of the padded blob: the pooling kernels' bits (each window summed from its first
    channel on, then divided by ``size``), about 3x faster than pooling the many tiny planes of
    (N H W, 1, C) or (N, 1, C, H W). Without a gradient only: the sums are made in place."""
    return _channel_window_sum(sq, size, nhwc).div_(size)


def _channel_window_sum(sq: torch.Tensor, size: int, nhwc: bool) -> torch.Tensor:
    """``_channel_window_mean``'s sums, not divided: a fresh tensor."""
    if nhwc:
        sq = sq.permute(0, 2, 3, 1)              # a view: channels are the last axis in memory
    dim, c, half = sq.dim() - 1 if nhwc else 1, sq.shape[-1 if nhwc else 1], (size - 1) // 2
    p = F.pad(sq, [0, 0] * (sq.dim() - 1 - dim) + [half, half])
    acc = p.narrow(dim, 0, c) + p.narrow(dim, 1, c) if size > 1 else p
    for j in range(2, size):
        acc.add_(p.narrow(dim, j, c))
    return acc.permute(0, 3, 1, 2) if nhwc else acc


def _lrn_scale(x: torch.Tensor, mean: torch.Tensor, alpha: float, k: float,
               beta: float) -> torch.Tensor:
    """``x * (k + alpha * mean)^-beta``. Without a gradient the same ops run in place on the fresh
    ``mean`` (same bits, no new buffers); with one, out of place (pow and mul save their
    inputs)."""
    if grad_needed(x) or mean.dtype != x.dtype:
        return x * (k + alpha * mean).pow(-beta)
    return mean.mul_(alpha).add_(k).pow_(-beta).mul_(x)


def lrn_within_channel(x: torch.Tensor, size: int, alpha: float, beta: float) -> torch.Tensor:
    """``x * (1 + alpha/size^2 * sum of x^2 over the size x size window)^-beta``, zero padded
    (Caffe WITHIN_CHANNEL: its AVE pool divides by size^2 everywhere; ``k`` is not used)."""
    pad = (size - 1) // 2
    mean = F.avg_pool2d(x * x, size, stride=1, padding=pad, count_include_pad=True)
    return _lrn_scale(x, mean, alpha, 1.0, beta)


# -- convolution, deconvolution, im2col ---------------------------------------------------------
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_DECONV = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _pad_for_caffe(x: torch.Tensor, kernel, stride, pad, dilation):
    """Zero-pad the far side where Caffe's truncating size rule asks for windows past the
    padding; returns (x, pad) for the convolution."""
    extra = []
    for size, k, s, p, d in zip(x.shape[2:], kernel, stride, pad, dilation):
        o = conv_out_size(size, k, s, p, d)
        extra.append(max(0, (o - 1) * s + d * (k - 1) + 1 - (size + 2 * p)))
    if any(extra):
        x = F.pad(x, [a for e in reversed(extra) for a in (0, e)])
    return x


def _thread_invariant_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A CPU float32 convolution whose weight gradient is wanted: its backward is ``_Conv2d``'s."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and weight.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


class _Conv2d(torch.autograd.Function):
    """torch's 2-D convolution (oneDNN) with a weight gradient of the same bits on every thread
    count: the batch in chunks fixed by the shape, each on one thread (brewnet/execution/wgrad.py).
    The input gradient is oneDNN's (one thread per output element). On NHWC activations oneDNN
    copies an NCHW weight to NHWC in each of the forward, the input and the weight gradient: the
    copy is made once here and kept for the backward (the same values reach oneDNN)."""

    @staticmethod
    def forward(ctx, x, w, b, stride, pad, dilation, groups):
        if _nhwc(x) and not w.is_contiguous(memory_format=torch.channels_last):
            w = w.contiguous(memory_format=torch.channels_last)
        ctx.save_for_backward(x, w)
        ctx.conv = (stride, pad, dilation, groups)
        ctx.has_bias = b is not None
        return F.conv2d(x, w, b, stride, pad, dilation, groups)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        stride, pad, dilation, groups = ctx.conv
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        dx = dw = db = None
        if need_x:
            dx = determinism.onednn_backward(dy, x, w, stride, pad, dilation, groups,
                                             [True, False, False])[0]
        if need_w or need_b:
            dw, db = wgrad.weight_grad(dy, x, w, stride, pad, dilation, groups)
        return dx, dw if need_w else None, db if need_b else None, None, None, None, None


def _nhwc(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and \
        not x.is_contiguous()


def conv_nd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Ints,
            pad: Ints, dilation: Ints, groups: int) -> torch.Tensor:
    """Caffe convolution (cross-correlation) of (N, C, *spatial) with any number of spatial dims;
    weight (num_output, C/groups, *kernel). 0-D is a grouped matmul, 1-3-D use torch's kernels,
    more dims sum strided slices over kernel offsets (the im2col product Caffe computes)."""
    d = x.dim() - 2
    if d == 0:
        return conv_nd(x[..., None], weight[..., None], bias, (1,), (0,), (1,), groups)[..., 0]
    kernel = weight.shape[2:]
    x = _pad_for_caffe(x, kernel, stride, pad, dilation)
    if d == 2 and _thread_invariant_grad(x, weight):
        return _Conv2d.apply(x, weight, bias, tuple(stride), tuple(pad), tuple(dilation), groups)
    if d in _CONV:
        return _CONV[d](x, weight, bias, tuple(stride), tuple(pad), tuple(dilation), groups)
    out_sz = [conv_out_size(s, k, st, p, dl) for s, k, st, p, dl
              in zip(x.shape[2:], kernel, stride, pad, dilation)]
    xp = F.pad(x, [a for p in reversed(pad) for a in (p, p)])
    n, c, g, o = x.shape[0], x.shape[1], groups, weight.shape[0]
    out = x.new_zeros(n, g, o // g, *out_sz)
    for offs in itertools.product(*(range(k) for k in kernel)):
        sl = tuple(slice(i * dl, i * dl + st * (m - 1) + 1, st)
                   for i, dl, st, m in zip(offs, dilation, stride, out_sz))
        patch = xp[(slice(None), slice(None)) + sl].reshape(n, g, c // g, -1)
        w = weight[(slice(None), slice(None)) + offs].reshape(g, o // g, c // g)
        out = out + torch.einsum("ngcl,goc->ngol", patch, w).view_as(out)
    out = out.reshape(n, o, *out_sz)
    return out if bias is None else out + bias.view(1, -1, *([1] * d))


def deconv_nd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Ints,
              pad: Ints, dilation: Ints, groups: int) -> torch.Tensor:
    """Caffe deconvolution (the adjoint of ``conv_nd``) of (N, C, *spatial); weight
    (C, num_output/groups, *kernel), which is torch's transposed-convolution layout.
    Output size ``stride (in - 1) + extent - 2 pad`` per spatial dim."""
    d = x.dim() - 2
    if d == 0:
        return deconv_nd(x[..., None], weight[..., None], bias, (1,), (0,), (1,), groups)[..., 0]
    if d in _DECONV:
        return _DECONV[d](x, weight, bias, tuple(stride), tuple(pad), 0, groups, tuple(dilation))
    kernel = weight.shape[2:]
    n, c, g, o = x.shape[0], x.shape[1], groups, weight.shape[1] * groups
    full = [st * (m - 1) + dl * (k - 1) + 1 for m, k, st, dl in zip(x.shape[2:], kernel, stride,
                                                                     dilation)]
    out = x.new_zeros(n, o, *full)
    xg = x.reshape(n, g, c // g, -1)
    for offs in itertools.product(*(range(k) for k in kernel)):
        sl = tuple(slice(i * dl, i * dl + st * (m - 1) + 1, st)
                   for i, dl, st, m in zip(offs, dilation, stride, x.shape[2:]))
        w = weight[(slice(None), slice(None)) + offs].reshape(g, c // g, o // g)
        out[(slice(None), slice(None)) + sl] += torch.einsum("ngcl,gco->ngol", xg, w).reshape(
            n, o, *x.shape[2:])
    out = out[(slice(None), slice(None)) + tuple(slice(p, f - p) for p, f in zip(pad, full))]
    return out if bias is None else out + bias.view(1, -1, *([1] * d))


def im2col(x: torch.Tensor, kernel: Ints, stride: Ints, pad: Ints, dilation: Ints) -> torch.Tensor:
    """Caffe's im2col of (N, C, *spatial) as a blob (N, C * prod(kernel), *out): channel index
    ``(c * kh + i) * kw + j`` (F.unfold's order), zeros outside the image."""
    d = x.dim() - 2
    x = _pad_for_caffe(x, kernel, stride, pad, dilation)
    out_sz = [conv_out_size(s, k, st, p, dl) for s, k, st, p, dl
              in zip(x.shape[2:], kernel, stride, pad, dilation)]
    n, c = x.shape[:2]
    if d == 2:
        cols = F.unfold(x, tuple(kernel), tuple(dilation), tuple(pad), tuple(stride))
        return cols.view(n, -1, *out_sz)
    cols = F.pad(x, [a for p in reversed(pad) for a in (p, p)])
    for i, (k, st, dl) in enumerate(zip(kernel, stride, dilation)):
        cols = cols.unfold(2 + i, dl * (k - 1) + 1, st)       # window dims appended at the end
    cols = cols[(Ellipsis,) + tuple(slice(None, None, dl) for dl in dilation)]
    perm = [0, 1] + list(range(2 + d, 2 + 2 * d)) + list(range(2, 2 + d))
    return cols.permute(perm).reshape(n, -1, *out_sz)
