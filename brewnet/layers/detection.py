"""SSD layers from Wei Liu's Caffe fork (weiliu89/caffe, branch ssd) used at inference:
Normalize, Permute, PriorBox, DetectionOutput. The training/evaluation layers MultiBoxLoss and
DetectionEvaluate are in ``multibox.py``; the box math (the fork's ``bbox_util.cpp``) in ``bbox.py``.

Like the fork, all box arithmetic (priors, decoding, NMS) is float32 because its NormalizedBBox
holds floats; outputs take the bottoms' dtype. PriorBox and DetectionOutput have no backward.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from ..proto import caffe_pb2 as pb
from . import bbox as B
from .base import Layer, register

FLT_MAX = float(np.finfo(np.float32).max)


def legacy(shape, i: int) -> int:
    """Caffe's ``Blob::LegacyShape``: num/channels/height/width, 1 past the last axis."""
    return int(shape[i]) if i < len(shape) else 1


def priors_from_blob(prior: torch.Tensor, num_priors: int):
    """The fork's GetPriorBBoxes: boxes then variances from the start of the prior blob."""
    flat = prior.detach().reshape(-1)[:2 * num_priors * 4].to("cpu", torch.float32)
    return flat[:num_priors * 4].view(-1, 4), flat[num_priors * 4:].view(-1, 4)


@register("Normalize")
class Normalize(Layer):
    """L2 normalization with a learned scale (SSD's conv4_3_norm).

    Bottom (N, C, ...) -> top of the same shape: x / sqrt(sum x^2 + eps) * scale, the sum over
    (C, H, W) per sample if across_spatial, else over C at each position.
    Params: norm_param across_spatial, channel_shared, scale_filler (default constant 1), eps.
    Blob: scale, shape [] if channel_shared else (C,).
    Differs from torch: F.normalize adds eps to the norm (max), not inside the square root.
    """

    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        if not 2 <= len(shape) <= 4:
            raise self.fail(f"bottom must have 2 to 4 axes (N, C[, H, W]), got {tuple(shape)}")
        p = self.param.norm_param
        self.across_spatial, self.channel_shared, self.eps = p.across_spatial, p.channel_shared, p.eps
        filler = (p.scale_filler if p.HasField("scale_filler")
                  else pb.FillerParameter(type="constant", value=1.0))
        self.blobs = [self.new_blob(() if self.channel_shared else (shape[1],), filler)]

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if not 2 <= len(shape) <= 4 or (not self.channel_shared and shape[1] != self.blobs[0].numel()):
            raise self.fail(f"bottom {shape} does not fit the scale of {self.blobs[0].numel()} channels")
        return [shape]

    def forward(self, bottoms):
        x = bottoms[0]
        dims = tuple(range(1, x.dim())) if self.across_spatial else (1,)
        y = x / torch.sqrt((x * x).sum(dim=dims, keepdim=True) + self.eps)
        scale = self.blobs[0]
        if not self.channel_shared:
            scale = scale.view((1, -1) + (1,) * (x.dim() - 2))
        return [y * scale.to(x.dtype)]


@register("Permute")
class Permute(Layer):
    """Reorder the axes (SSD's NCHW -> NHWC before flattening box predictions).

    Bottom any shape -> top with axes permute_param.order, the unnamed axes appended in order.
    """

    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def setup(self, bottom_shapes):
        n = len(bottom_shapes[0])
        order = [int(o) for o in self.param.permute_param.order]
        if any(o >= n for o in order) or len(set(order)) != len(order):
            raise self.fail(f"order {order} must name distinct axes of the {n}-D bottom "
                            f"{tuple(bottom_shapes[0])}")
        self.order = order + [i for i in range(n) if i not in order]

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != len(self.order):
            raise self.fail(f"bottom {shape} must keep the {len(self.order)} axes it was set up with")
        return [tuple(shape[o] for o in self.order)]

    def forward(self, bottoms):
        return [bottoms[0].permute(self.order).contiguous()]


