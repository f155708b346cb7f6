"""Optical-flow layers of FlowNet 2.0's Caffe and PWC-Net's: Correlation and Warp, each with the
fork's own semantics, read from its source.

* ``Correlation``: lmb-freiburg/flownet2 at 476d400834d96337165d8561a8ef469ecfea77cd (the one
  commit of its src/caffe/layers/correlation_layer.cpp/.cu; PWC-Net's Caffe is that fork).
  The fork has a GPU implementation only (its Forward_cpu is NOT_IMPLEMENTED).
* ``Warp``: NVlabs/PWC-Net at 940521b648b91a053a9daceff2101806286668fe,
  Caffe/warping_code/warp_layer.cpp/.cu (GPU only as well: its Forward_cpu does nothing).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from .base import Layer, count
from .registry import register

_MULTIPLY = pb.CorrelationParameter.MULTIPLY
_SUBTRACT = pb.CorrelationParameter.SUBTRACT


@register("Correlation")
class Correlation(Layer):
    """FlowNet's correlation of two feature maps (correlation_layer.cu, CorrelateData and
    CorrelateDataSubtract).

    Bottoms: f1, f2 (N, C, H, W), equal shapes. Top: (N, D * D, top_h, top_w) with
    r = max_displacement // stride_2, D = 2 r + 1, border = max_displacement + (k - 1) / 2,
    top_h = ceil((H + 2 pad - 2 border) / stride_1) (likewise top_w).

    Both bottoms are zero-padded by ``pad``. Top (c, y, x), for c = (p + r) * D + (o + r)
    (vertical displacement p major, horizontal o minor, each in -r..r), with (y1, x1) =
    (y, x) * stride_1 + max_displacement the patch's upper-left corner in padded f1:

        MULTIPLY: sum_{j, i < k, ch} f1[ch, y1 + j, x1 + i] * f2[ch, y1 + j + p s2, x1 + i + o s2]
        SUBTRACT: the same sum of |f1 - f2|

    divided by sumelems = k * k * C. ``do_abs`` is read by the fork and never applied, as here;
    ``single_direction`` belongs to its Correlation1D. Gradient: MULTIPLY's is the fork's
    (CorrelateDataBackward0/1 are the exact gradient of its forward). SUBTRACT's here is the
    exact gradient of its forward; the fork's CorrelateDataBackward0/1Subtract take the sign
    of f1 - f2 both at the displaced position, which is not its forward's gradient.
    """

    exact_bottoms = 2
    exact_tops = 1
    in_place_ok = False

    def setup(self, bottom_shapes):
        p = self.param.correlation_param
        if not p.HasField("kernel_size"):
            raise self.fail("correlation_param.kernel_size is required")
        if not p.HasField("max_displacement"):
            raise self.fail("correlation_param.max_displacement is required")
        if p.kernel_size % 2 == 0:
            raise self.fail(f"kernel_size must be odd, got {p.kernel_size}")
        if p.stride_1 < 1 or p.stride_2 < 1:
            raise self.fail(f"stride_1 and stride_2 must be >= 1, got {p.stride_1}, {p.stride_2}")
        if p.correlation_type not in (_MULTIPLY, _SUBTRACT):
            raise self.fail(f"unknown correlation_type {p.correlation_type}")
        self.k, self.md, self.pad = p.kernel_size, p.max_displacement, p.pad
        self.s1, self.s2 = p.stride_1, p.stride_2
        self.subtract = p.correlation_type == _SUBTRACT
        self.radius = self.md // self.s2
        self.grid = 2 * self.radius + 1

    def reshape(self, bottom_shapes):
        a, b = (tuple(s) for s in bottom_shapes)
        if len(a) != 4 or a[1:] != b[1:] or a[0] != b[0]:
            raise self.fail(f"needs two (N, C, H, W) bottoms of one shape, got {a} and {b}")
        border = self.md + (self.k - 1) // 2
        th = math.ceil((a[2] + 2 * self.pad - 2 * border) / self.s1)
        tw = math.ceil((a[3] + 2 * self.pad - 2 * border) / self.s1)
        if th < 1 or tw < 1:
            raise self.fail(f"a {a[2]}x{a[3]} bottom padded by {self.pad} has no room for "
                            f"max_displacement {self.md} and kernel_size {self.k}")
        self.top_hw = (th, tw)
        return [(a[0], self.grid * self.grid, th, tw)]

    def forward(self, bottoms):
        a, b = bottoms
        th, tw = self.reshape([a.shape, b.shape])[0][2:]
        k, md, s1, s2, r = self.k, self.md, self.s1, self.s2, self.radius
        if self.pad:
            a, b = F.pad(a, (self.pad,) * 4), F.pad(b, (self.pad,) * 4)
        lh, lw = (th - 1) * s1 + k, (tw - 1) * s1 + k     # the rows/columns the patches cover
        win = a[:, :, md:md + lh, md:md + lw]
        norm = k * k * a.shape[1]
        out = []
        for p in range(-r, r + 1):
            for o in range(-r, r + 1):
                y0, x0 = md + p * s2, md + o * s2
                other = b[:, :, y0:y0 + lh, x0:x0 + lw]
                d = (win - other).abs() if self.subtract else win * other
                s = d.sum(1, keepdim=True)
                if k > 1:
                    s = F.avg_pool2d(s, k, s1) * (k * k)
                elif s1 > 1:
                    s = s[:, :, ::s1, ::s1]
                out.append(s)
        return [torch.cat(out, 1) / norm]

    def flops(self, bottom_shapes, top_shapes):
        return 2 * count(top_shapes[0]) * self.k * self.k * int(bottom_shapes[0][1])

    def extra_repr(self):
        kind = "SUBTRACT" if self.subtract else "MULTIPLY"
        return (f"k={self.k}, max_displacement={self.md}, pad={self.pad}, stride_1={self.s1}, "
                f"stride_2={self.s2}, {kind}")


class _WarpFn(torch.autograd.Function):
    """PWC-Net's WarpForwardGPU / WarpBackwardGPU_dFlow / WarpBackwardGPU_dU."""

    @staticmethod
    def forward(ctx, u, flow):
        v, saved = _warp(u, flow)
        ctx.save_for_backward(u, flow)
        ctx.saved = saved
        return v

    @staticmethod
    def backward(ctx, dv):
        u, flow = ctx.saved_tensors
        valid, ifx, icx, ify, icy, ax, ay = ctx.saved
        n, c, h, w = u.shape
        du = dflow = None
        m = valid.to(dv.dtype)[:, None]
        g = dv * m                                            # (N, C, H, W)
        if ctx.needs_input_grad[0]:
            du = torch.zeros(n, c, h * w, dtype=u.dtype, device=u.device)
            for idx, wt in ((ify * w + ifx, (1 - ax) * (1 - ay)), (ify * w + icx, ax * (1 - ay)),
                            (icy * w + ifx, (1 - ax) * ay), (icy * w + icx, ax * ay)):
                du.scatter_add_(2, idx.reshape(n, 1, -1).expand(n, c, -1),
                                (wt[:, None] * g).reshape(n, c, -1))
            du = du.view(n, c, h, w)
        if ctx.needs_input_grad[1]:
            flat = u.reshape(n, c, h * w)

            def pic(yy, xx):
                return flat.gather(2, (yy * w + xx).reshape(n, 1, -1).expand(n, c, -1)).view(n, c, h, w)

            tl, tr, bl, br = pic(ify, ifx), pic(ify, icx), pic(icy, ifx), pic(icy, icx)
            ax1, ay1 = ax[:, None], ay[:, None]
            gx = (1 - ay1) * tr - (1 - ay1) * tl + ay1 * br - ay1 * bl
            gy = (1 - ax1) * bl - (1 - ax1) * tl + ax1 * br - ax1 * tr
            # On an integer grid position the kernel adds the mean of the one-sided differences
            # (0 for a neighbour outside the image) on top of the (then zero) analytic term.
            xn, xp = (ifx - 1).clamp(min=0), (ifx + 1).clamp(max=w - 1)
            has_l, has_r = (ifx - 1 >= 0)[:, None], (ifx + 1 <= w - 1)[:, None]
            left_t = torch.where(has_l, tl - pic(ify, xn), 0.0)
            left_b = torch.where(has_l, bl - pic(icy, xn), 0.0)
            right_t = torch.where(has_r, pic(ify, xp) - tl, 0.0)
            right_b = torch.where(has_r, pic(icy, xp) - bl, 0.0)
            ex = (1 - ay1) * (right_t + left_t) / 2 + ay1 * (right_b + left_b) / 2
            gx = gx + torch.where((ifx == icx)[:, None], ex, 0.0)
            yn, yp = (ify - 1).clamp(min=0), (ify + 1).clamp(max=h - 1)
            has_t, has_b = (ify - 1 >= 0)[:, None], (ify + 1 <= h - 1)[:, None]
            top_l = torch.where(has_t, tl - pic(yn, ifx), 0.0)
            top_r = torch.where(has_t, tr - pic(yn, icx), 0.0)
            bot_l = torch.where(has_b, pic(yp, ifx) - tl, 0.0)
            bot_r = torch.where(has_b, pic(yp, icx) - tr, 0.0)
            ey = (1 - ax1) * (bot_l + top_l) / 2 + ax1 * (bot_r + top_r) / 2
            gy = gy + torch.where((ify == icy)[:, None], ey, 0.0)
            dflow = torch.stack([(gx * g).sum(1), (gy * g).sum(1)], 1).to(flow.dtype)
        return du, dflow


