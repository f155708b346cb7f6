"""Caffe's pooling as pure torch functions: its window count, MAX, AVE and STOCHASTIC pooling.

Caffe's integer rules differ from torch's in a few corners (the ceil rule, windows clipped to
the image, -FLT_MAX for a window with nothing above it): each such place says so. The
gradients are Caffe's (MAX pooling's goes to the first maximum).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .functional import Ints, grad_needed

FLT_MAX = 3.4028234663852886e38   # Caffe's start value for MAX pooling (-FLT_MAX)
FLT_MIN = 1.1754943508222875e-38  # Caffe's start value for the STOCHASTIC TEST denominator


def pool_out_shape(in_hw: Ints, kernel: Ints, stride: Ints, pad: Ints,
                   ceil_mode: bool = True) -> tuple[int, int]:
    """Caffe's pooled (H, W): ``ceil`` (or floor) of ``(H + 2p - k) / s`` plus one; then, if any
    pad is non-zero, each dim whose last window would start at or past ``H + p`` loses it.

    Differs from torch: torch clips in ceil mode even without padding, Caffe only with padding
    (and then in both dims, even one whose own pad is 0)."""
    out = []
    for h, k, s, p in zip(in_hw, kernel, stride, pad):
        num = h + 2 * p - k
        o = (-(-num // s) if ceil_mode else num // s) + 1
        if any(pad) and (o - 1) * s >= h + p:
            o -= 1
        out.append(o)
    return out[0], out[1]


def _torch_pool_out(h: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """The pooled size torch's own pooling kernels would produce."""
    o = (h + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (o - 1) * s >= h + p:
        o -= 1
    return o


def _native_pool_ok(in_hw, out_hw, kernel, stride, pad, ceil_mode) -> bool:
    """True when torch's padded pooling visits exactly Caffe's windows."""
    return all(p <= k // 2 and _torch_pool_out(h, k, s, p, ceil_mode) == o
               for h, o, k, s, p in zip(in_hw, out_hw, kernel, stride, pad))


def _reachable(in_hw, out_hw, stride, pad) -> tuple[int, int]:
    """Windows per axis that start inside the padded image. A stride far larger than the image
    (Caffe's ceil rule still counts a second window) puts the rest wholly past it: they hold
    nothing and are filled in, not computed, since padding out to them would allocate about
    stride^2 elements per plane."""
    return tuple(min(o, -(-(h + p) // s)) for h, o, s, p in zip(in_hw, out_hw, stride, pad))


def _fill_unreached(y: torch.Tensor, reach, out_hw, value: float) -> torch.Tensor:
    if tuple(reach) == tuple(out_hw):
        return y
    return F.pad(y, [0, out_hw[1] - reach[1], 0, out_hw[0] - reach[0]], value=value)


def _edge_pads(in_hw, out_hw, kernel, stride, pad) -> list[int]:
    """F.pad amounts (W left, W right, H left, H right) making the padded plane hold exactly the
    windows Caffe visits (negative right pads crop what no window reaches)."""
    pads = []
    for h, o, k, s, p in reversed(list(zip(in_hw, out_hw, kernel, stride, pad))):
        pads += [p, (o - 1) * s + k - p - h]
    return pads


def _clamp_flt_max(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Caffe's -FLT_MAX (and no gradient) for a window with nothing above it: an empty one or one
    of -inf only. Never skipped: knowing the input holds no -inf would cost a read of the input,
    more than this pass over the (smaller) output. In place without a gradient (``y`` is fresh):
    no new allocation, the same bits."""
    if torch.finfo(y.dtype).max < FLT_MAX:
        return y                   # half, bfloat16: -FLT_MAX rounds to -inf, nothing to clamp
    if torch.compiler.is_compiling():
        # A traced graph may be cast later (to_torch(...).half()): a tensor bound is cast with it
        # (to -inf in half: nothing to clamp) where a Python float would overflow the op.
        return y.clamp_min(torch.tensor(-FLT_MAX, dtype=y.dtype, device=y.device))
    return y.clamp_min(-FLT_MAX) if grad_needed(x) else y.clamp_min_(-FLT_MAX)


class _MaxPool2d(torch.autograd.Function):
    """Training's MAX pooling where torch visits Caffe's windows: torch's kernel, Caffe's -FLT_MAX
    floor in place on the fresh top, and in the backward one ``threshold_backward`` (no gradient
    where the top is -FLT_MAX: Caffe's mask -1, nothing was above it) before torch's scatter;
    autograd's ``clamp_min`` took a copy forward and ``ge`` + ``where`` backward. Returns
    (top, indices), the indices not differentiable."""

    @staticmethod
    def forward(ctx, x, kernel, stride, pad, ceil_mode):
        y, idx = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, pad, [1, 1], ceil_mode)
        y.clamp_min_(-FLT_MAX)
        ctx.save_for_backward(x, y, idx)
        ctx.pool = (kernel, stride, pad, ceil_mode)
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)    # no zeros for the indices' gradient
        return y, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, _didx):
        if dy is None:
            return None, None, None, None, None
        x, y, idx = ctx.saved_tensors
        kernel, stride, pad, ceil_mode = ctx.pool
        dy = torch.ops.aten.threshold_backward(dy, y, -FLT_MAX)
        return torch.ops.aten.max_pool2d_with_indices_backward(
            dy, x, kernel, stride, pad, [1, 1], ceil_mode, idx), None, None, None, None


# Inference MAX pooling on the CPU in NHWC as a chain of maxima where torch's kernel is slower
# (benchmarks/inference_kernels.py, AVX-512, at brewnet's OpenMP defaults): torch's kernel runs
# short loops along the channels, so the chain wins once its maxima are large enough to run on
# the pool (over torch's grain, 32768 elements; MTCNN P-Net's 10-channel 2x2 on 238x318: 510 us
# against 121; LeNet's pool1 at batch 64: 281 against 100), but for overlapping windows over 32
# channels or more on large inputs (a batch of 16 at 57x57, 3x3/2: 0.74-0.93x). Under the grain
# torch's one kernel call is the cheaper (0.7-1.0x).
WINDOW_MAX_INLINE = 32768
WINDOW_MAX_OVERLAP = (32, 1 << 19)       # overlapping windows: channels, input elements


def _window_max_ok(x, out_hw, kernel, stride, pad) -> bool:
    if torch.compiler.is_compiling() or x.dim() != 4 or x.device.type != "cpu":
        return False                   # (a traced graph keeps torch's op; its batch stays symbolic)
    n, c, h, w = x.shape
    overlap = any(k > s for k, s in zip(kernel, stride))
    return (not any(pad) and c > 1 and kernel[0] * kernel[1] > 1   # (1x1: a view, not a new tensor)
            and n * c * out_hw[0] * w > WINDOW_MAX_INLINE
            and not (overlap and c >= WINDOW_MAX_OVERLAP[0] and x.numel() > WINDOW_MAX_OVERLAP[1])
            and x.is_contiguous(memory_format=torch.channels_last)
            and all((o - 1) * s + k <= d for o, s, k, d in zip(out_hw, stride, kernel, (h, w))))


def _window_max(x, out_hw, kernel, stride) -> torch.Tensor:
    """MAX pooling of windows that all lie inside ``x``, as the element-wise maximum of the
    strided views of each window offset: rows first, then columns. The same values as torch's
    kernel (a maximum is exact; NaN wins in both) but for the sign of a zero maximum where a
    window holds both zeros (torch's kernel keeps the first, the chain may give +0); NHWC in and
    out."""
    y = None
    for i in range(kernel[0]):
        v = x[:, :, i:i + (out_hw[0] - 1) * stride[0] + 1:stride[0]]
        y = v if y is None else torch.maximum(y, v)
    rows, y = y, None
    for j in range(kernel[1]):
        v = rows[:, :, :, j:j + (out_hw[1] - 1) * stride[1] + 1:stride[1]]
        y = v if y is None else torch.maximum(y, v)
    return y


def max_pool2d(x: torch.Tensor, kernel: Ints, stride: Ints, pad: Ints, ceil_mode: bool = True,
               return_mask: bool = False):
    """Caffe MAX pooling of (N, C, H, W); returns ``(top, mask)``.

    Each window is clipped to the image; the value is the first strict maximum in row-major order
    starting from -FLT_MAX, so a window with nothing above -FLT_MAX gives -FLT_MAX and mask -1.
    ``mask`` (only with ``return_mask``, else None) is the flat index ``h * W + w`` as x's dtype.
    Differs from torch: Caffe's window count (``pool_out_shape``), pad up to ``kernel - 1``,
    -FLT_MAX instead of -inf for empty windows and windows of -inf only; NaNs are skipped by
    Caffe but win in torch.
    """
    in_hw = tuple(x.shape[-2:])
    out_hw = pool_out_shape(in_hw, kernel, stride, pad, ceil_mode)
    if _native_pool_ok(in_hw, out_hw, kernel, stride, pad, ceil_mode):
        # Without a mask top no index is converted (torch's CPU max_pool2d still computes its
        # own: aten has no index-free kernel for it, with or without a gradient).
        if grad_needed(x) and torch.finfo(x.dtype).max >= FLT_MAX and \
                not torch.compiler.is_compiling():
            y, idx = _MaxPool2d.apply(x, tuple(kernel), tuple(stride), tuple(pad), ceil_mode)
            if not return_mask:
                return y, None
            return y, torch.where(y > -FLT_MAX, idx.to(x.dtype), torch.full_like(y, -1.0))
        if not return_mask:
            if _window_max_ok(x, out_hw, kernel, stride, pad):
                return _clamp_flt_max(_window_max(x, out_hw, kernel, stride), x), None
            y = F.max_pool2d(x, tuple(kernel), tuple(stride), tuple(pad), ceil_mode=ceil_mode)
            return _clamp_flt_max(y, x), None
        y, idx = F.max_pool2d(x, tuple(kernel), tuple(stride), tuple(pad), ceil_mode=ceil_mode,
                              return_indices=True)
    else:
        reach = _reachable(in_hw, out_hw, stride, pad)
        pads = _edge_pads(in_hw, reach, kernel, stride, pad)
        xp = F.pad(x, pads, value=float("-inf"))
        if not return_mask:
            y, idx = F.max_pool2d(xp, tuple(kernel), tuple(stride)), None
        else:
            y, idx = F.max_pool2d(xp, tuple(kernel), tuple(stride), return_indices=True)
        if return_mask:  # indices are into the padded plane: map back to the image's flat index
            wp = xp.shape[-1]
            idx = (idx // wp - pad[0]) * in_hw[1] + (idx % wp - pad[1])
            idx = _fill_unreached(idx, reach, out_hw, -1)
        y = _fill_unreached(y, reach, out_hw, float("-inf"))   # empty: -FLT_MAX, mask -1
    y = _clamp_flt_max(y, x)
    mask = None
    if return_mask:
        mask = torch.where(y > -FLT_MAX, idx.to(x.dtype), torch.full_like(y, -1.0)).detach()
    return y, mask


def _axis_divisors(h: int, o: int, k: int, s: int, p: int) -> list[int]:
    # window [start, min(start + k, h + p)): counts padding, but not past the far padding edge
    return [min(i * s - p + k, h + p) - (i * s - p) for i in range(o)]


@functools.lru_cache(maxsize=256)
def ave_pool_divisor(in_hw: tuple, out_hw: tuple, kernel: tuple, stride: tuple, pad: tuple,
                     device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Caffe's AVE divisor map (outH, outW): each window clipped to ``[-p, H + p)``, i.e. padding
    counts but the part of a ceil-rule window past the far padding does not."""
    dh = _axis_divisors(in_hw[0], out_hw[0], kernel[0], stride[0], pad[0])
    dw = _axis_divisors(in_hw[1], out_hw[1], kernel[1], stride[1], pad[1])
    d = torch.tensor(dh, dtype=torch.float64)[:, None] * torch.tensor(dw, dtype=torch.float64)
    return d.to(device=device, dtype=dtype)


def ave_pool2d(x: torch.Tensor, kernel: Ints, stride: Ints, pad: Ints,
               ceil_mode: bool = True) -> torch.Tensor:
    """Caffe AVE pooling of (N, C, H, W): the sum of the in-image part of each window divided by
    ``ave_pool_divisor``. Where torch visits the same windows, its ``count_include_pad`` divisor
    is the same formula, so the native kernel is used; otherwise sums of an explicitly padded
    plane are divided by the divisor map.
    """
    in_hw = tuple(x.shape[-2:])
    out_hw = pool_out_shape(in_hw, kernel, stride, pad, ceil_mode)
    if _native_pool_ok(in_hw, out_hw, kernel, stride, pad, ceil_mode):
        return F.avg_pool2d(x, tuple(kernel), tuple(stride), tuple(pad), ceil_mode=ceil_mode,
                            count_include_pad=True)
    reach = _reachable(in_hw, out_hw, stride, pad)
    xp = F.pad(x, _edge_pads(in_hw, reach, kernel, stride, pad))
    sums = _fill_unreached(F.avg_pool2d(xp, tuple(kernel), tuple(stride), divisor_override=1),
                           reach, out_hw, 0.0)
    div = ave_pool_divisor(in_hw, out_hw, tuple(kernel), tuple(stride), tuple(pad),
                           x.device, x.dtype)
    return sums / div


def stochastic_pool2d(x: torch.Tensor, kernel: Ints, stride: Ints, train: bool,
                      ceil_mode: bool = True, generator: torch.Generator | None = None):
    """Caffe STOCHASTIC pooling (no padding; windows clipped to the image), as Caffe's GPU code.

    TRAIN: per window draw u in (0, 1] and take the first element whose running sum reaches
    ``u * sum(window)``; the gradient goes to that element. TEST: the probability-weighted
    average ``sum(x^2) / (FLT_MIN + sum(x))``, differentiated exactly. Inputs are meant to be
    non-negative (after a ReLU), as in Caffe.
    Differs from Caffe: runs on every device (Caffe's CPU code aborts); TEST backward is the true
    derivative (Caffe reuses stale sample indices); the random stream is torch's.
    """
    in_hw = tuple(x.shape[-2:])
    full_hw = pool_out_shape(in_hw, kernel, stride, (0, 0), ceil_mode)
    out_hw = _reachable(in_hw, full_hw, stride, (0, 0))      # the rest are empty: 0
    xp = F.pad(x, _edge_pads(in_hw, out_hw, kernel, stride, (0, 0)))
    n, c = x.shape[:2]
    win = F.unfold(xp.reshape(n * c, 1, *xp.shape[-2:]), tuple(kernel), stride=tuple(stride))
    win = win.view(n, c, kernel[0] * kernel[1], *out_hw)      # (N, C, kh*kw, outH, outW)
    if not train:
        return _fill_unreached((win * win).sum(2) / (win.sum(2) + FLT_MIN), out_hw, full_hw, 0.0)
    cum = win.detach().cumsum(2)
    u = 1.0 - torch.rand(cum[:, :, :1].shape, generator=generator, dtype=x.dtype,
                         device=x.device)
    hit = (cum >= u * cum[:, :, -1:]).to(torch.uint8)
    pick = hit.argmax(2, keepdim=True)                        # first window position that hits
    return _fill_unreached(win.gather(2, pick).squeeze(2), out_hw, full_hw, 0.0)
