"""The R-CNN family of the forks: ROIPooling and SmoothL1Loss (rbgirshick/caffe-fast-rcnn),
PSROIPooling (daijifeng001/caffe-rfcn), and Proposal, py-faster-rcnn's Python
``rpn.proposal_layer`` built in (a prototxt naming that module runs here when it is not
importable, see python.py).

Box coordinates follow the forks' pixel convention: inclusive corners, widths ``x2 - x1 + 1``;
C's ``round`` (halves away from zero) where the forks round; float32 arithmetic where they
compute in ``Dtype``. ROI bottoms are (R, 5) rows ``[batch index, x1, y1, x2, y2]``.
"""
from __future__ import annotations

import ast
import logging

import numpy as np
import torch
import torch.nn.functional as F

from .base import Layer, count
from .registry import register

log = logging.getLogger("brewnet")
F32 = np.float32


def c_round(x):
    """C's round(): halves away from zero (numpy rounds them to even)."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _rois(layer: Layer, rois: torch.Tensor, batch: int) -> np.ndarray:
    r = rois.detach().to("cpu", torch.float32).reshape(rois.shape[0], -1).numpy()
    if r.shape[1] != 5:
        raise layer.fail(f"rois must be (R, 5) rows [batch, x1, y1, x2, y2], got {tuple(rois.shape)}")
    b = r[:, 0].astype(np.int64)
    if ((b < 0) | (b >= batch)).any():
        raise layer.fail(f"roi batch index {int(b[(b < 0) | (b >= batch)][0])} out of range "
                         f"for a batch of {batch}")
    return r


def _bins(start, size, pooled: int, extent: int, offset):
    """[start, end) of each of ``pooled`` bins over ``size`` cells from ``start`` (float32 math),
    clipped to [0, extent]."""
    bin_size = F32(size) / F32(pooled)
    p = np.arange(pooled, dtype=F32)
    lo = np.floor(p * bin_size + offset).astype(np.int64)
    hi = np.ceil((p + 1) * bin_size + offset).astype(np.int64)
    return np.clip(lo + start, 0, extent), np.clip(hi + start, 0, extent)


def _adaptive(start: int, size: int, lo, hi, extent: int) -> bool:
    """Whether bins [lo, hi) (float32 math, clipped) over ``size`` cells from ``start`` are
    adaptive pooling's integer ones (floor(p size / P), ceil((p + 1) size / P)) inside the map."""
    p = np.arange(len(lo))
    return (start >= 0 and start + size <= extent and np.array_equal(lo - start, p * size // len(lo))
            and np.array_equal(hi - start, -(-(p + 1) * size // len(lo))))


# -- ROIPooling -------------------------------------------------------------------------------
@register("ROIPooling")
class ROIPooling(Layer):
    """Max over a pooled_h x pooled_w grid of bins in each box (Fast R-CNN).

    Bottoms: features (N, C, H, W), rois (R, 5). Top: (R, C, pooled_h, pooled_w).
    Params: roi_pooling_param.pooled_h, pooled_w (> 0), spatial_scale. Box corners are scaled
    and C-rounded; an empty bin gives 0. Gradient: to the first maximum of each bin in row-major
    order (the fork's argmax), none to the rois.
    """

    exact_bottoms = 2
    exact_tops = 1
    arithmetic = "elementwise"

    def allow_backward(self, i):
        return i == 0

    def setup(self, bottom_shapes):
        p = self.param.roi_pooling_param
        if p.pooled_h <= 0 or p.pooled_w <= 0:
            raise self.fail(f"pooled_h and pooled_w must be > 0, got {p.pooled_h}, {p.pooled_w}")
        self.ph, self.pw, self.scale = p.pooled_h, p.pooled_w, F32(p.spatial_scale)

    def reshape(self, bottom_shapes):
        x, r = bottom_shapes
        return [(r[0], x[1], self.ph, self.pw)]

    def forward(self, bottoms):
        x, rois = bottoms
        n, c, h, w = x.shape
        r = _rois(self, rois, n)
        flat = None      # (an NHWC map's copy in NCHW: made for the first box that needs it)
        values_only = not (torch.is_grad_enabled() and x.requires_grad)
        # NHWC: torch's kernel on a box's NCHW slice took 3x as long (an engine's NCHW output)
        xv = x.contiguous(memory_format=torch.channels_last) if values_only and x.is_cpu else x
        outs = []
        for b, x1, y1, x2, y2 in r:
            sw, sh, ew, eh = (int(v) for v in c_round(np.array([x1, y1, x2, y2], F32) * self.scale))
            rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
            hs, he = _bins(sh, rh, self.ph, h, 0)
            ws, we = _bins(sw, rw, self.pw, w, 0)
            if values_only and _adaptive(sh, rh, hs, he, h) and _adaptive(sw, rw, ws, we, w):
                # the fork's bins are adaptive pooling's over the box: torch's kernel, the same
                # maxima (NaN too), without the per-bin gather (Faster R-CNN ZF's 300 boxes:
                # benchmarks/zoo.py)
                outs.append(F.adaptive_max_pool2d(xv[int(b):int(b) + 1, :, sh:sh + rh, sw:sw + rw],
                                                  (self.ph, self.pw))[0])   # 4-D: NHWC's kernel
                continue
            if flat is None:
                flat = x.reshape(n, c, h * w)
            outs.append(self._pool(flat[int(b)], hs, he, ws, we, w))
        if not outs:
            return [x.new_zeros((0, c, self.ph, self.pw))]
        return [torch.stack(outs)]

    def _pool(self, feat, hs, he, ws, we, width):
        """feat (C, H*W): the max of each bin, gathered at its first argmax (so autograd sends
        the gradient there as the fork's backward does)."""
        kh, kw = max(int((he - hs).max()), 1), max(int((we - ws).max()), 1)
        hh = hs[:, None] + np.arange(kh)                        # (PH, kh)
        ww = ws[:, None] + np.arange(kw)                        # (PW, kw)
        ok = ((hh < he[:, None])[:, None, :, None] & (ww < we[:, None])[None, :, None, :])
        idx = hh[:, None, :, None] * width + ww[None, :, None, :]   # (PH, PW, kh, kw) row-major
        idx = torch.from_numpy(np.where(ok, idx, 0).reshape(len(hs), len(ws), -1))
        ok = torch.from_numpy(ok.reshape(len(hs), len(ws), -1))
        vals = feat[:, idx]                                     # (C, PH, PW, kh*kw)
        with torch.no_grad():
            arg = vals.masked_fill(~ok, float("-inf")).argmax(-1, keepdim=True)
        out = vals.gather(-1, arg).squeeze(-1)
        empty = ~ok.any(-1)
        return out.masked_fill(empty, 0) if empty.any() else out


# -- PSROIPooling -----------------------------------------------------------------------------
@register("PSROIPooling")
class PSROIPooling(Layer):
    """Position-sensitive average pooling (R-FCN): bin (i, j) of output channel d averages input
    channel (d * G + i) * G + j over its cells.

    Bottoms: features (N, output_dim * G * G, H, W), rois (R, 5). Top: (R, output_dim, G, G).
    Params: psroi_pooling_param.spatial_scale, output_dim, group_size (G; all required). Box
    corners are C-rounded before scaling, the far ones + 1; boxes under 0.1 cells count as 0.1;
    empty bins give 0. Gradient: each bin's mean spread over its cells; none to the rois.
    """

    exact_bottoms = 2
    exact_tops = 1

    def allow_backward(self, i):
        return i == 0

    def setup(self, bottom_shapes):
        p = self.param.psroi_pooling_param
        for f in ("spatial_scale", "output_dim", "group_size"):
            if not p.HasField(f):
                raise self.fail(f"psroi_pooling_param.{f} is required")
        if p.output_dim <= 0 or p.group_size <= 0:
            raise self.fail(f"output_dim and group_size must be > 0, got {p.output_dim}, {p.group_size}")
        self.dim, self.g, self.scale = p.output_dim, p.group_size, F32(p.spatial_scale)

    def reshape(self, bottom_shapes):
        x, r = bottom_shapes
        if x[1] != self.dim * self.g * self.g:
            raise self.fail(f"input channels must be output_dim * group_size^2 = "
                            f"{self.dim * self.g * self.g}, got {x[1]}")
        return [(r[0], self.dim, self.g, self.g)]

    def forward(self, bottoms):
        x, rois = bottoms
        n, c, h, w = x.shape
        g, d = self.g, self.dim
        r = _rois(self, rois, n)
        if not len(r):
            return [x.new_zeros((0, d, g, g))]
        sw, sh = (c_round(r[:, 1:3]) * self.scale).T[:, :, None]           # (R, 1) each
        ew, eh = ((c_round(r[:, 3:5]) + F32(1)) * self.scale).T[:, :, None]
        hs, he = _bins(0, np.maximum(eh - sh, F32(0.1)), g, h, sh)        # (R, G) each
        ws, we = _bins(0, np.maximum(ew - sw, F32(0.1)), g, w, sw)
        # every bin's sum from a float64 summed-area table: four reads, all boxes at once (the
        # fork's float32 loop within a few float32 roundings; R-FCN's 300 boxes on 1029 maps
        # took one einsum each, 40% of the net: benchmarks/zoo.py)
        table = F.pad(x.double().cumsum(2).cumsum(3), (1, 0, 1, 0)).view(n, d, g, g, h + 1, w + 1)
        b = torch.from_numpy(r[:, 0].astype(np.int64)).view(-1, 1, 1, 1)
        ch, i, j = (torch.arange(k).view(*s) for k, s in ((d, (1, -1, 1, 1)), (g, (1, 1, -1, 1)),
                                                         (g, (1, 1, 1, -1))))
        hs, he, ws, we = (torch.from_numpy(t) for t in (hs, he, ws, we))

        def at(hh, ww):
            return table[b, ch, i, j, hh.view(-1, 1, g, 1), ww.view(-1, 1, 1, g)]
        total = at(he, we) - at(hs, we) - at(he, ws) + at(hs, ws)       # (R, D, G, G)
        cells = ((he - hs).view(-1, 1, g, 1) * (we - ws).view(-1, 1, 1, g)).clamp(min=1)
        empty = (he <= hs).view(-1, 1, g, 1) | (we <= ws).view(-1, 1, 1, g)
        return [torch.where(empty, 0.0, total / cells).to(x.dtype)]


# -- SmoothL1Loss -----------------------------------------------------------------------------
@register("SmoothL1Loss")
class SmoothL1Loss(Layer):
    """sum(w_out * f(w_in * (a - b))) / N (Fast R-CNN), f(x) = 0.5 (sigma x)^2 if |x| < 1/sigma^2
    else |x| - 0.5/sigma^2.

    Bottoms: a, b (N, ...), optionally inside and outside weights shaped alike (both or neither).
    Top: loss (0-D). Params: smooth_l1_loss_param.sigma (1). Gradient: to a and b (not the
    weights), f'(x) = sigma^2 x inside, sign(x) outside.
    """

    min_bottoms = 2
    max_bottoms = 4
    exact_tops = 1
    is_loss = True

    def allow_backward(self, i):
        return i < 2

    def setup(self, bottom_shapes):
        if len(bottom_shapes) == 3:
            raise self.fail("if weights are used, give both inside and outside weights (4 bottoms)")
        self.sigma2 = F32(self.param.smooth_l1_loss_param.sigma) ** 2

    def reshape(self, bottom_shapes):
        a = bottom_shapes[0]
        for i, s in enumerate(bottom_shapes[1:], 1):
            if s[0] != a[0] or count(s, 1) != count(a, 1) or s[1:2] != a[1:2]:
                raise self.fail(f"bottom {i} has shape {tuple(s)}, bottom 0 {tuple(a)}")
        return [()]

    def forward(self, bottoms):
        a, b = bottoms[0], bottoms[1].reshape(bottoms[0].shape)
        d = a - b
        if len(bottoms) == 4:
            d = d * bottoms[2].reshape(a.shape)
        ad = d.abs()
        inside = ad < 1.0 / float(self.sigma2)
        e = torch.where(inside, 0.5 * float(self.sigma2) * d * d, ad - 0.5 / float(self.sigma2))
        if len(bottoms) == 4:
            e = e * bottoms[3].reshape(a.shape)
        return [e.sum() / a.shape[0]]


# -- Proposal ---------------------------------------------------------------------------------
def generate_anchors(base_size: int = 16, ratios=(0.5, 1, 2), scales=(8, 16, 32)) -> np.ndarray:
    """py-faster-rcnn's anchors (A, 4): each ratio of a base_size square (sides rounded), then
    each scale of it, about the square's centre; ratio-major order."""
    w = h = float(base_size)
    cx = cy = 0.5 * (base_size - 1)
    ws = np.round(np.sqrt(w * h / np.asarray(ratios, float)))
    hs = np.round(ws * np.asarray(ratios, float))
    out = []
    for rw, rh in zip(ws, hs):
        sw, sh = rw * np.asarray(scales, float), rh * np.asarray(scales, float)
        out.append(np.stack([cx - 0.5 * (sw - 1), cy - 0.5 * (sh - 1),
                             cx + 0.5 * (sw - 1), cy + 0.5 * (sh - 1)], 1))
    return np.concatenate(out)


def nms(boxes: np.ndarray, thresh: float) -> list[int]:
    """Greedy NMS over boxes already in score order (float32, +1 pixel areas): a box goes when its
    overlap with a kept one is > thresh (py-faster-rcnn's default GPU NMS and py_cpu_nms)."""
    x1, y1, x2, y2 = boxes.T
    areas = (x2 - x1 + F32(1)) * (y2 - y1 + F32(1))
    alive = np.ones(len(boxes), bool)
    keep = []
    for i in range(len(boxes)):
        if not alive[i]:
            continue
        keep.append(i)
        j = np.arange(i + 1, len(boxes))
        j = j[alive[j]]
        iw = np.maximum(F32(0), np.minimum(x2[i], x2[j]) - np.maximum(x1[i], x1[j]) + F32(1))
        ih = np.maximum(F32(0), np.minimum(y2[i], y2[j]) - np.maximum(y1[i], y1[j]) + F32(1))
        inter = iw * ih
        alive[j[inter / (areas[i] + areas[j] - inter) > F32(thresh)]] = False
    return keep


def proposals(scores, deltas, im_info, anchors, feat_stride, min_size, pre_n, post_n, thresh):
    """py-faster-rcnn's ProposalLayer.forward for one image: scores (A, H, W) foreground, deltas
    (4A, H, W), im_info (rows, cols, scale) -> (boxes (R, 4), scores (R,)), float32."""
    a, h, w = scores.shape
    sx, sy = np.meshgrid(np.arange(w) * feat_stride, np.arange(h) * feat_stride)
    shifts = np.stack([sx.ravel(), sy.ravel(), sx.ravel(), sy.ravel()], 1)
    anch = (anchors[None] + shifts[:, None]).reshape(-1, 4).astype(F32)     # (H*W*A, 4)
    d = deltas.reshape(a, 4, h, w).transpose(2, 3, 0, 1).reshape(-1, 4)
    s = scores.transpose(1, 2, 0).reshape(-1)
    widths = anch[:, 2] - anch[:, 0] + F32(1)
    heights = anch[:, 3] - anch[:, 1] + F32(1)
    cx, cy = anch[:, 0] + F32(0.5) * widths, anch[:, 1] + F32(0.5) * heights
    px, py = d[:, 0] * widths + cx, d[:, 1] * heights + cy
    pw, ph = np.exp(d[:, 2]) * widths, np.exp(d[:, 3]) * heights
    boxes = np.stack([px - F32(0.5) * pw, py - F32(0.5) * ph, px + F32(0.5) * pw, py + F32(0.5) * ph], 1)
    rows, cols = F32(im_info[0]), F32(im_info[1])
    boxes[:, 0::2] = np.maximum(np.minimum(boxes[:, 0::2], cols - F32(1)), F32(0))
    boxes[:, 1::2] = np.maximum(np.minimum(boxes[:, 1::2], rows - F32(1)), F32(0))
    ms = F32(min_size * F32(im_info[2]))
    keep = ((boxes[:, 2] - boxes[:, 0] + F32(1)) >= ms) & ((boxes[:, 3] - boxes[:, 1] + F32(1)) >= ms)
    boxes, s = boxes[keep], s[keep]
    order = np.argsort(s, kind="stable")[::-1]
    if pre_n > 0:
        order = order[:pre_n]
    boxes, s = boxes[order], s[order]
    kept = nms(boxes, thresh) if len(boxes) else []
    if post_n > 0:
        kept = kept[:post_n]
    return boxes[kept], s[kept]


@register("Proposal")
class Proposal(Layer):
    """Region proposals from RPN outputs, py-faster-rcnn's ``rpn.proposal_layer.ProposalLayer``.

    Bottoms: rpn_cls_prob_reshape (1, 2A, H, W) (background then foreground), rpn_bbox_pred
    (1, 4A, H, W), im_info (1, 3+) [rows, cols, scale]. Tops: rois (R, 5) [0, x1, y1, x2, y2],
    optionally scores (R, 1); R varies per image (1 at setup, as the fork).
    Params: proposal_param.feat_stride, base_size, min_size, ratio, scale, pre_nms_topn,
    post_nms_topn, nms_thresh. Anchors: py-faster-rcnn's; boxes decoded, clipped to the image,
    those under min_size * im_info[2] dropped, pre-NMS top-N by score (ties: later anchor
    first, numpy's reversed argsort), NMS, post-NMS top-N. No gradient.
    Differs from OpenCV: OpenCV keeps boxes under the minimum size.
    """

    min_bottoms = 3
    max_bottoms = 3
    min_tops = 1
    max_tops = 2
    arithmetic = "elementwise"

    def allow_backward(self, i):
        return False

    def setup(self, bottom_shapes):
        p = self.param.proposal_param
        self.anchors = generate_anchors(p.base_size, tuple(p.ratio) or (0.5, 1, 2),
                                        tuple(p.scale) or (8, 16, 32))
        self.p = p

    def reshape(self, bottom_shapes):
        a = len(self.anchors)
        if bottom_shapes[0][0] != 1:
            raise self.fail("only single-image batches are supported (as py-faster-rcnn)")
        if bottom_shapes[0][1] != 2 * a or bottom_shapes[1][1] != 4 * a:
            raise self.fail(f"{a} anchors need 2 * {a} score and 4 * {a} delta channels, got "
                            f"{bottom_shapes[0][1]} and {bottom_shapes[1][1]}")
        return [(1, 5), (1, 1)][: self.num_tops]

    def forward(self, bottoms):
        a = len(self.anchors)
        np_ = [b.detach().to("cpu", torch.float32).numpy() for b in bottoms]
        p = self.p
        boxes, s = proposals(np_[0][0, a:], np_[1][0], np_[2].reshape(-1), self.anchors,
                             p.feat_stride, p.min_size, p.pre_nms_topn, p.post_nms_topn,
                             p.nms_thresh)
        rois = np.concatenate([np.zeros((len(boxes), 1), F32), boxes], 1)
        dev = bottoms[0].device
        tops = [torch.from_numpy(np.ascontiguousarray(rois)).to(dev)]
        if self.num_tops > 1:
            tops.append(torch.from_numpy(np.ascontiguousarray(s.reshape(-1, 1))).to(dev))
        return tops


# py-faster-rcnn's config (lib/fast_rcnn/config.py), by phase: pre/post NMS top-N, NMS, min size.
RPN_CFG = {0: (12000, 2000, 0.7, 16), 1: (6000, 300, 0.7, 16)}   # TRAIN, TEST


def proposal_param_from_python(param, phase: int):
    """A LayerParameter for the built-in Proposal equal to py-faster-rcnn's Python layer with
    this ``param_str`` (``'feat_stride': 16``, optional ``'scales': (8, 16, 32)``) and phase."""
    from ..proto import caffe_pb2 as pb

    text = param.python_param.param_str.strip()
    try:
        d = ast.literal_eval(text if text.startswith("{") else "{" + text.replace("\n", ",") + "}")
        feat_stride = int(d["feat_stride"])
        scales = [float(v) for v in d.get("scales", (8, 16, 32))]
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise ValueError(f"Layer '{param.name}': python_param.param_str {text!r} is not "
                         f"rpn.proposal_layer's (\"'feat_stride': 16\"): {e}") from None
    pre, post, thresh, min_size = RPN_CFG[phase]
    out = pb.LayerParameter()
    out.CopyFrom(param)
    out.type = "Proposal"
    out.ClearField("python_param")
    p = out.proposal_param
    p.feat_stride, p.min_size, p.pre_nms_topn, p.post_nms_topn = feat_stride, min_size, pre, post
    p.nms_thresh = thresh
    p.scale.extend(scales)
    return out
