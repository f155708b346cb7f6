"""SSD's detection test (weiliu89/caffe ``Solver::TestDetection`` under ``eval_type:
"detection"``) and its mAP (``ComputeAP`` in ``util/bbox_util.cpp``), from DetectionEvaluate's
rows; ``brewnet test`` scores a detection net with the same maths.

Each test batch's DetectionEvaluate top holds rows [item, label, value, tp, fp]: item -1 rows add
``value`` ground-truth boxes to ``label``'s count; the others are one detection of score ``value``,
a true or false positive (tp = fp = 0: it matched a difficult box and is skipped). Per label, the
detections sorted by score (stable) give precision and recall, AP is the ``ap_version`` (11point,
MaxIntegral or Integral) and mAP its mean over the labels that have ground truth, in float32 as
the fork's. ``Solver.test`` keeps one DetectionMAP per test net output and logs, as the fork,
``classN: AP`` per label (``show_per_class_result``), then ``    Test net output #i: name = mAP``.
The AP versions, and where this differs from the fork: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging

import numpy as np

from .nets import SolverError

log = logging.getLogger("brewnet")
f32 = np.float32
AP_VERSIONS = ("11point", "MaxIntegral", "Integral")
EVAL_TYPES = ("classification", "detection")


def average_precision(scores, tp, num_pos: int, version: str = "Integral") -> float:
    """ComputeAP for one label: ``scores`` and 0/1 ``tp`` of its detections (fp = 1 - tp)."""
    if version not in AP_VERSIONS:
        raise ValueError(f"unknown ap_version '{version}'; known: {', '.join(AP_VERSIONS)}")
    scores, tp = np.asarray(scores, f32), np.asarray(tp, np.int64)
    if len(tp) == 0 or num_pos == 0:
        return 0.0
    order = np.argsort(-scores, kind="stable")
    tps = np.cumsum(tp[order])
    fps = np.cumsum(1 - tp[order])
    if tps[-1] > num_pos:
        raise ValueError(f"{tps[-1]} true positives for {num_pos} ground-truth boxes")
    prec = (tps.astype(f32) / (tps + fps).astype(f32)).astype(f32)
    rec = (tps.astype(f32) / f32(num_pos)).astype(f32)
    ap, n, eps = f32(0), len(tp), f32(1e-6)
    if version == "11point":
        best = [f32(0)] * 11
        start = n - 1
        for j in range(10, -1, -1):
            for i in range(start, -1, -1):
                if float(rec[i]) < j / 10.0:     # the fork compares in double
                    start = i
                    if j > 0:
                        best[j - 1] = best[j]
                    break
                best[j] = max(best[j], prec[i])
        for j in range(10, -1, -1):
            ap = f32(ap + best[j] / f32(11))
    elif version == "MaxIntegral":
        cur_rec, cur_prec = rec[-1], prec[-1]
        for i in range(n - 2, -1, -1):
            cur_prec = max(prec[i], cur_prec)
            if abs(cur_rec - rec[i]) > eps:
                ap = f32(ap + cur_prec * abs(cur_rec - rec[i]))
            cur_rec = rec[i]
        ap = f32(ap + cur_rec * cur_prec)
    else:
        prev = f32(0)
        for i in range(n):
            if abs(rec[i] - prev) > eps:
                ap = f32(ap + prec[i] * abs(rec[i] - prev))
            prev = rec[i]
    return float(ap)


class DetectionMAP:
    """Accumulates DetectionEvaluate tops over test batches (one per output blob)."""

    def __init__(self):
        self.num_pos: dict[int, int] = {}
        self.dets: dict[int, list[tuple[float, int]]] = {}

    def add(self, rows) -> None:
        rows = np.asarray(rows, np.float32).reshape(-1, 5)
        if rows.shape[-1] != 5:
            raise ValueError(f"a DetectionEvaluate top has rows of 5, got shape {rows.shape}")
        for item, label, value, tp, fp in rows.tolist():
            label = int(label)
            if int(item) == -1:
                self.num_pos[label] = self.num_pos.get(label, 0) + int(value)
            elif int(tp) or int(fp):
                self.dets.setdefault(label, []).append((value, int(tp)))

    def aps(self, version: str = "Integral") -> dict[int, float | None]:
        """AP per label with ground truth (None: no detections for it, which the fork skips
        with a warning but still counts in the mean's denominator)."""
        out: dict[int, float | None] = {}
        for label, n in sorted(self.num_pos.items()):
            found = self.dets.get(label)
            if found is None:
                out[label] = None
                continue
            scores, tp = zip(*found)
            out[label] = average_precision(scores, tp, n, version)
        return out

    def mean_ap(self, version: str = "Integral") -> float:
        aps = self.aps(version)
        if not aps:
            return 0.0
        total = f32(0)
        for v in aps.values():
            total = f32(total + f32(v or 0))
        return float(total / f32(len(aps)))


def check(param, test_nets) -> None:
    """The SolverParameter's eval_type and ap_version, and, for detection, that every test net
    output is a DetectionEvaluate top (rows of 5: the fork CHECKs each output's width)."""
    if param.eval_type not in EVAL_TYPES:
        raise SolverError(f"Unknown evaluation type: eval_type '{param.eval_type}' (known: "
                          f"{', '.join(EVAL_TYPES)})")
    if param.eval_type != "detection":
        return
    if param.ap_version not in AP_VERSIONS:
        raise SolverError(f"Unknown ap_version '{param.ap_version}' (known: {', '.join(AP_VERSIONS)})")
    for k, net in enumerate(test_nets):
        made = {t: layer.type for layer, tops in zip(net.layer_list, net.top_lists) for t in tops}
        for name in net.outputs:
            if made.get(name) != "DetectionEvaluate":
                raise SolverError(
                    f"eval_type 'detection' scores every test net output as DetectionEvaluate rows "
                    f"[image_id, label, score, tp, fp]; test net #{k} output '{name}' comes from "
                    f"a {made.get(name, 'net input')} layer (shape {net.shapes[name]})")


def report(maps: dict, version: str, per_class: bool) -> dict:
    """Log the fork's lines for each output's accumulated DetectionMAP (in ``maps``, by output
    name, in output order); returns {output name: mAP}."""
    out = {}
    for i, (name, m) in enumerate(maps.items()):
        log_aps(m, version, per_class)
        out[name] = m.mean_ap(version)
        log.info("    Test net output #%d: %s = %g", i, name, out[name])
    return out


def log_aps(m: DetectionMAP, version: str, per_class: bool) -> None:
    """The fork's per-label lines: a warning for a label without detections, and with
    ``per_class`` each label's AP (``classN: AP``)."""
    for label, ap in m.aps(version).items():
        if ap is None:
            log.warning("Missing true_pos for label: %d", label)
        elif per_class:
            log.info("class%d: %g", label, ap)
