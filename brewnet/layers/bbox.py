"""Bounding-box math of the SSD fork (weiliu89/caffe ``src/caffe/util/bbox_util.cpp``), vectorised.

Boxes are (..., 4) tensors [xmin, ymin, xmax, ymax] in normalised image coordinates. The fork
keeps boxes in float protobuf fields, so callers pass float32; the expressions keep the fork's
operation order so the float32 results agree with it.
"""
from __future__ import annotations

import numpy as np
import torch

CORNER, CENTER_SIZE, CORNER_SIZE = 1, 2, 3     # PriorBoxParameter.CodeType
BIPARTITE, PER_PREDICTION = 0, 1               # MultiBoxLossParameter.MatchType
NMS_BLOCK = 32          # nms_fast: overlap rows computed at a time


class BoxError(ValueError):
    """Boxes the fork refuses (its CHECKs); layers re-raise it naming themselves."""


def size(b: np.ndarray, normalized: bool = True) -> np.ndarray:
    """BBoxSize of float32 boxes: w * h (``normalized``) or (w + 1) * (h + 1) (pixel boxes);
    0 if inverted."""
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    one = np.float32(1)
    area = w * h if normalized else (w + one) * (h + one)
    return np.where((w < 0) | (h < 0), np.float32(0), area).astype(np.float32)


