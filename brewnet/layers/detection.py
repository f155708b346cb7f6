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
        p = B.legacy(prior, 2) // 4
        if (loc[0] != conf[0] or B.legacy(loc, 1) != p * self.loc_classes * 4
                or B.legacy(conf, 1) != p * self.num_classes):
            raise self.fail(f"loc {loc} and conf {conf} must be (N, {p}*{self.loc_classes}*4) and "
                            f"(N, {p}*{self.num_classes}) for {p} priors {prior}")
        return [(1, 1, 1, 7)]

    def forward(self, bottoms):
        loc, conf, prior = bottoms
        n, c = loc.shape[0], self.num_classes
        p = B.legacy(prior.shape, 2) // 4
        pbox, pvar = B.priors_from_blob(prior, p)
        locs = loc.detach().to("cpu", torch.float32).reshape(n, p, self.loc_classes, 4).transpose(1, 2)
        try:
            boxes = B.decode(pbox, pvar, locs, self.code_type, self.var_in_target)   # (n, L, p, 4)
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
                kept[label] = B.nms_fast(b, scores[i, :, label], self.conf_threshold,
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
        return {label: np.array(js, dtype=np.int64) for label, js in new.items()}


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
