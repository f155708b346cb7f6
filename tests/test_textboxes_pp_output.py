"""Issue 38: TextBoxes++' DetectionOutput with ``use_polygon`` against a loop written from the
fork's CPU code (MhLiao/TextBoxes_plusplus 39d4898de1504c53a2ed3d67966a57b3595836d0,
src/caffe/layers/detection_output_layer.cpp Forward_cpu's use_polygon branch, and
src/caffe/util/bbox_util.cpp: GetLocPredictions (12 numbers a prior), DecodeBBoxPolygon,
GetMaxScoreIndex, ApplyNMSFast (box NMS, JaccardOverlap); its .cu path decodes and NMSes the
same way). The deploy net end to end is in test_fork_detectors.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from brewnet.layers import LayerError
from tests.helpers import make_layer

F32 = np.float32


def _jaccard(a, b):
    """bbox_util.cpp JaccardOverlap (normalized) of two float boxes."""
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return F32(0)
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if not (iw > 0 and ih > 0):
        return F32(0)
    inter = F32(iw * ih)

    def size(x):
        return F32(0) if x[2] < x[0] or x[3] < x[1] else F32((x[2] - x[0]) * (x[3] - x[1]))

    return F32(inter / F32(size(a) + size(b) - inter))


def textboxes_pp_ref(loc, conf, prior, num_classes, share_location, background, conf_threshold,
                     nms_threshold, top_k, keep_top_k, eta=1.0):
    n = loc.shape[0]
    p = prior.shape[2] // 4
    nl = 1 if share_location else num_classes
    loc = loc.reshape(n, p * nl * 12).astype(F32)
    conf = conf.reshape(n, p * num_classes).astype(F32)
    pri = prior.reshape(2, p, 4).astype(F32)
    rows = []
    for i in range(n):
        # GetLocPredictions + DecodeBBoxPolygon (CENTER_SIZE, variance in the priors)
        dec = {}
        for c in range(nl):
            label = -1 if share_location else c
            out = np.zeros((p, 12), F32)
            for d in range(p):
                v = loc[i, d * nl * 12 + c * 12: d * nl * 12 + c * 12 + 12]
                xmin, ymin, xmax, ymax = pri[0, d]
                var = pri[1, d]
                pw, ph = F32(xmax - xmin), F32(ymax - ymin)
                pcx, pcy = F32((xmin + xmax) / F32(2)), F32((ymin + ymax) / F32(2))
                cx = F32(F32(var[0] * v[0]) * pw + pcx)
                cy = F32(F32(var[1] * v[1]) * ph + pcy)
                w = F32(F32(math.exp(F32(var[2] * v[2]))) * pw)
                h = F32(F32(math.exp(F32(var[3] * v[3]))) * ph)
                out[d, :4] = [cx - w / F32(2), cy - h / F32(2), cx + w / F32(2), cy + h / F32(2)]
                corners = [(xmin, ymin), (xmax, ymin), (xmax, ymax), (xmin, ymax)]
                for q, (px, py) in enumerate(corners):
                    out[d, 4 + 2 * q] = F32(F32(var[0] * v[4 + 2 * q]) * pw) + px
                    out[d, 5 + 2 * q] = F32(F32(var[1] * v[5 + 2 * q]) * ph) + py
            dec[label] = out
        scores = conf[i].reshape(p, num_classes)
        indices = {}
        for c in range(num_classes):
            if c == background:
                continue
            s = scores[:, c]
            # GetMaxScoreIndex: score > threshold, stable sort descending, top_k
            cand = [(float(s[j]), j) for j in range(p) if s[j] > F32(conf_threshold)]
            cand.sort(key=lambda e: -e[0])
            if top_k > -1:
                cand = cand[:top_k]
            boxes = dec[-1 if share_location else c]
            keep, thr = [], F32(nms_threshold)
            for _, j in cand:
                ok = all(_jaccard(boxes[j, :4], boxes[k, :4]) <= thr for k in keep)
                if ok:
                    keep.append(j)
                    if eta < 1 and thr > 0.5:
                        thr = F32(thr * F32(eta))
            indices[c] = keep
        if keep_top_k > -1 and sum(len(v) for v in indices.values()) > keep_top_k:
            pairs = [(float(scores[j, c]), c, j) for c in sorted(indices) for j in indices[c]]
            pairs.sort(key=lambda e: -e[0])
            indices = {}
            for _, c, j in pairs[:keep_top_k]:
                indices.setdefault(c, []).append(j)
        for c in sorted(indices):
            boxes = dec[-1 if share_location else c]
            for j in indices[c]:
                rows.append([i, c, scores[j, c], *boxes[j]])
    if not rows:
        out = np.full((n, 15), -1, F32)
        out[:, 0] = np.arange(n)
        return out[None, None]
    return np.array(rows, F32)[None, None]


def _layer(p, num_classes=3, share=True, extra=""):
    text = ('type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "det" '
            f'detection_output_param {{ num_classes: {num_classes} share_location: {str(share).lower()} '
            'background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 40 } code_type: CENTER_SIZE '
            f'keep_top_k: 25 confidence_threshold: 0.05 use_polygon: true {extra} }}')
    nl = 1 if share else num_classes
    return make_layer(text, [(2, p * nl * 12), (2, p * num_classes), (1, 2, p * 4)])


def _priors(rng, p):
    # clustered priors, so NMS has overlaps to remove
    c = rng.uniform(0.3, 0.7, (p, 2)).astype(F32)
    wh = rng.uniform(0.05, 0.3, (p, 2)).astype(F32)
    boxes = np.concatenate([c - wh / 2, c + wh / 2], 1).astype(F32)
    var = np.tile(np.array([0.1, 0.1, 0.2, 0.2], F32), (p, 1))
    return np.stack([boxes.reshape(-1), var.reshape(-1)])[None]


@pytest.mark.parametrize("share", [True, False])
def test_polygon_detection_output_is_the_forks_loop(share):
    rng = np.random.default_rng(12 + share)
    p, nc = 30, 3
    layer, tops = _layer(p, nc, share)
    assert tops == [(1, 1, 1, 15)]
    nl = 1 if share else nc
    loc = rng.standard_normal((2, p * nl * 12)).astype(F32)
    logits = rng.standard_normal((2, p, nc)).astype(F32) * 2
    conf = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(F32).reshape(2, -1)
    prior = _priors(rng, p)
    (det,) = layer.forward([torch.from_numpy(loc), torch.from_numpy(conf), torch.from_numpy(prior)])
    ref = textboxes_pp_ref(loc, conf, prior, nc, share, 0, 0.05, 0.45, 40, 25)
    assert det.shape == ref.shape and ref.shape[2] > 5
    np.testing.assert_array_equal(det.numpy()[..., :3], ref[..., :3])
    np.testing.assert_allclose(det.numpy(), ref, rtol=1e-6, atol=1e-7)


def test_polygon_no_detection_rows_are_15_wide():
    rng = np.random.default_rng(1)
    p = 4
    layer, _ = _layer(p, 2)
    conf = np.tile(np.array([1.0, 0.0], F32), (2, p))
    (det,) = layer.forward([torch.zeros(2, p * 12), torch.from_numpy(conf), torch.from_numpy(_priors(rng, p))])
    want = np.full((1, 1, 2, 15), -1, F32)
    want[0, 0, :, 0] = [0, 1]
    np.testing.assert_array_equal(det.numpy(), want)


def test_polygon_quadrilateral_by_hand():
    # one prior [0.2, 0.3, 0.6, 0.5] (w 0.4, h 0.2), variances 0.1: corner offsets 1 and -2 move
    # each x by 0.04 and each y by -0.04
    prior = np.array([[0.2, 0.3, 0.6, 0.5], [0.1, 0.1, 0.2, 0.2]], F32).reshape(1, 2, 4)
    loc = np.zeros((1, 12), F32)
    loc[0, 4::2], loc[0, 5::2] = 1, -2
    layer, _ = make_layer('type: "DetectionOutput" bottom: "l" bottom: "c" bottom: "p" top: "d" '
                          'detection_output_param { num_classes: 2 code_type: CENTER_SIZE '
                          'nms_param { nms_threshold: 0.5 } use_polygon: true }',
                          [(1, 12), (1, 2), (1, 2, 4)])
    (det,) = layer.forward([torch.from_numpy(loc), torch.tensor([[0.1, 0.9]]), torch.from_numpy(prior)])
    want = [0, 1, 0.9, 0.2, 0.3, 0.6, 0.5, 0.24, 0.26, 0.64, 0.26, 0.64, 0.46, 0.24, 0.46]
    np.testing.assert_allclose(det.numpy()[0, 0, 0], want, rtol=1e-6, atol=1e-7)


def test_polygon_refuses_the_codings_the_fork_does_not_decode():
    with pytest.raises(LayerError, match="CENTER_SIZE"):
        make_layer('type: "DetectionOutput" bottom: "l" bottom: "c" bottom: "p" top: "d" '
                   'detection_output_param { num_classes: 2 code_type: CORNER use_polygon: true }',
                   [(1, 12), (1, 2), (1, 2, 4)])
    with pytest.raises(LayerError, match=r"\*12\)"):
        make_layer('type: "DetectionOutput" bottom: "l" bottom: "c" bottom: "p" top: "d" '
                   'detection_output_param { num_classes: 2 code_type: CENTER_SIZE use_polygon: true }',
                   [(1, 4), (1, 2), (1, 2, 4)])