def _warp(u, flow):
    """V = U sampled bilinearly at (s + v, t + u): WarpForwardGPU. Positions outside
    [0, W - 1] x [0, H - 1] give 0; corners are floor and ceil of the position."""
    n, c, h, w = u.shape
    t = torch.arange(w, dtype=flow.dtype, device=flow.device)
    s = torch.arange(h, dtype=flow.dtype, device=flow.device)
    x = t + flow[:, 0]                     # (N, H, W)
    y = s[:, None] + flow[:, 1]
    valid = (x >= 0) & (x <= w - 1) & (y >= 0) & (y <= h - 1)
    x, y = torch.where(valid, x, 0.0), torch.where(valid, y, 0.0)
    fx, fy = torch.floor(x), torch.floor(y)
    ifx, icx = fx.long(), torch.ceil(x).long()
    ify, icy = fy.long(), torch.ceil(y).long()
    ax, ay = (x - fx).to(u.dtype), (y - fy).to(u.dtype)
    flat = u.reshape(n, c, h * w)

    def pic(yy, xx):
        return flat.gather(2, (yy * w + xx).reshape(n, 1, -1).expand(n, c, -1)).view(n, c, h, w)

    ax1, ay1 = ax[:, None], ay[:, None]
    v = (1 - ax1) * (1 - ay1) * pic(ify, ifx)
    v = v + ax1 * (1 - ay1) * pic(ify, icx)
    v = v + (1 - ax1) * ay1 * pic(icy, ifx)
    v = v + ax1 * ay1 * pic(icy, icx)
    v = torch.where(valid[:, None], v, 0.0)
    return v, (valid, ifx, icx, ify, icy, ax, ay)


