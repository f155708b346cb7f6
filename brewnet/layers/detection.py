"""Object detection layers of Wei Liu's SSD fork (weiliu89/caffe, branch ssd): PriorBox (anchor
boxes), DetectionOutput (decoding + NMS) and DetectionEvaluate (true/false positives for mAP).
The fork's other layers live with their families: MultiBoxLoss in ``multibox.py`` (a loss),
Normalize in ``normalization.py``, Permute in ``shape.py``; the box math (the fork's
``bbox_util.cpp``) in ``bbox.py``.

Like the fork, all box arithmetic (priors, decoding, NMS) is float32 because its NormalizedBBox
holds floats; outputs take the bottoms' dtype. None of these layers has a backward.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch

from ..proto.prior_layouts import L, aspect_ratios, prior_counts
from . import bbox as B
from .base import Layer
from .registry import register

FLT_MAX = float(np.finfo(np.float32).max)


@register("PriorBox")
class PriorBox(Layer):
    """Default (anchor) boxes for one feature map, shared by all images of the batch.

    Bottoms: feature map (N, C, H, W), image (N, 3, img_H, img_W).
    Top: (1, 2, H*W*num_priors*4): channel 0 the [xmin, ymin, xmax, ymax] of every prior,
    normalised by the image size, ordered by cell (row-major), then per min_size: the min_size
    square, the sqrt(min*max) square, then each aspect ratio != 1; channel 1 the variances.
    Params: prior_box_param min_size, max_size, aspect_ratio, flip, clip, variance, img_size /
    img_h / img_w, step / step_h / step_w, offset. Sizes are truncated to int, as the fork does.

    The forks' layouts (the loc/conf channels follow the same order):
    ``denser_prior_boxes`` (TextBoxes++): each prior followed by its copy centred at
    (h + 1) * step_h, half a cell lower. ``layout: TEXTBOXES`` (TextBoxes): the same for every
    prior, sizes kept as floats, clip true unless given. ``layout: FACEBOXES`` (FaceBoxes):
    min_size 32 gives 4 x 4 boxes centred at the cell centre + (j, i) * 8, j, i in -2..1 (row by
    row), 64 gives 2 x 2 at + (j, i) * 16, j, i in -1..0, any other one box; these min_size
    boxes span the centre -+ (size - 1) / 2. upgrade_net sets ``layout`` from the net's loc
    branch where the prototxt names none (brewnet/proto/prior_layouts.py).
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
        if p.layout != L.SSD and p.denser_prior_boxes:
            raise self.fail("denser_prior_boxes is TextBoxes++'s; it goes with layout SSD only")
        self.ratios = aspect_ratios(p)
        self.cell = self._cell(p)
        self.num_priors = len(self.cell)
        if self.num_priors != prior_counts(p):
            # FaceBoxes' LayerSetUp allocates 21 priors a cell for three min_sizes, else SSD's
            # count; its Forward_cpu writes 16 for 32 and 4 for 64: any other mix overruns (or
            # leaves unset) the fork's own top blob.
            raise self.fail(f"FaceBoxes' layout writes {self.num_priors} priors a cell where the "
                            f"fork allocates {prior_counts(p)}: min_size {list(p.min_size)} is "
                            "not a net that fork runs")
        var = list(p.variance) or [0.1]
        if len(var) not in (1, 4) or any(v <= 0 for v in var):
            raise self.fail(f"variance must be 1 or 4 positive values, got {var}")
        self.variance = var
        self.clip = p.clip if (p.HasField("clip") or p.layout != L.TEXTBOXES) else True
        self.img_hw = self._pair(p, "img_size", "img_h", "img_w")
        self.step_hw = self._pair(p, "step", "step_h", "step_w")
        self._cache = {}

    def _cell(self, p) -> list[tuple]:
        """The priors of one cell, in the fork's order: (dx, dy, half width, half height, down)
        -- centre (center_x + dx, center_y + dy) in float, as the forks add them, or, with
        ``down``, (center_x, (h + 1) * step_h); the half sizes in double."""
        f32 = np.float32
        dense = p.denser_prior_boxes or p.layout == L.TEXTBOXES
        out = []

        def add(dx, dy, hw, hh):
            out.append((dx, dy, hw, hh, False))
            if dense:
                out.append((dx, dy, hw, hh, True))

        for s, size in enumerate(p.min_size):
            # TextBoxes keeps min_size_ a float; SSD, TextBoxes++ and FaceBoxes take int(min_size)
            mn = f32(size) if p.layout == L.TEXTBOXES else f32(int(size))
            if p.layout == L.FACEBOXES:
                n, shift = {32: (4, 8), 64: (2, 16)}.get(int(size), (1, 0))
                half = (float(mn) - 1) / 2.0
                for i in range(-(n // 2), n - n // 2):
                    for j in range(-(n // 2), n - n // 2):
                        add(f32(j * shift), f32(i * shift), half, half)
            else:
                add(f32(0), f32(0), float(mn) / 2, float(mn) / 2)
            if p.max_size:
                if p.layout == L.TEXTBOXES:         # float product, sqrt rounded to float
                    side = f32(math.sqrt(float(mn * f32(p.max_size[s]))))
                else:                               # int product, double sqrt, to float
                    side = f32(math.sqrt(int(mn) * int(p.max_size[s])))
                add(f32(0), f32(0), float(side) / 2, float(side) / 2)
            for ar in self.ratios:
                if abs(ar - 1.0) < 1e-6:
                    continue
                r = np.sqrt(ar)                     # float sqrt; max_size plays no part here
                add(f32(0), f32(0), float(mn * r) / 2, float(mn / r) / 2)
        return out

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
        n = B.legacy(fm, 2) * B.legacy(fm, 3) * self.num_priors * 4
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
        cy1 = (np.arange(lh, dtype=f32) + f32(1)) * step_h          # center_y_offset_1
        dx = np.array([c[0] for c in self.cell], dtype=f32)
        dy = np.array([c[1] for c in self.cell], dtype=f32)
        down = np.array([c[4] for c in self.cell])
        hw = np.array([c[2] for c in self.cell], dtype=np.float64)[None, None, :]
        hh = np.array([c[3] for c in self.cell], dtype=np.float64)[None, None, :]
        x = (cx[None, :, None] + dx[None, None, :]).astype(np.float64)        # float adds
        y = np.where(down[None, None, :], cy1[:, None, None],
                     cy[:, None, None] + dy[None, None, :]).astype(np.float64)
        boxes = np.stack(np.broadcast_arrays((x - hw) / img_w, (y - hh) / img_h,
                                             (x + hw) / img_w, (y + hh) / img_h), -1)
        boxes = boxes.astype(f32).reshape(-1)
        if self.clip:
            boxes = np.clip(boxes, 0, 1)
        var = np.resize(np.array(self.variance, dtype=f32), boxes.size)
        return np.stack([boxes, var])

    def forward(self, bottoms):
        fm, img = bottoms
        key = (B.legacy(fm.shape, 2), B.legacy(fm.shape, 3), B.legacy(img.shape, 2), B.legacy(img.shape, 3))
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

    ``use_polygon`` (TextBoxes++, MhLiao/TextBoxes_plusplus detection_output_layer.cpp/.cu):
    12 loc numbers a prior, the box's 4 then a quadrilateral's 8 (bbox.decode_quad); NMS on the
    boxes (the fork's ApplyNMSFast; its polygon NMS is a Python post-step, not the layer's);
    rows of 15: [image_id, label, score, xmin, ymin, xmax, ymax, x1, y1, x2, y2, x3, y3, x4,
    y4]. CENTER_SIZE with the variances in the priors only: the fork decodes no quadrilateral
    in its other codings.
    """

    exact_bottoms = 3
    exact_tops = 1

    def allow_backward(self, i):
        return False

    def setup(self, bottom_shapes):
        p = self.param.detection_output_param
        if not p.HasField("num_classes"):
            raise self.fail("detection_output_param.num_classes is required")
        self.polygon = p.use_polygon
        if self.polygon and (p.code_type != B.CENTER_SIZE or p.variance_encoded_in_target):
            raise self.fail("use_polygon (TextBoxes++) decodes quadrilaterals with code_type "
                            "CENTER_SIZE and the variances in the priors only, as the fork")
        self.coords = 12 if self.polygon else 4
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
        p = B.legacy(prior, 2) // 4
        if (loc[0] != conf[0] or B.legacy(loc, 1) != p * self.loc_classes * self.coords
                or B.legacy(conf, 1) != p * self.num_classes):
            raise self.fail(f"loc {loc} and conf {conf} must be (N, {p}*{self.loc_classes}*"
                            f"{self.coords}) and (N, {p}*{self.num_classes}) for {p} priors {prior}")
        return [(1, 1, 1, 3 + self.coords)]

    def forward(self, bottoms):
        loc, conf, prior = bottoms
        n, c = loc.shape[0], self.num_classes
        p = B.legacy(prior.shape, 2) // 4
        pbox, pvar = B.priors_from_blob(prior, p)
        locs = loc.detach().to("cpu", torch.float32).reshape(n, p, self.loc_classes, self.coords)
        locs = locs.transpose(1, 2)
        try:
            boxes = B.decode(pbox, pvar, locs[..., :4], self.code_type, self.var_in_target)   # (n, L, p, 4)
            if self.polygon:                                                                 # (n, L, p, 12)
                boxes = torch.cat([boxes, B.decode_quad(pbox, pvar, locs[..., 4:])], -1)
        except B.BoxError as e:
            raise self.fail(str(e)) from None
        boxes = boxes.numpy()
        scores = conf.detach().to("cpu", torch.float32).reshape(n, p, c).numpy()
        rows = []
        for i in range(n):
            kept = {}
            for label in range(c):
                if label == self.background:
                    continue
                b = boxes[i, 0 if self.share else label]
                kept[label] = B.nms_fast(b[:, :4], scores[i, :, label], self.conf_threshold,
                                         self.nms_threshold, self.eta, self.top_k)
            if self.keep_top_k > -1 and sum(len(k) for k in kept.values()) > self.keep_top_k:
                kept = self._keep_top_k(kept, scores[i])
            for label in sorted(kept):
                idx = kept[label]
                if len(idx):
                    b = boxes[i, 0 if self.share else label, idx]
                    head = np.broadcast_to(np.array([i, label], np.float32), (len(idx), 2))
                    rows.append(np.concatenate([head, scores[i, idx, label, None], b], 1))
        if rows:
            out = torch.from_numpy(np.concatenate(rows))
        else:  # the fork's "no detection" rows: image id, then -1s
            out = torch.full((n, 3 + self.coords), -1.0)
            out[:, 0] = torch.arange(n, dtype=out.dtype)
        return [out.to(device=loc.device, dtype=loc.dtype)[None, None]]

    def _keep_top_k(self, kept, scores):
        # All kept boxes by score; ties keep label-then-NMS order (a stable sort; the fork's
        # std::sort leaves their order unspecified). Kept scores are never NaN (> threshold).
        order = sorted(kept)
        if not order:
            return {}
        labels = np.concatenate([np.full(len(kept[c]), c) for c in order])
        js = np.concatenate([kept[c] for c in order]).astype(np.int64)
        best = np.argsort(-scores[js, labels], kind="stable")[:self.keep_top_k]
        labels, js = labels[best], js[best]
        return {int(c): js[labels == c] for c in np.unique(labels)}


@register("DetectionEvaluate")
class DetectionEvaluate(Layer):
    """Per-detection true/false positive flags for mAP (the fork's DetectionEvaluateLayer).

    Bottoms: detections (1, 1, D, 7) from DetectionOutput, ground truth (1, 1, G, 8).
    Top: (1, 1, num_pos_classes + D, 5): first one row [-1, label, num_gt, -1, -1] per
    non-background class, then per image and label (ascending) and score (descending) a row
    [image_id, label, score, tp, fp]; a match to a difficult gt when evaluate_difficult_gt is
    false leaves tp = fp = 0; unused rows stay 0.
    Params: detection_evaluate_param num_classes, background_label_id, overlap_threshold,
    evaluate_difficult_gt, name_size_file (pixel-space evaluation; read at the first forward).
    resize_param is not implemented.
    """

    exact_bottoms = 2
    exact_tops = 1

    def allow_backward(self, i):
        return False

    def setup(self, bottom_shapes):
        p = self.param.detection_evaluate_param
        if not p.HasField("num_classes"):
            raise self.fail("detection_evaluate_param.num_classes is required")
        if p.overlap_threshold <= 0:
            raise self.fail("overlap_threshold must be positive")
        self.p = p
        self.sizes = None if p.name_size_file else []
        self.count = 0

    def reshape(self, bottom_shapes):
        det, gt = (tuple(s) for s in bottom_shapes)
        if (len(det), det[:2], det[-1], len(gt), gt[:2], gt[-1]) != (4, (1, 1), 7, 4, (1, 1), 8):
            raise self.fail(f"detections must be (1, 1, D, 7) and ground truth (1, 1, G, 8); "
                            f"got {det} and {gt}")
        pos_classes = self.p.num_classes - (self.p.background_label_id != -1)
        return [(1, 1, pos_classes + det[2], 5)]

    def _image_sizes(self):
        if self.sizes is None:
            path = self.p.name_size_file
            if not os.path.isfile(path):
                raise self.fail(f"cannot open name_size_file '{path}'")
            with open(path) as f:
                words = f.read().split()
            self.sizes = [(int(words[k + 1]), int(words[k + 2])) for k in range(0, len(words) - 2, 3)]
            if self.sizes and self.p.HasField("resize_param"):
                raise NotImplementedError(f"Layer '{self.name}': DetectionEvaluate with "
                                          "resize_param is not implemented")
        return self.sizes

    def forward(self, bottoms):
        det, gt = bottoms
        p = self.p
        sizes = self._image_sizes()
        normalized = not sizes
        dets: dict[int, dict[int, list]] = {}
        for r in det.detach().to("cpu", torch.float64).reshape(-1, 7).tolist():
            if int(r[0]) == -1:
                continue
            if int(r[1]) == p.background_label_id:
                raise self.fail(f"found the background label {int(r[1])} in the detections")
            dets.setdefault(int(r[0]), {}).setdefault(int(r[1]), []).append(r[2:7])
        gts = {i: tuple(t.numpy() for t in g) for i, g in
               B.ground_truth(gt, p.background_label_id, True, True, self).items()}
        out = np.zeros((self.reshape([det.shape, gt.shape])[0][2], 5))
        k = 0
        for c in range(p.num_classes):
            if c != p.background_label_id:
                n_pos = sum(int(np.count_nonzero((g[0] == c) & (p.evaluate_difficult_gt | ~g[2])))
                            for g in gts.values())
                out[k] = [-1.0, c, n_pos, -1, -1]
                k += 1
        for image in sorted(dets):
            for label, found in sorted(dets[image].items()):
                found = np.array(found, dtype=np.float32)
                found = found[np.argsort(-found[:, 0], kind="stable")]    # by score, stable
                flags = np.tile([0.0, 1.0], (len(found), 1))               # false positive
                g = gts.get(image)
                if g is not None and bool((g[0] == label).any()):
                    sel = g[0] == label
                    flags = self._flags(found[:, 1:], g[1][sel], g[2][sel],
                                        None if normalized else sizes[self.count])
                out[k:k + len(found), :2] = [image, label]
                out[k:k + len(found), 2] = found[:, 0]
                out[k:k + len(found), 3:] = flags
                k += len(found)
            if sizes:
                self.count = (self.count + 1) % len(sizes)
        return [torch.from_numpy(out).to(device=det.device, dtype=det.dtype)[None, None]]

    def _flags(self, boxes, gboxes, difficult, hw):
        """[tp, fp] per detection (best first): the best-overlapping gt counts once."""
        if hw is not None:   # clip, then scale to pixels; sizes become (w + 1) * (h + 1)
            scale = np.array([hw[1], hw[0], hw[1], hw[0]], dtype=np.float32)
            boxes, gboxes = np.clip(boxes, 0, 1) * scale, np.clip(gboxes, 0, 1) * scale
        iou = B.iou(boxes, gboxes, normalized=hw is None)
        best = iou.argmax(1)
        hit = iou[np.arange(len(boxes)), best] >= np.float32(self.p.overlap_threshold)
        visited = np.zeros(len(gboxes), dtype=bool)
        flags = np.zeros((len(boxes), 2))
        for i in range(len(boxes)):
            j = best[i]
            if hit[i]:
                if self.p.evaluate_difficult_gt or not difficult[j]:
                    flags[i] = (0.0, 1.0) if visited[j] else (1.0, 0.0)
                    visited[j] = True
            else:
                flags[i] = (0.0, 1.0)
        return flags
