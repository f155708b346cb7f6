"""YOLOv2 layers of the Caffe YOLO ports: Reorg (Darknet's passthrough reorg, as
eric612/MobileNet-YOLO and OpenCV run it) and Region (Darknet's region-layer outputs)."""
from __future__ import annotations

import torch

from .base import Layer
from .registry import register
from .shape import Rearrange


@register("Reorg")
class Reorg(Rearrange):
    """Darknet's reorg: stride x stride blocks of space moved into channels.

    Bottom (N, C, H, W) -> top (N, C s^2, H / s, W / s) (``reverse``: (N, C / s^2, H s, W s)).
    Darknet's index rule, not a plain space-to-depth: in an (N, C, H, W) layout, channel
    (dy s + dx) C / s^2 + c at (i, j) takes the bottom's memory read as (N, C / s^2, H s, W s)
    at (c, i s + dy, j s + dx); that memory is the top, (N, C s^2, H / s, W / s).
    Params: reorg_param.stride (required), reverse.
    Gradient: the inverse permutation (the port's own backward reads an unset buffer).
    """

    def setup(self, bottom_shapes):
        p = self.param.reorg_param
        if not p.HasField("stride") or p.stride <= 0:
            raise self.fail("reorg_param.stride is required (> 0)")
        self.s, self.reverse = p.stride, p.reverse

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        s = self.s
        if len(x) != 4:
            raise self.fail(f"bottom must be (N, C, H, W), got {x}")
        n, c, h, w = x
        if self.reverse:
            if c % (s * s):
                raise self.fail(f"channels {c} must be a multiple of stride^2 = {s * s}")
            return [(n, c // (s * s), h * s, w * s)]
        if h % s or w % s or c % (s * s):
            raise self.fail(f"H, W of {x} must be multiples of stride {s}, C of stride^2")
        return [(n, c * s * s, h // s, w // s)]

    def forward(self, bottoms):
        x = bottoms[0]
        n, c, h, w = x.shape
        s = self.s
        if not self.reverse:
            # out (as C x H x W) [(oh s + ow) C/s^2 + c2, i, j] = in (as C/s^2 x Hs x Ws) [c2, i s + oh, j s + ow]
            v = x.reshape(n, c // (s * s), h, s, w, s)
            out = v.permute(0, 3, 5, 1, 2, 4).reshape(n, c, h, w)
            return [out.reshape(n, c * s * s, h // s, w // s)]
        tc = c // (s * s)
        v = x.reshape(n, s, s, tc, h, w)            # the same rule, written the other way
        out = v.permute(0, 3, 4, 1, 5, 2).reshape(n, tc, h * s, w * s)
        return [out]


@register("Region")
class Region(Layer):
    """Darknet's YOLOv2 region outputs (as OpenCV's Region layer gives them, before NMS).

    Bottom (N, A (5 + K), H, W): per anchor tx, ty, tw, th, to, K class scores. Top (N, H W A,
    5 + K), rows ordered (row, column, anchor): x = (column + sigmoid(tx)) / W,
    y = (row + sigmoid(ty)) / H, w = exp(tw) anchor_w / W, h = exp(th) anchor_h / H,
    objectness sigmoid(to), then softmax (or sigmoid when softmax is false) of the class scores
    times the objectness, zeroed where not above ``thresh``.
    Params: region_param.classes (K), coords (4), num (A), softmax, anchors (2 A values, cells),
    thresh. Gradient: through the formulas (the thresholding mask is constant).
    """

    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def setup(self, bottom_shapes):
        p = self.param.region_param
        if p.coords != 4:
            raise self.fail(f"only coords: 4 is supported, got {p.coords}")
        if len(p.anchors) != 2 * p.num:
            raise self.fail(f"region_param.anchors needs 2 * num = {2 * p.num} values, got {len(p.anchors)}")
        self.k, self.a = p.classes, p.num

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) != 4 or x[1] != self.a * (5 + self.k):
            raise self.fail(f"bottom {x} must have num * (5 + classes) = {self.a * (5 + self.k)} channels")
        return [(x[0], x[2] * x[3] * self.a, 5 + self.k)]

    def forward(self, bottoms):
        p = self.param.region_param
        x = bottoms[0]
        n, _, h, w = x.shape
        v = x.reshape(n, self.a, 5 + self.k, h, w).permute(0, 3, 4, 1, 2)   # (N, H, W, A, 5+K)
        anchors = torch.tensor(list(p.anchors), dtype=x.dtype, device=x.device).reshape(self.a, 2)
        col = torch.arange(w, dtype=x.dtype, device=x.device).reshape(1, 1, w, 1)
        row = torch.arange(h, dtype=x.dtype, device=x.device).reshape(1, h, 1, 1)
        bx = (col + torch.sigmoid(v[..., 0])) / w
        by = (row + torch.sigmoid(v[..., 1])) / h
        bw = torch.exp(v[..., 2]) * anchors[:, 0] / w
        bh = torch.exp(v[..., 3]) * anchors[:, 1] / h
        obj = torch.sigmoid(v[..., 4])
        cls = v[..., 5:]
        prob = (torch.softmax(cls, -1) if p.softmax else torch.sigmoid(cls)) * obj.unsqueeze(-1)
        prob = prob * (prob > p.thresh).to(prob.dtype).detach()
        out = torch.cat([torch.stack([bx, by, bw, bh, obj], -1), prob], -1)
        return [out.reshape(n, h * w * self.a, 5 + self.k)]