@register("Warp")
class Warp(Layer):
    """PWC-Net's Warp: backward warping of features by a flow field (warp_layer.cu).

    Bottoms: U (N, C, H, W), flow (N, 2, H, W) (channel 0 horizontal, 1 vertical, in pixels).
    Top: (N, C, H, W), V[n, c, s, t] = U[n, c] sampled bilinearly at (y, x) = (s + flow_1,
    t + flow_0) from the corners floor/ceil of each coordinate, 0 where the position leaves
    [0, W - 1] x [0, H - 1] (a position on the last row/column still samples). No params.

    Gradient, as WarpBackwardGPU_dU/_dFlow: U gets the bilinear weights; the flow the analytic
    derivative of the bilinear sample, plus, where a coordinate is an integer (floor == ceil),
    the mean of the left and right one-sided differences (a missing neighbour's difference
    counts 0); no gradient outside the image.
    """

    exact_bottoms = 2
    exact_tops = 1
    in_place_ok = False
    arithmetic = "elementwise"

    def reshape(self, bottom_shapes):
        u, f = (tuple(s) for s in bottom_shapes)
        # The fork reads the flow at the image's N, H, W and its 2 channels (it only prints an
        # error for another channel count, then reads past the flow).
        if len(u) != 4 or len(f) != 4 or f != (u[0], 2, u[2], u[3]):
            raise self.fail(f"needs an image (N, C, H, W) and a flow (N, 2, H, W); got {u} and {f}")
        return [u]

    def forward(self, bottoms):
        u, flow = bottoms
        return [_WarpFn.apply(u, flow)]

    def flops(self, bottom_shapes, top_shapes):
        return 8 * count(top_shapes[0])
