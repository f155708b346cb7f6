"""YOLO layers of the Caffe YOLO ports: Reorg (Darknet's passthrough reorg, as
eric612/MobileNet-YOLO and OpenCV run it), Region (Darknet's YOLOv2 region outputs) and
Yolov3DetectionOutput (MobileNet-YOLO's YOLOv3 detections)."""
from __future__ import annotations

import numpy as np
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


def _nms(boxes: np.ndarray, threshold: float) -> np.ndarray:
    """Greedy NMS over centre-size float32 ``boxes`` (M, 4) sorted best first: the indices
    kept, ascending; the port's float32 IoU and survivors. Each kept box is compared with the
    boxes after it not yet suppressed (the port: all later ones, the same survivors), and above
    a zero threshold only where the boxes overlap in x (elsewhere the IoU is 0 or NaN: kept):
    tens of thousands of candidates (a low confidence_threshold) cost a fraction of a pass each."""
    x, y, w, h = boxes.T
    # edges and areas (rows) of the boxes from the current one on, packed in score order; the
    # suppressed are marked dead and packed out once they are a quarter of the rest
    e = np.stack([x - w / 2, x + w / 2, y - h / 2, y + h / 2, w * h])
    idx, dead = np.arange(len(boxes)), np.zeros(len(boxes), bool)
    thr, keep, p, n_dead = np.float32(threshold), [], 0, 0
    while True:
        p += int(np.argmin(dead[p:])) if p < idx.size else 0
        if p >= idx.size or dead[p]:
            return np.asarray(keep, np.int64)
        keep.append(idx[p])
        (l0, r0, t0, b0, a0), rest = e[:, p], e[:, p + 1:]
        iw = np.minimum(r0, rest[1]) - np.maximum(l0, rest[0])
        near = np.flatnonzero(iw > 0) if thr > 0 else np.arange(iw.size)
        ih = np.minimum(b0, rest[3, near]) - np.maximum(t0, rest[2, near])
        iwn = iw[near]
        inter = np.where((iwn < 0) | (ih < 0), np.float32(0), iwn * ih)
        gone = near[inter / (a0 + rest[4, near] - inter) >= thr] + p + 1
        gone = gone[~dead[gone]]
        dead[gone], n_dead, p = True, n_dead + gone.size, p + 1
        if n_dead > (idx.size - p) // 4:
            live = ~dead[p:]
            e, idx = e[:, p:][:, live], idx[p:][live]
            dead, p, n_dead = np.zeros(idx.size, bool), 0, 0


def yolo_output(boxes, classes, scores, nms_threshold: float) -> torch.Tensor:
    """The MobileNet-YOLO detection outputs' top from candidates in generation order (centre-size
    boxes (M, 4), 0-based classes): sorted by score (ties keep that order), class-agnostic NMS
    (IoU >= nms_threshold goes), rows [0, class + 1, score, xmin, ymin, xmax, ymax]; none: [0, -1 ...]."""
    if not len(boxes):
        return torch.tensor([[[[0] + [-1] * 6]]], dtype=torch.float32)
    scores = np.asarray(scores, np.float32)
    order = np.argsort(-scores, kind="stable")
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)[order]
    k = _nms(boxes, nms_threshold)
    b, classes, scores = boxes[k], np.asarray(classes)[order][k], scores[order][k]
    out = np.stack([np.zeros(len(b)), classes + 1, scores, b[:, 0] - b[:, 2] / 2,
                    b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2], 1)
    return torch.from_numpy(out.astype(np.float32)).reshape(1, 1, -1, 7)


class _YoloOutput(Layer):
    """Shared by the two detection outputs: bottoms (1, num_box (5 + K), H, W), one (1, 1, D, 7)
    top whose D is known after forward, no gradient. Subclasses set ``self.p`` in setup."""

    min_bottoms = 1
    exact_tops = 1
    in_place_ok = False
    square = False   # YOLOv2's output reads the width as the height too

    def allow_backward(self, i):
        return False

    def reshape(self, bottom_shapes):
        c = self.p.num_box * (5 + self.p.num_classes)
        for s in bottom_shapes:
            if len(s) != 4 or s[0] != 1 or s[1] != c or (self.square and s[2] != s[3]):
                raise self.fail(f"bottom {tuple(s)} must be (1, num_box * (5 + num_classes) = {c}, "
                                f"{'S, S' if self.square else 'H, W'})")
        return [(1, 1, 1, 7)]


