"""Resampling layers of the segmentation and YOLO forks: Interp (DeepLab v2 / PSPNet bilinear
resize, corners aligned) and Upsample (SegNet's unpooling with the max-pooling mask, or the YOLO
ports' nearest-neighbour upsampling) and DeconvNet's Unpooling (MAX by mask, AVE, TILE)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Layer, tracing
from .registry import register


@register("Interp")
class Interp(Layer):
    """Bilinear resize with corners aligned (DeepLab v2's caffe_cpu_interp2).

    Bottom: x (N, C, H, W). Top: (N, C, H', W').
    Params: interp_param. The input is first cropped by -pad_beg / -pad_end (both <= 0) to
    (Hc, Wc); then H' = (Hc - 1) / shrink + 1 with shrink_factor alone, Hc + (Hc - 1)(zoom - 1)
    with zoom_factor alone, both in that order, or height/width. Source row of output row i:
    i * (Hc - 1) / (H' - 1) in float32. Gradient: the adjoint of the interpolation.
    """

    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def setup(self, bottom_shapes):
        p = self.param.interp_param
        if p.pad_beg > 0 or p.pad_end > 0:
            raise self.fail(f"only non-positive pad_beg/pad_end (cropping) are supported, got "
                            f"{p.pad_beg}, {p.pad_end}")

    def reshape(self, bottom_shapes):
        p = self.param.interp_param
        n, c, h, w = bottom_shapes[0]
        hc, wc = h + p.pad_beg + p.pad_end, w + p.pad_beg + p.pad_end
        shrink, zoom = p.HasField("shrink_factor"), p.HasField("zoom_factor")
        if shrink or zoom:
            if (shrink and p.shrink_factor < 1) or (zoom and p.zoom_factor < 1):
                raise self.fail("shrink_factor and zoom_factor must be >= 1")
            ho, wo = ((hc - 1) // p.shrink_factor + 1, (wc - 1) // p.shrink_factor + 1) if shrink else (hc, wc)
            if zoom:
                ho, wo = ho + (ho - 1) * (p.zoom_factor - 1), wo + (wo - 1) * (p.zoom_factor - 1)
        elif p.HasField("height") and p.HasField("width"):
            ho, wo = p.height, p.width
        else:
            raise self.fail("interp_param needs zoom_factor, shrink_factor, or height and width")
        if hc <= 0 or wc <= 0 or ho <= 0 or wo <= 0:
            raise self.fail(f"input {hc}x{wc} after cropping and output {ho}x{wo} must be positive")
        return [(n, c, ho, wo)]

    def forward(self, bottoms):
        p = self.param.interp_param
        x = bottoms[0]
        h, w = x.shape[2:]
        x = x[:, :, -p.pad_beg: h + p.pad_end, -p.pad_beg: w + p.pad_end]
        ho, wo = self.reshape([tuple(b.shape) for b in bottoms])[0][2:]
        if (ho, wo) == tuple(x.shape[2:]):
            return [x.clone()]
        return [F.interpolate(x, size=(ho, wo), mode="bilinear", align_corners=True)]


class _Unpool(torch.autograd.Function):
    """SegNet's Upsample: top[mask[i]] = x[i] per channel plane, a later i winning a repeated
    index; backward gathers the top gradient at every mask[i] (repeats included), as the fork."""

    @staticmethod
    def forward(ctx, x, idx, size):
        n, c = x.shape[:2]
        flat = x.reshape(n * c, -1)
        ix = idx.reshape(n * c, -1)
        pos = torch.arange(ix.shape[1]).expand_as(ix)
        last = torch.full((n * c, size), -1, dtype=torch.int64).scatter_reduce(1, ix, pos, "amax")
        out = flat.gather(1, last.clamp(min=0)).masked_fill(last < 0, 0)
        ctx.save_for_backward(ix)
        ctx.shape = x.shape
        return out.reshape(n, c, -1)

    @staticmethod
    def backward(ctx, g):
        (ix,) = ctx.saved_tensors
        n, c = ctx.shape[:2]
        return g.reshape(n * c, -1).gather(1, ix).reshape(ctx.shape), None, None


@register("Upsample")
class Upsample(Layer):
    """Upsampling, two forks under one type.

    Two bottoms (SegNet): x (N, C, H, W) and the max-pooling mask of the same shape (flat
    indices into each H' x W' output plane, as Pooling's second top gives); each value goes to its
    index, the rest is 0. Size: upsample_h/w, else H * scale_h - pad_out_h (scale_h, or scale,
    > 1). Gradient: the top gradient read back at each index; none to the mask.
    One bottom (YOLO ports): nearest-neighbour, each value repeated scale x scale times (scale
    unset: 1, the ports' default). Gradient: the sum over each block.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    in_place_ok = False
    arithmetic = "elementwise"

    def allow_backward(self, i):
        return i == 0

    def setup(self, bottom_shapes):
        p = self.param.upsample_param
        if len(bottom_shapes) == 1:
            self.scale = p.scale if p.HasField("scale") else 1
            if self.scale < 1:
                raise self.fail(f"scale must be >= 1, got {self.scale}")
            return
        if p.HasField("upsample_h") and p.HasField("upsample_w"):
            if p.upsample_h <= 1 or p.upsample_w <= 1:
                raise self.fail("upsample_h and upsample_w must be > 1")
            self.size = (p.upsample_h, p.upsample_w)
            return
        if p.HasField("scale_h") != p.HasField("scale_w") or (p.HasField("scale_h") and p.HasField("scale")):
            raise self.fail("give upsample_h and upsample_w, else scale, or scale_h and scale_w")
        self.size = None
        self.scales = (p.scale_h, p.scale_w) if p.HasField("scale_h") else (p.scale, p.scale)
        if min(self.scales) <= 1:
            raise self.fail(f"scales must be > 1, got {self.scales}")
        if (p.pad_out_h and self.scales[0] != 2) or (p.pad_out_w and self.scales[1] != 2):
            raise self.fail("pad_out_h/pad_out_w need a scale of 2")

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(bottom_shapes) == 1:
            return [x[:-2] + (x[-2] * self.scale, x[-1] * self.scale)]
        if len(x) != 4 or tuple(bottom_shapes[1]) != x:
            raise self.fail(f"x and mask must be 4-D of one shape, got {x} and {tuple(bottom_shapes[1])}")
        p = self.param.upsample_param
        h, w = self.size or (x[2] * self.scales[0] - int(p.pad_out_h), x[3] * self.scales[1] - int(p.pad_out_w))
        return [(x[0], x[1], h, w)]

    def forward(self, bottoms):
        x = bottoms[0]
        if len(bottoms) == 1:
            s = self.scale
            return [x.repeat_interleave(s, -2).repeat_interleave(s, -1) if s > 1 else x.clone()]
        out = self.reshape([tuple(b.shape) for b in bottoms])[0]
        idx = bottoms[1].detach().to("cpu", torch.int64)
        size = out[2] * out[3]
        # in a graph a bad index fails in scatter (on the CPU, always), and the graph's guard
        # sends the call to the eager path, which names it here (execution/fast_path.py)
        if not tracing() and idx.numel() and (int(idx.max()) >= size or int(idx.min()) < 0):
            raise self.fail(f"mask index {int(idx.max())} out of range for a {out[2]}x{out[3]} output "
                            "(check the scale against the pooling layer that made the mask)")
        top = _Unpool.apply(x.cpu() if x.device.type != "cpu" else x, idx, size)
        return [top.reshape(out).to(x.device)]


class _Spread(torch.autograd.Function):
    """top = Fh^T x Fw per plane; backward Bh g Bw^T (the fork's TILE backward divides by the
    window size though its forward does not: B differs from F there)."""

    @staticmethod
    def forward(ctx, x, fh, fw, bh, bw):
        ctx.save_for_backward(bh, bw)
        return torch.einsum("nchw,hH,wW->ncHW", x, fh.to(x.dtype), fw.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        bh, bw = ctx.saved_tensors
        return torch.einsum("ncHW,hH,wW->nchw", g, bh.to(g.dtype), bw.to(g.dtype)), None, None, None, None


@register("Unpooling")
class Unpooling(Layer):
    """DeconvNet's unpooling (HyeonwooNoh/caffe unpooling_layer.cpp), V1 type UNPOOLING.

    Bottom x (N, C, H, W) [and, MAX only, the pooling mask of the same shape: flat indices into
    each output plane, as Pooling's second top]. Top (N, C, Hu, Wu): unpool_size or
    unpool_h/unpool_w, one of which the fork requires (its Reshape's default size,
    max((H - 1) * stride + kernel, H * stride + 1), is never reached). MAX: each value to its
    mask index (a later one winning a repeat), or without a mask to (min(ph * stride, Hu - 1),
    min(pw * stride, Wu - 1)); the rest 0. AVE: each value / window size added over its
    window (clipped to the output; the size counts the unclipped extent up to Hu + pad).
    TILE: each value added over its window.
    Gradient: MAX reads the top gradient back at each index; AVE and TILE sum it over the window
    divided by the window size (TILE too, as the fork's backward). The fork allows pad 0 only.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    in_place_ok = False

    def allow_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom_shapes):
        p = self.param.unpooling_param
        has = p.HasField
        if has("kernel_size") == (has("kernel_h") and has("kernel_w")):
            raise self.fail("filter size is kernel_size OR kernel_h and kernel_w; not both")
        if (has("pad") and (has("pad_h") or has("pad_w"))) or has("pad_h") != has("pad_w"):
            raise self.fail("pad is pad OR pad_h and pad_w")
        if (has("stride") and (has("stride_h") or has("stride_w"))) or has("stride_h") != has("stride_w"):
            raise self.fail("stride is stride OR stride_h and stride_w")
        if has("unpool_size") == (has("unpool_h") and has("unpool_w")) or has("unpool_h") != has("unpool_w"):
            raise self.fail("the output size is unpool_size OR unpool_h and unpool_w (the fork "
                            "requires one)")
        self.kernel = (p.kernel_size,) * 2 if has("kernel_size") else (p.kernel_h, p.kernel_w)
        self.pad = (p.pad_h, p.pad_w) if has("pad_h") else (p.pad,) * 2
        self.stride = (p.stride_h, p.stride_w) if has("stride_h") else (p.stride,) * 2
        if min(self.kernel) <= 0:
            raise self.fail(f"filter dimensions cannot be zero, got {self.kernel}")
        if any(self.pad):
            raise self.fail("only zero padding is allowed (the fork's check)")
        if min(self.stride) <= 0:
            raise self.fail(f"stride must be positive, got {self.stride}")
        self.method = p.unpool
        if len(bottom_shapes) == 2 and self.method != p.MAX:
            raise self.fail("only MAX unpooling takes a mask bottom")
        self.size = (p.unpool_size,) * 2 if has("unpool_size") else (p.unpool_h, p.unpool_w)
        if min(self.size) <= 0:
            raise self.fail(f"the output size must be positive, got {self.size}")

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) != 4:
            raise self.fail(f"bottom must be (N, C, H, W), got {x}")
        if len(bottom_shapes) == 2 and tuple(bottom_shapes[1]) != x:
            raise self.fail(f"the mask {tuple(bottom_shapes[1])} must be shaped as x {x}")
        return [x[:2] + self.size]

    def _windows(self, n, out, k, s, pad, dtype):
        """(n, out) matrices: the window indicator, and indicator / window extent."""
        f = torch.zeros(n, out, dtype=dtype)
        b = torch.zeros(n, out, dtype=dtype)
        for i in range(n):
            start = i * s - pad
            end = min(start + k, out + pad)
            extent = end - start
            lo, hi = max(start, 0), min(end, out)
            f[i, lo:hi] = 1
            b[i, lo:hi] = 1 / extent
        return f, b

    def forward(self, bottoms):
        x = bottoms[0]
        n, c, h, w = x.shape
        hu, wu = self.size
        MAX, AVE = self.param.unpooling_param.MAX, self.param.unpooling_param.AVE
        if self.method == MAX:
            if len(bottoms) == 2:
                idx = bottoms[1].detach().to("cpu", torch.int64)
                if not tracing() and idx.numel() and (int(idx.max()) >= hu * wu or int(idx.min()) < 0):
                    raise self.fail(f"mask index out of range for a {hu}x{wu} output")
            else:
                rows = (torch.arange(h) * self.stride[0] - self.pad[0]).clamp(0, hu - 1)
                cols = (torch.arange(w) * self.stride[1] - self.pad[1]).clamp(0, wu - 1)
                idx = (rows[:, None] * wu + cols[None, :]).expand(n, c, h, w)
            top = _Unpool.apply(x.cpu() if x.device.type != "cpu" else x, idx, hu * wu)
            return [top.reshape(n, c, hu, wu).to(x.device)]
        fh, bh = self._windows(h, hu, self.kernel[0], self.stride[0], self.pad[0], torch.float64)
        fw, bw = self._windows(w, wu, self.kernel[1], self.stride[1], self.pad[1], torch.float64)
        if self.method == AVE:
            fh, fw = bh, bw
        dev = x.device
        return [_Spread.apply(x, fh.to(dev), fw.to(dev), bh.to(dev), bw.to(dev))]