@register("PriorBox")
class PriorBox(Layer):
    """Default (anchor) boxes for one feature map, shared by all images of the batch.

    Bottoms: feature map (N, C, H, W), image (N, 3, img_H, img_W).
    Top: (1, 2, H*W*num_priors*4): channel 0 the [xmin, ymin, xmax, ymax] of every prior,
    normalised by the image size, ordered by cell (row-major), then per min_size: the min_size
    square, the sqrt(min*max) square, then each aspect ratio != 1; channel 1 the variances.
    Params: prior_box_param min_size, max_size, aspect_ratio, flip, clip, variance, img_size /
    img_h / img_w, step / step_h / step_w, offset. Sizes are truncated to int, as the fork does.
    """

    exact_bottoms = 2
    exact_tops = 1

    def allow_backward(self, i):
        return False

    def setup(self, bottom_shapes):
        p = self.param.prior_box_param
        if not p.min_size or any(s <= 0 for s in p.min_size):
            raise self.fail("prior_box_param needs positive min_size values")
        if p.max_size and (len(p.max_size) != len(p.min_size)
                           or any(a <= b for a, b in zip(p.max_size, p.min_size))):
            raise self.fail("prior_box_param: one max_size per min_size, each larger than it")
        ratios = [np.float32(1.0)]
        for ar in p.aspect_ratio:
            if all(abs(ar - r) >= 1e-6 for r in ratios):
                ratios.append(np.float32(ar))
                if p.flip:
                    ratios.append(np.float32(1.0 / ar))
        self.ratios = ratios
        self.num_priors = len(ratios) * len(p.min_size) + len(p.max_size)
        var = list(p.variance) or [0.1]
        if len(var) not in (1, 4) or any(v <= 0 for v in var):
            raise self.fail(f"variance must be 1 or 4 positive values, got {var}")
        self.variance = var
        self.img_hw = self._pair(p, "img_size", "img_h", "img_w")
        self.step_hw = self._pair(p, "step", "step_h", "step_w")
        self._cache = {}

    def _pair(self, p, both, h, w):
        if p.HasField(h) or p.HasField(w):
            if p.HasField(both):
                raise self.fail(f"give either {both} or {h}/{w}, not both")
            if getattr(p, h) <= 0 or getattr(p, w) <= 0:
                raise self.fail(f"{h} and {w} must be positive")
            return getattr(p, h), getattr(p, w)
        if p.HasField(both):
            if getattr(p, both) <= 0:
                raise self.fail(f"{both} must be positive")
            return getattr(p, both), getattr(p, both)
        return 0, 0

    def reshape(self, bottom_shapes):
        fm = bottom_shapes[0]
        n = legacy(fm, 2) * legacy(fm, 3) * self.num_priors * 4
        if n <= 0:
            raise self.fail(f"empty feature map {tuple(fm)}")
        return [(1, 2, n)]

    def priors(self, layer_hw, image_hw) -> np.ndarray:
        """(2, H*W*num_priors*4) float32, computed with the fork's float/double steps."""
        p = self.param.prior_box_param
        (lh, lw) = layer_hw
        img_h, img_w = self.img_hw if all(self.img_hw) else image_hw
        f32 = np.float32
        if all(self.step_hw):
            step_h, step_w = f32(self.step_hw[0]), f32(self.step_hw[1])
        else:
            step_h, step_w = f32(img_h) / f32(lh), f32(img_w) / f32(lw)
        offset = f32(p.offset)
        cx = (np.arange(lw, dtype=f32) + offset) * step_w          # float, as center_x
        cy = (np.arange(lh, dtype=f32) + offset) * step_h
        sizes = []                                                   # (box_width, box_height)
        for s, mn in enumerate(p.min_size):
            mn = int(mn)
            sizes.append((f32(mn), f32(mn)))
            if p.max_size:
                side = math.sqrt(mn * int(p.max_size[s]))
                sizes.append((f32(side), f32(side)))
            for ar in self.ratios:
                if abs(ar - 1.0) < 1e-6:
                    continue
                r = np.sqrt(ar)                     # float sqrt; max_size plays no part here
                sizes.append((f32(mn) * r, f32(mn) / r))
        bw = np.array([w for w, _ in sizes], dtype=np.float64)[None, None, :]
        bh = np.array([h for _, h in sizes], dtype=np.float64)[None, None, :]
        x = cx.astype(np.float64)[None, :, None]
        y = cy.astype(np.float64)[:, None, None]
        boxes = np.stack(np.broadcast_arrays((x - bw / 2) / img_w, (y - bh / 2) / img_h,
                                             (x + bw / 2) / img_w, (y + bh / 2) / img_h), -1)
        boxes = boxes.astype(f32).reshape(-1)
        if p.clip:
            boxes = np.clip(boxes, 0, 1)
        var = np.resize(np.array(self.variance, dtype=f32), boxes.size)
        return np.stack([boxes, var])

    def forward(self, bottoms):
        fm, img = bottoms
        key = (legacy(fm.shape, 2), legacy(fm.shape, 3), legacy(img.shape, 2), legacy(img.shape, 3))
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(self.priors(key[:2], key[2:]))
        return [self._cache[key].to(device=fm.device, dtype=fm.dtype, copy=True)[None]]