@register("YoloDetectionOutput")
class YoloDetectionOutput(_YoloOutput):
    """YOLOv2 detections (eric612/MobileNet-YOLO's YoloDetectionOutput).

    Bottoms: one or two square maps (1, num_box (5 + K), S, S). Top: (1, 1, D, 7) as
    Yolov3DetectionOutput's. For anchor n at cell (row j, column i): x = (i + sigmoid(tx)) / S,
    y = (j + sigmoid(ty)) / S, w = exp(tw) biases[2n] / S, h = exp(th) biases[2n + 1] / S; the
    best class of the softmax (the first of equal ones) scores sigmoid(to) * its probability,
    kept when >= confidence_threshold; then sorted and class-agnostic NMS.
    Params: yolo_detection_output_param num_classes, num_box, confidence_threshold,
    nms_threshold, biases (side, coords and label_map_file change nothing). No gradient.
    """

    max_bottoms = 2
    square = True

    def setup(self, bottom_shapes):
        p = self.param.yolo_detection_output_param
        if len(p.biases) < 2 * p.num_box:
            raise self.fail(f"biases needs 2 * num_box = {2 * p.num_box} values, got {len(p.biases)}")
        self.p = p

    def forward(self, bottoms):
        p = self.p
        boxes, classes, scores = [], [], []
        for x in bottoms:
            side = x.shape[-1]
            v = x.detach().to("cpu", torch.float32).reshape(p.num_box, 5 + p.num_classes, side * side)
            v = v.permute(2, 0, 1).numpy()                            # (cell, anchor, 5 + K)
            sig = 1 / (1 + np.exp(-v[..., :5]))
            prob = torch.softmax(torch.from_numpy(v[..., 5:]), -1).numpy()
            best = prob.argmax(-1)                                      # the first of equal maxima
            conf = sig[..., 4] * prob.max(-1)
            j, i = np.divmod(np.arange(side * side), side)
            bias = np.asarray(p.biases, np.float32)[: 2 * p.num_box].reshape(-1, 2)
            box = np.stack([(i[:, None] + sig[..., 0]) / side, (j[:, None] + sig[..., 1]) / side,
                            np.exp(v[..., 2]) * bias[:, 0] / side, np.exp(v[..., 3]) * bias[:, 1] / side],
                           -1).astype(np.float32)
            keep = conf >= np.float32(p.confidence_threshold)        # (cell, anchor), generation order
            boxes += list(box[keep])
            classes += list(best[keep])
            scores += list(conf[keep])
        return [yolo_output(boxes, classes, scores, p.nms_threshold)]


@register("Yolov3DetectionOutput")
class Yolov3DetectionOutput(_YoloOutput):
    """YOLOv3 detections (eric612/MobileNet-YOLO's Yolov3DetectionOutput).

    Bottoms: one per scale, (1, num_box (5 + K), H_t, W_t). Top: (1, 1, D, 7) rows [0, label
    (class + 1), score, xmin, ymin, xmax, ymax] in [0, 1] units of the input (not clipped); no
    detection: one row [0, -1, ..., -1]. For anchor n of scale t (its anchor mask[n + t *
    num_box]), cell (i, j): x = (j + sigmoid(tx)) / W_t, y = (i + sigmoid(ty)) / H_t,
    w = exp(tw) bias_w / (W_t anchors_scale[t]), h likewise; each class whose
    sigmoid(class) * sigmoid(objectness) > confidence_threshold is a detection; all sorted by
    score (ties in generation order), then class-agnostic NMS (IoU >= nms_threshold goes).
    Params: yolov3_detection_output_param num_classes, num_box, confidence_threshold,
    nms_threshold, biases, anchors_scale, mask_group_num (= bottoms), mask. One image per batch
    (the port writes image 0 for every detection). No gradient.
    """

    def setup(self, bottom_shapes):
        p = self.param.yolov3_detection_output_param
        if p.gaussian_box:
            raise NotImplementedError(f"Layer '{self.name}': Yolov3DetectionOutput gaussian_box "
                                      "(Gaussian YOLOv3) is not supported")
        if len(bottom_shapes) != p.mask_group_num:
            raise self.fail(f"mask_group_num {p.mask_group_num} must equal the bottoms, {len(bottom_shapes)}")
        if len(p.anchors_scale) < len(bottom_shapes) or len(p.mask) < p.num_box * len(bottom_shapes):
            raise self.fail("needs one anchors_scale per bottom and num_box mask entries per bottom")
        if 2 * (max(p.mask) + 1) > len(p.biases):
            raise self.fail(f"mask {list(p.mask)} names anchors beyond the {len(p.biases) // 2} in biases")
        self.p = p

    def forward(self, bottoms):
        p = self.p
        cand = []   # per scale and anchor: (scale, cell, anchor, class, box (x, y, w, h), score)
        for t, x in enumerate(bottoms):
            _, _, h, w = x.shape
            v = x.detach().to("cpu", torch.float32).reshape(p.num_box, 5 + p.num_classes, h * w).numpy()
            sig = 1 / (1 + np.exp(-v))
            ii, jj = np.divmod(np.arange(h * w), w)
            for n in range(p.num_box):
                m = p.mask[n + t * p.num_box]
                score = sig[n, 5:] * sig[n, 4]                          # (K, H W)
                box = np.stack([(jj + sig[n, 0]) / np.float32(w), (ii + sig[n, 1]) / np.float32(h),
                                np.exp(v[n, 2]) * np.float32(p.biases[2 * m]) / np.float32(w * p.anchors_scale[t]),
                                np.exp(v[n, 3]) * np.float32(p.biases[2 * m + 1]) / np.float32(h * p.anchors_scale[t])],
                               1).astype(np.float32)
                s, c = np.nonzero(score.T > np.float32(p.confidence_threshold))
                cand.append((np.full(len(s), t), s, np.full(len(s), n), c, box[s], score[c, s]))
        t, s, n, c, box, score = (np.concatenate(a) for a in zip(*cand))
        order = np.lexsort((c, n, s, t))   # the port's generation order: scale, cell, anchor, class
        return [yolo_output(box[order], c[order], score[order], p.nms_threshold)]