def iou(a: np.ndarray, b: np.ndarray, normalized: bool = True) -> np.ndarray:
    """JaccardOverlap of every box of a (M, 4) with every box of b (K, 4) -> (M, K), float32
    numpy (matching and NMS are a few small arrays per image: numpy's calls cost a fraction of
    torch's, and never wait for an OpenMP team)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _iou(a, b, normalized)


def _iou(a: np.ndarray, b: np.ndarray, normalized: bool, sa=None, sb=None) -> np.ndarray:
    """``iou`` (its caller sets numpy's errstate; ``sa``, ``sb``: the boxes' sizes, if known).
    For normalised boxes the fork's "apart" test is implied: apart boxes overlap by a negative
    width or height (subtraction keeps the order)."""
    sa = size(a, normalized) if sa is None else sa
    sb = size(b, normalized) if sb is None else sb
    one = np.float32(0 if normalized else 1)
    iw = np.minimum(a[:, None, 2], b[None, :, 2])
    iw -= np.maximum(a[:, None, 0], b[None, :, 0])
    iw += one
    ih = np.minimum(a[:, None, 3], b[None, :, 3])
    ih -= np.maximum(a[:, None, 1], b[None, :, 1])
    ih += one
    inter = iw * ih
    den = sa[:, None] + sb[None, :]
    den -= inter
    inter /= den
    none = ~((iw > 0) & (ih > 0))
    if not normalized:     # (pixel boxes: the + 1 can make apart boxes overlap by up to 1)
        none |= ((b[None, :, 0] > a[:, None, 2]) | (b[None, :, 2] < a[:, None, 0])
                 | (b[None, :, 1] > a[:, None, 3]) | (b[None, :, 3] < a[:, None, 1]))
    inter[none] = 0
    return inter


def jaccard(a: torch.Tensor, b: torch.Tensor, normalized: bool = True) -> torch.Tensor:
    """``iou`` of CPU float32 tensors a (M, 4) and b (K, 4) -> (M, K) tensor."""
    return torch.from_numpy(iou(a.numpy(), b.numpy(), normalized))


def _prior_wh(prior):
    pw, ph = prior[..., 2] - prior[..., 0], prior[..., 3] - prior[..., 1]
    if bool((pw <= 0).any() or (ph <= 0).any()):
        raise BoxError("a prior box has no positive width/height (the fork's CHECK_GT)")
    return pw, ph


def decode(prior, var, loc, code_type: int, variance_in_target: bool) -> torch.Tensor:
    """DecodeBBox: prior (P, 4), var (P, 4), loc (..., P, 4) offsets -> boxes (..., P, 4)."""
    l0, l1, l2, l3 = loc.unbind(-1)
    if not variance_in_target:
        l0, l1, l2, l3 = var[:, 0] * l0, var[:, 1] * l1, var[:, 2] * l2, var[:, 3] * l3
    if code_type == CORNER:
        return torch.stack([prior[:, 0] + l0, prior[:, 1] + l1, prior[:, 2] + l2, prior[:, 3] + l3], -1)
    pw, ph = _prior_wh(prior)
    if code_type == CORNER_SIZE:
        return torch.stack([prior[:, 0] + l0 * pw, prior[:, 1] + l1 * ph,
                            prior[:, 2] + l2 * pw, prior[:, 3] + l3 * ph], -1)
    if code_type != CENTER_SIZE:
        raise ValueError(f"unknown code_type {code_type}")
    pcx, pcy = (prior[:, 0] + prior[:, 2]) / 2, (prior[:, 1] + prior[:, 3]) / 2
    cx, cy = l0 * pw + pcx, l1 * ph + pcy
    w, h = torch.exp(l2) * pw, torch.exp(l3) * ph
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def decode_quad(prior, var, loc) -> torch.Tensor:
    """TextBoxes++' DecodeBBoxPolygon (MhLiao/TextBoxes_plusplus bbox_util.cpp/.cu; CENTER_SIZE
    with the variances in the priors, the only coding it decodes quadrilaterals in): prior
    (P, 4), var (P, 4), loc (..., P, 8) -> (..., P, 8) [x1, y1, ..., x4, y4], each corner the
    prior's (top-left, top-right, bottom-right, bottom-left) moved by var[0] * dx * prior width
    and var[1] * dy * prior height."""
    pw, ph = _prior_wh(prior)
    cx = torch.stack([prior[:, 0], prior[:, 2], prior[:, 2], prior[:, 0]], -1)
    cy = torch.stack([prior[:, 1], prior[:, 1], prior[:, 3], prior[:, 3]], -1)
    x = var[:, 0, None] * loc[..., 0::2] * pw[:, None] + cx
    y = var[:, 1, None] * loc[..., 1::2] * ph[:, None] + cy
    return torch.stack([x, y], -1).flatten(-2)


def encode(prior, var, gt, code_type: int, variance_in_target: bool) -> torch.Tensor:
    """EncodeBBox: the offsets (M, 4) that decode ``prior`` (M, 4) into ``gt`` (M, 4)."""
    if code_type == CORNER:
        d = gt - prior
        return d if variance_in_target else d / var
    pw, ph = _prior_wh(prior)
    if code_type == CORNER_SIZE:
        d = (gt - prior) / torch.stack([pw, ph, pw, ph], -1)
        return d if variance_in_target else d / var
    if code_type != CENTER_SIZE:
        raise ValueError(f"unknown code_type {code_type}")
    gw, gh = gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]
    if bool((gw <= 0).any() or (gh <= 0).any()):
        raise BoxError("a ground-truth box has no positive width/height (the fork's CHECK_GT)")
    pcx, pcy = (prior[:, 0] + prior[:, 2]) / 2, (prior[:, 1] + prior[:, 3]) / 2
    gcx, gcy = (gt[:, 0] + gt[:, 2]) / 2, (gt[:, 1] + gt[:, 3]) / 2
    d = torch.stack([(gcx - pcx) / pw, (gcy - pcy) / ph, torch.log(gw / pw), torch.log(gh / ph)], -1)
    return d if variance_in_target else d / var


def nms_fast(boxes, scores, score_threshold: float, nms_threshold: float, eta: float = 1.0,
             top_k: int = -1) -> np.ndarray:
    """ApplyNMSFast: float32 boxes (K, 4), scores (K,) (numpy, or CPU tensors) -> kept indices,
    best first. Candidates score above ``score_threshold``, at most ``top_k`` of them, by score
    (ties in index order); a candidate survives if its overlap with every kept box is <= the
    threshold, which shrinks by ``eta`` after each keep while above 0.5."""
    boxes, scores = (np.asarray(t.numpy() if isinstance(t, torch.Tensor) else t) for t in (boxes, scores))
    idx = np.flatnonzero(scores > np.float32(score_threshold))
    neg = -scores[idx]
    if -1 < top_k < len(idx):   # only the top_k best sorted: all tied with the last one kept
        idx = idx[neg <= np.partition(neg, top_k - 1)[top_k - 1]]
        neg = -scores[idx]
    idx = idx[np.argsort(neg, kind="stable")]
    if top_k > -1:
        idx = idx[:top_k]
    if len(idx) == 0:
        return idx
    thr = np.float32(nms_threshold)
    keep: list[int] = []
    if eta >= 1:
        # the overlaps of the candidates still standing with those after them, NMS_BLOCK rows
        # at a time: the whole matrix's values (elementwise), a fraction of its work
        cand, n = boxes[idx], len(idx)
        areas = size(cand)
        gone = np.zeros(n, dtype=bool)
        i = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            while i < n:
                rows = np.flatnonzero(~gone[i:])[:NMS_BLOCK] + i
                if not len(rows):
                    break
                first = rows[0]
                over = _iou(cand[rows], cand[first:], True, areas[rows], areas[first:]) > thr
                for r, row in zip(rows.tolist(), over):
                    if not gone[r]:
                        keep.append(r)
                        gone[first:] |= row
                i = rows[-1] + 1
    else:
        overlap = iou(boxes[idx], boxes[idx])
        for i in range(len(idx)):
            if not keep or bool((overlap[i, keep] <= thr).all()):
                keep.append(i)
                if thr > 0.5:
                    thr = np.float32(thr * np.float32(eta))
    return idx[keep]


def match(gt: np.ndarray, gt_ids: np.ndarray, preds: np.ndarray, match_type: int,
          overlap_threshold: float, ignore_cross_boundary: bool):
    """MatchBBox on float32 numpy boxes: gt (G, 4) with their indices ``gt_ids`` (G,), preds
    (P, 4) -> (match (P,) int64: gt index, -1 unmatched, -2 ignored cross-boundary; overlap (P,)
    float32: the best overlap with any gt, or the matched one's).

    Bipartite first: repeatedly the globally best (prediction, gt) pair among unmatched
    predictions and unused gts, ties to the lowest prediction then gt index; then, for
    PER_PREDICTION, each still unmatched prediction takes its best gt with overlap >= threshold.
    Overlaps <= 1e-6 count as none."""
    P, G = preds.shape[0], gt.shape[0]
    matches = np.full(P, -1, np.int64)
    if G == 0:
        return matches, np.zeros(P, np.float32)
    ov = iou(preds, gt)
    if ignore_cross_boundary:
        cross = ((preds < 0) | (preds > 1)).any(1)
        matches[cross] = -2
        ov[cross] = 0
    stored = ov > np.float32(1e-6)
    best = np.where(stored, ov, np.float32(0)).max(1)
    pool = np.ones(G, bool)
    for _ in range(G):
        cand = stored & (matches == -1)[:, None] & pool[None, :]
        if not cand.any():
            break
        i, j = divmod(int(np.argmax(np.where(cand, ov, np.float32(-1)))), G)
        matches[i], best[i], pool[j] = gt_ids[j], ov[i, j], False
    if match_type == PER_PREDICTION:
        cand = stored & (ov >= np.float32(overlap_threshold)) & (matches == -1)[:, None]
        has = cand.any(1)
        vals = np.where(cand, ov, np.float32(-1))
        matches = np.where(has, gt_ids[vals.argmax(1)], matches)
        best = np.where(has, vals.max(1), best)
    elif match_type != BIPARTITE:
        raise ValueError(f"unknown match_type {match_type}")
    return matches, best.astype(np.float32)


def legacy(shape, i: int) -> int:
    """Caffe's ``Blob::LegacyShape``: num/channels/height/width, 1 past the last axis."""
    return int(shape[i]) if i < len(shape) else 1


def priors_from_blob(prior: torch.Tensor, num_priors: int):
    """The fork's GetPriorBBoxes: boxes then variances from the start of the prior blob."""
    flat = prior.detach().reshape(-1)[:2 * num_priors * 4].to("cpu", torch.float32)
    return flat[:num_priors * 4].view(-1, 4), flat[num_priors * 4:].view(-1, 4)


def ground_truth(label: torch.Tensor, background: int, use_difficult: bool, stop_at_pad: bool, who):
    """The fork's GetGroundTruth over rows [item_id, label, instance, xmin, ymin, xmax, ymax,
    difficult]: {item_id: (labels (G,) long, boxes (G, 4) float32, difficult (G,) bool)}.
    Rows with item_id -1 are padding: skipped, or the end of the list if ``stop_at_pad``."""
    rows = label.detach().to("cpu", torch.float64).reshape(-1, 8)
    items: dict[int, list] = {}
    for r in rows.tolist():
        item = int(r[0])
        if item == -1:
            if stop_at_pad:
                break
            continue
        lab, difficult = int(r[1]), bool(r[7])
        if lab == background:
            raise who.fail(f"found the background label {lab} in the ground truth")
        if difficult and not use_difficult:
            continue
        items.setdefault(item, []).append((lab, r[3:7], difficult))
    return {i: (torch.tensor([g[0] for g in gs], dtype=torch.long),
                torch.tensor([g[1] for g in gs], dtype=torch.float32),
                torch.tensor([g[2] for g in gs], dtype=torch.bool)) for i, gs in items.items()}