@register("DetectionOutput")
class DetectionOutput(Layer):
    """Decode SSD box predictions, per-class NMS, keep the best: the detector's output.

    Bottoms: loc (N, P*L*4) (L = 1 if share_location else num_classes), conf (N, P*num_classes)
    (probabilities), priors (1, 2, P*4) from PriorBox.
    Top: (1, 1, num_det, 7) rows [image_id, label, score, xmin, ymin, xmax, ymax], per image by
    label ascending, each label's boxes by score; one row [i, -1, -1, -1, -1, -1, -1] per image
    when nothing is detected at all. Reshape reports (1, 1, 1, 7), as the fork does.
    Params: detection_output_param num_classes, share_location, background_label_id, code_type,
    variance_encoded_in_target, keep_top_k, confidence_threshold, nms_param {nms_threshold,
    top_k, eta}. save_output_param and visualize are not supported (warned and ignored).
    """

    exact_bottoms = 3
    exact_tops = 1

    def allow_backward(self, i):
        return False

    def setup(self, bottom_shapes):
        p = self.param.detection_output_param
        if not p.HasField("num_classes"):
            raise self.fail("detection_output_param.num_classes is required")
        self.num_classes = p.num_classes
        self.share = p.share_location
        self.loc_classes = 1 if self.share else self.num_classes
        self.background = p.background_label_id
        self.code_type, self.var_in_target = p.code_type, p.variance_encoded_in_target
        self.keep_top_k = p.keep_top_k
        self.conf_threshold = p.confidence_threshold if p.HasField("confidence_threshold") else -FLT_MAX
        nms = p.nms_param
        self.nms_threshold, self.eta = nms.nms_threshold, nms.eta
        self.top_k = nms.top_k if nms.HasField("top_k") else -1
        if self.nms_threshold < 0 or not 0 < self.eta <= 1:
            raise self.fail(f"nms_threshold must be >= 0 and eta in (0, 1]; got "
                            f"{self.nms_threshold}, {self.eta}")
        if p.save_output_param.output_directory or p.visualize:
            warnings.warn(f"Layer '{self.name}': save_output_param/visualize are ignored; "
                          "brewnet only produces the detection blob")

    def reshape(self, bottom_shapes):
        loc, conf, prior = (tuple(s) for s in bottom_shapes)
        p = legacy(prior, 2) // 4
        if (loc[0] != conf[0] or legacy(loc, 1) != p * self.loc_classes * 4
                or legacy(conf, 1) != p * self.num_classes):
            raise self.fail(f"loc {loc} and conf {conf} must be (N, {p}*{self.loc_classes}*4) and "
                            f"(N, {p}*{self.num_classes}) for {p} priors {prior}")
        return [(1, 1, 1, 7)]

    def forward(self, bottoms):
        loc, conf, prior = bottoms
        n, c = loc.shape[0], self.num_classes
        p = legacy(prior.shape, 2) // 4
        pbox, pvar = priors_from_blob(prior, p)
        locs = loc.detach().to("cpu", torch.float32).reshape(n, p, self.loc_classes, 4).transpose(1, 2)
        try:
            boxes = B.decode(pbox, pvar, locs, self.code_type, self.var_in_target)   # (n, L, p, 4)
        except B.BoxError as e:
            raise self.fail(str(e)) from None
        scores = conf.detach().to("cpu", torch.float32).reshape(n, p, c)
        rows = []
        for i in range(n):
            kept = {}
            for label in range(c):
                if label == self.background:
                    continue
                b = boxes[i, 0 if self.share else label]
                kept[label] = B.nms_fast(b, scores[i, :, label], self.conf_threshold,
                                         self.nms_threshold, self.eta, self.top_k)
            if self.keep_top_k > -1 and sum(len(k) for k in kept.values()) > self.keep_top_k:
                kept = self._keep_top_k(kept, scores[i])
            for label in sorted(kept):
                idx = kept[label]
                if len(idx):
                    b = boxes[i, 0 if self.share else label, idx]
                    head = torch.tensor([float(i), float(label)]).expand(len(idx), 2)
                    rows.append(torch.cat([head, scores[i, idx, label, None], b], 1))
        if rows:
            out = torch.cat(rows)
        else:  # the fork's "no detection" rows: image id, then -1s
            out = torch.full((n, 7), -1.0)
            out[:, 0] = torch.arange(n, dtype=out.dtype)
        return [out.to(device=loc.device, dtype=loc.dtype)[None, None]]

    def _keep_top_k(self, kept, scores):
        # All kept boxes by score; ties keep label-then-NMS order (the fork's std::sort leaves
        # their order unspecified).
        entries = [(float(scores[j, label]), label, j) for label in sorted(kept)
                   for j in kept[label].tolist()]
        entries.sort(key=lambda e: -e[0])
        new = {}
        for _, label, j in entries[:self.keep_top_k]:
            new.setdefault(label, []).append(j)
        return {label: torch.tensor(js, dtype=torch.long) for label, js in new.items()}

