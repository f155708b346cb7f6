"""SSD's training loss from the weiliu89/caffe fork: MultiBoxLoss (prior matching, hard negative
mining, SmoothL1 + softmax loss). Its evaluation layer, DetectionEvaluate, is in ``detection.py``.

Matching and mining decisions use float32 boxes as the fork's NormalizedBBox; the loss terms that
carry gradients are computed in the bottoms' dtype and autograd gives the fork's gradients (only
matched and mined rows of loc/conf receive a diff).
"""
from __future__ import annotations

import numpy as np
import torch

from . import bbox as B
from .base import Layer, count
from .loss import NONE, VALID, normalization_mode, normalizer, softmax_loss
from .registry import register


def smooth_l1(d):
    """The fork's SmoothL1Loss elementwise: 0.5 d^2 if |d| < 1 else |d| - 0.5 (gradient sign(d)
    at |d| = 1, as the fork)."""
    a = d.abs()
    return torch.where(a < 1, 0.5 * d * d, a - 0.5)


@register("MultiBoxLoss")
class MultiBoxLoss(Layer):
    """SSD training loss: match priors to ground truth, mine hard negatives, SmoothL1 (or L2)
    localisation loss plus softmax confidence loss.

    Bottoms: loc (N, P*L*4), conf (N, P*num_classes) scores, priors (1, 2, P*4), labels
    (1, 1, G, 8) rows [item_id, label, instance_id, xmin, ymin, xmax, ymax, difficult].
    Top: the loss (0-D) = loc_weight * loc_loss / norm + conf_loss / norm, each term only if
    propagate_down of its bottom is true (default true, true, false, false), norm from
    loss_param (default VALID = number of matched priors).
    Params: multibox_loss_param loc_loss_type (SMOOTH_L1, L2), conf_loss_type (SOFTMAX),
    loc_weight, num_classes, share_location, match_type, overlap_threshold,
    use_prior_for_matching, background_label_id, use_difficult_gt, neg_pos_ratio, neg_overlap,
    code_type, encode_variance_in_target, map_object_to_agnostic, ignore_cross_boundary_bbox,
    bp_inside, mining_type (NONE, MAX_NEGATIVE). Not implemented (rejected at setup):
    LOGISTIC conf loss, HARD_EXAMPLE mining, NMS during mining.
    """

    exact_bottoms = 4
    exact_tops = 1
    is_loss = True

    def allow_backward(self, i):
        return i < 2

    def setup(self, bottom_shapes):
        p = self.param.multibox_loss_param
        if not p.HasField("num_classes") or p.num_classes < 1:
            raise self.fail("multibox_loss_param.num_classes (>= 1) is required")
        self.p, self.num_classes = p, p.num_classes
        self.loc_classes = 1 if p.share_location else p.num_classes
        self.mining = p.mining_type
        if p.HasField("do_neg_mining") and p.do_neg_mining != (self.mining != 0):
            raise self.fail("do_neg_mining (deprecated) contradicts mining_type")
        if self.mining == 2:
            raise NotImplementedError(f"Layer '{self.name}': MultiBoxLoss mining_type HARD_EXAMPLE "
                                      "is not implemented")
        if p.HasField("nms_param") and p.nms_param.nms_threshold > 0 and self.mining:
            raise NotImplementedError(f"Layer '{self.name}': MultiBoxLoss NMS during mining "
                                      "(multibox_loss_param.nms_param) is not implemented")
        if p.conf_loss_type != 0:
            raise NotImplementedError(f"Layer '{self.name}': MultiBoxLoss conf_loss_type LOGISTIC "
                                      "is not implemented")
        if self.mining and not p.share_location:
            raise self.fail("negative mining needs share_location: true (as in the fork)")
        if not 0 <= p.background_label_id < p.num_classes:
            raise self.fail("background_label_id must be in [0, num_classes) for the softmax loss")
        if p.map_object_to_agnostic and p.num_classes != 2:
            raise self.fail("map_object_to_agnostic needs num_classes 2")
        self.normalization = normalization_mode(self.param.loss_param, VALID)
        pd = list(self.param.propagate_down)
        self.use_loc, self.use_conf = (pd[0], pd[1]) if pd else (True, True)

    def reshape(self, bottom_shapes):
        loc, conf, prior, label = (tuple(s) for s in bottom_shapes)
        p = B.legacy(prior, 2) // 4
        if (loc[0] != conf[0] or B.legacy(loc, 1) != p * self.loc_classes * 4
                or B.legacy(conf, 1) != p * self.num_classes):
            raise self.fail(f"loc {loc} and conf {conf} must be (N, {p}*{self.loc_classes}*4) and "
                            f"(N, {p}*{self.num_classes}) for {p} priors {prior}")
        if count(label) != B.legacy(label, 2) * 8:
            raise self.fail(f"labels must be (1, 1, G, 8), got {label}")
        return [()]

    def _matches(self, gts, pbox, pvar, loc4):
        """FindMatches: per image {label: (match (P,), overlap (P,))} as numpy arrays; {} for an
        image without gt."""
        p, out = self.p, []
        locs = None if p.use_prior_for_matching else loc4.detach().to("cpu", torch.float32)
        pbox_np = pbox.numpy()
        args = (p.match_type, p.overlap_threshold, p.ignore_cross_boundary_bbox)
        for i in range(loc4.shape[0]):
            if i not in gts:
                out.append({})
                continue
            glab, gbox, _ = gts[i]
            ids = np.arange(len(glab))
            if p.use_prior_for_matching:
                m, o = B.match(gbox, ids, pbox_np, *args)
                if p.share_location:
                    out.append({-1: (m, o)})
                else:   # distribute to the gt's own class; -2 (ignored) becomes -1 here
                    lab_of = glab[np.maximum(m, 0)]
                    out.append({c: (np.where((m > -1) & (lab_of == c), m, -1), o)
                                for c in range(self.num_classes) if c != p.background_label_id})
                continue
            per = {}
            for c in range(self.loc_classes):
                label = -1 if p.share_location else c
                if label == p.background_label_id:
                    continue
                boxes = B.decode(pbox, pvar, locs[i, :, c], p.code_type, p.encode_variance_in_target)
                sel = ids if label == -1 else ids[glab == label]
                per[label] = B.match(gbox[sel], sel, boxes.numpy(), *args)
            out.append(per)
        return out

    def _negatives(self, conf, matches, gts):
        """MAX_NEGATIVE mining: per image the highest-loss unmatched priors (overlap below
        neg_overlap), at most neg_pos_ratio * positives, in ascending prior order."""
        p, n = self.p, conf.shape[0]
        lab = np.full(conf.shape[:2], p.background_label_id, np.int64)
        for i, per in enumerate(matches):
            if -1 in per:
                m = per[-1][0]
                lab[i] = np.where(m > -1, gts[i][0][np.maximum(m, 0)], lab[i])
        with torch.no_grad():
            x = conf.detach().cpu()
            x = x - x.amax(2, keepdim=True)     # amax: max(dim)'s kernel splits even tiny rows
            prob = torch.exp(x.gather(2, torch.from_numpy(lab)[..., None])[..., 0]) / torch.exp(x).sum(2)
            loss = (-torch.log(prob.clamp_min(np.finfo(np.float32).tiny))).float().numpy()
        ratio, neg_overlap = np.float32(p.neg_pos_ratio), np.float32(p.neg_overlap)
        negs = []
        for i in range(n):
            sel = []
            for _, (m, o) in sorted(matches[i].items()):
                eligible = np.flatnonzero((m == -1) & (o < neg_overlap))
                k = min(int(np.float32(np.count_nonzero(m > -1)) * ratio), len(eligible))
                # highest loss first, ties in prior order (the fork's stable sort)
                sel.append(eligible[np.argsort(-loss[i, eligible], kind="stable")[:k]])
            negs.append(np.sort(np.concatenate(sel)) if sel else np.zeros(0, np.int64))
        return negs

    def forward(self, bottoms):
        try:
            return self._forward(*bottoms)
        except B.BoxError as e:
            raise self.fail(str(e)) from None

    def _forward(self, loc, conf, prior, label):
        p, n, c = self.p, loc.shape[0], self.num_classes
        P = B.legacy(prior.shape, 2) // 4
        pbox, pvar = B.priors_from_blob(prior, P)
        gts = {i: (lab.numpy(), box.numpy(), diff.numpy()) for i, (lab, box, diff) in
               B.ground_truth(label, p.background_label_id, p.use_difficult_gt, False, self).items()}
        loc4 = loc.reshape(n, P, self.loc_classes, 4)
        matches = self._matches(gts, pbox, pvar, loc4)
        num_matches = sum(int(np.count_nonzero(m > -1)) for per in matches for m, _ in per.values())
        negs = self._negatives(conf.reshape(n, P, c), matches, gts) if self.mining else None
        norm = float(normalizer(self.normalization, n, P, torch.tensor(float(num_matches))))
        loss = loc.new_zeros(())
        if self.use_loc and num_matches:
            loss = loss + p.loc_weight * self._loc_loss(loc4, matches, gts, pbox, pvar) / norm
        if self.use_conf:
            rows, labels = self._conf_rows(conf.reshape(n, P, c), matches, gts, negs)
            if len(labels):
                loss = loss + softmax_loss(rows, labels.to(rows.dtype), 1, None, NONE) / norm
        return [loss]

    def _positives(self, matches, gts):
        """Every matched (image, prior) in the fork's order (image, label, prior): images,
        priors, loc columns and matched gt boxes, as numpy arrays."""
        parts = []
        for i, per in enumerate(matches):
            for label, (m, _) in sorted(per.items()):
                js = np.flatnonzero(m > -1)
                if len(js):
                    col = 0 if self.p.share_location else label
                    parts.append((np.full(len(js), i), js, np.full(len(js), col), gts[i][1][m[js]]))
        return [np.concatenate(a) for a in zip(*parts)] if parts else None

    def _loc_loss(self, loc4, matches, gts, pbox, pvar):
        p = self.p
        img, js, col, gbox = self._positives(matches, gts)
        js_t = torch.from_numpy(js)
        prior, var = pbox[js_t], pvar[js_t]
        tgt = B.encode(prior, var, torch.from_numpy(gbox), p.code_type,
                       p.encode_variance_in_target).to(loc4)
        where = tuple(torch.from_numpy(a).to(loc4.device) for a in (img, js, col))
        pred = loc4[where]
        if p.bp_inside:   # a coordinate outside the image gets its target: no gradient
            ref = prior if p.use_prior_for_matching else B.decode(
                prior, var, pred.detach().cpu().float(), p.code_type, p.encode_variance_in_target)
            pred = torch.where(((ref < 0) | (ref > 1)).to(pred.device), tgt, pred)
        if p.encode_variance_in_target:
            v = var.to(loc4)
            pred, tgt = pred / v, tgt / v
        d = pred - tgt
        return smooth_l1(d).sum() if p.loc_loss_type == 1 else (d * d).sum() / 2

    def _conf_rows(self, conf, matches, gts, negs):
        """EncodeConfPrediction: (rows (K, C) of conf, labels (K,)). With mining: matched priors
        then mined negatives of each image that has ground truth; without: every prior."""
        p = self.p
        bg = p.background_label_id
        agnostic = p.map_object_to_agnostic
        if negs is None:
            lab = np.full(conf.shape[:2], bg, np.int64)
            for i, per in enumerate(matches):
                for _, (m, _) in sorted(per.items()):
                    gl = np.full_like(m, bg + 1) if agnostic else gts[i][0][np.maximum(m, 0)]
                    lab[i] = np.where(m > -1, gl, lab[i])
            return conf.reshape(-1, conf.shape[2]), torch.from_numpy(lab.reshape(-1)).to(conf.device)
        idx, labs = [], []
        P = conf.shape[1]
        for i, per in enumerate(matches):
            if i not in gts:
                continue
            for _, (m, _) in sorted(per.items()):
                js = np.flatnonzero(m > -1)
                idx.append(js + i * P)
                labs.append(np.full(len(js), bg + 1) if agnostic else gts[i][0][m[js]])
            idx.append(negs[i] + i * P)
            labs.append(np.full(len(negs[i]), bg))
        idx = np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, np.int64)
        labs = np.concatenate(labs).astype(np.int64) if labs else np.zeros(0, np.int64)
        rows = conf.reshape(-1, conf.shape[2])[torch.from_numpy(idx).to(conf.device)]
        return rows, torch.from_numpy(labs).to(conf.device)
