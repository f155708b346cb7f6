"""Resampling layers of the segmentation and YOLO forks: Interp (DeepLab v2 / PSPNet bilinear
resize, corners aligned) and Upsample (SegNet's unpooling with the max-pooling mask, or the YOLO
ports' nearest-neighbour upsampling)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Layer
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
        if idx.numel() and (int(idx.max()) >= size or int(idx.min()) < 0):
            raise self.fail(f"mask index {int(idx.max())} out of range for a {out[2]}x{out[3]} output "
                            "(check the scale against the pooling layer that made the mask)")
        top = _Unpool.apply(x.cpu() if x.device.type != "cpu" else x, idx, size)
        return [top.reshape(out).to(x.device)]
