"""Loss layers and Accuracy, with Caffe's normalizers and Caffe's gradients.

Each loss top is a 0-D tensor (Caffe's loss blob has shape []). Where Caffe's gradient is not the
derivative of its forward (probability clamps, ignored labels, the contrastive epsilon) the math is
an ``autograd.Function`` whose backward is Caffe's formula; elsewhere autograd gives it.
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from .base import Layer, canonical_axis, count
from .origins import find as find_origin
from .registry import register

FULL, VALID, BATCH_SIZE, NONE = 0, 1, 2, 3   # LossParameter.NormalizationMode
FLT_MIN = 1.17549435e-38                     # SoftmaxWithLoss clamps probabilities here
LOG_THRESHOLD = 1e-20                        # kLOG_THRESHOLD (loss_layer.hpp)


# -- functional core -------------------------------------------------------------------------------
def normalization_mode(loss_param, default: int) -> int:
    """``normalization`` if given, else the deprecated ``normalize`` (true VALID, false
    BATCH_SIZE), else ``default``."""
    if loss_param.HasField("normalization"):
        return loss_param.normalization
    if loss_param.HasField("normalize"):
        return VALID if loss_param.normalize else BATCH_SIZE
    return default


def normalizer(mode: int, outer: int, inner: int, valid=None):
    """Caffe's ``get_normalizer``: the divisor of the summed loss, at least 1. ``valid`` is the
    (tensor) count of non-ignored positions, or None when nothing can be ignored."""
    if mode == VALID and valid is not None:
        return valid.clamp_min(1)
    n = {FULL: outer * inner, VALID: outer * inner, BATCH_SIZE: outer, NONE: 1}[mode]
    return float(max(1, n))


def _labels(label: torch.Tensor, ignore: int | None):
    """Float labels -> (int64 labels safe to index with, valid mask or None). Truncation toward
    zero as Caffe's static_cast<int>; ignored positions index class 0."""
    lab = label.detach().long()
    if ignore is None:
        return lab, None
    valid = lab != ignore
    return torch.where(valid, lab, torch.zeros_like(lab)), valid


DEFERRED = threading.local()    # .record: a list while the step graph traces (its own thread)


def check_labels(layer, label: torch.Tensor, k: int, ignore: int | None = None) -> None:
    """Caffe CHECKs 0 <= label < K at every non-ignored position; torch's scatter_/gather
    would fail with an index error that names neither the layer nor the value. While a step
    graph is traced the check is recorded instead (it branches on values), and run before each
    replay (brewnet/execution/recorded_step.py). A failure names the record the label was read from
    when a data layer noted its batch (``origins.py``)."""
    record = getattr(DEFERRED, "record", None)
    if record is not None:
        record.append((layer, label, k, ignore))
        return
    if ignore is None and label.is_floating_point() and label.numel():
        # one reduction for the common case (a training step's hot path): trunc(x) is in
        # [0, k) iff -1 < x < k; NaN and inf fail it and take the search below
        lo, hi = torch.aminmax(label.detach() if label.requires_grad else label)
        if float(lo) > -1 and float(hi) < k:
            return
    lab = label.detach().reshape(-1).trunc()    # Caffe's static_cast<int>
    bad = ~((lab >= 0) & (lab < k))             # NaN is out of range too
    if ignore is not None:
        bad &= lab.long() != ignore
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        origin = find_origin(label, i)     # the record: which data layer item holds position i
        raise layer.fail(f"label {lab[i].item():g} at position {i} is out of range: labels must "
                         f"be in [0, {k}) for {k} classes"
                         + ("" if ignore is None else f" (or the ignore_label {ignore})")
                         + ("" if origin is None else f"; it was read from {origin}"))


class _WeightedLogLoss(torch.autograd.Function):
    """x (outer, K, inner) or, without H, (outer, K), labels (outer, 1[, inner]), H (K, K) or
    None (identity) ->
    -sum_l H[label, l] log(max(p_l, floor)) / norm with p = softmax over K (SoftmaxWithLoss:
    H = I, floor FLT_MIN; InfogainLoss: floor 1e-20). Caffe's backward, clamped or not:
    (p * rowsum(H)[label] - H[label, :]) * g / norm (= p - onehot for H = I); 0 where ignored.
    The fused engine's K nets: x (K, N, C) with ``axis`` 2 (torch's last-axis softmax; on
    (K*N, C, 1) the strided one took 3x longer), labels (K, N, 1), H None and ``per_net``: the
    loss is (K,), one sum per net."""

    @staticmethod
    def forward(ctx, x, lab, valid, h, floor, norm, axis=1, per_net=False):
        logp = torch.log_softmax(x, axis)
        if h is None:
            rows = torch.zeros_like(x).scatter_(axis, lab, 1.0)
        else:
            rows = h[lab[:, 0]].permute(0, 2, 1)            # (outer, K, inner): H[label, l]
        per = rows * logp.clamp_min(math.log(floor))
        if valid is not None:
            per = per * valid
        ctx.save_for_backward(logp, rows, valid)
        ctx.norm, ctx.onehot, ctx.per_net = norm, h is None, per_net
        if per_net:
            return -per.sum(tuple(range(1, x.dim()))) / norm
        return -per.sum() / norm

    @staticmethod
    def backward(ctx, g):
        logp, rows, valid = ctx.saved_tensors
        # one-hot rows (SoftmaxWithLoss) sum to exactly 1: the product would be p itself
        dx = (logp.exp() if ctx.onehot else logp.exp() * rows.sum(1, keepdim=True)) - rows
        if valid is not None:
            dx = dx * valid
        scale = g / ctx.norm
        if ctx.per_net:                     # net k's rows take its own loss's gradient
            scale = scale.view(-1, *[1] * (dx.dim() - 1))
        return dx * scale, None, None, None, None, None, None, None


def weighted_log_loss(x, label, axis=1, ignore=None, mode=VALID, h=None, floor=FLT_MIN):
    """Caffe's SoftmaxWithLoss (h None) or InfogainLoss (h = H) value, 0-D, for scores x with
    classes on ``axis`` and float labels counting outer * inner."""
    outer, k, inner = count(x.shape, 0, axis), x.shape[axis], count(x.shape, axis + 1)
    lab, valid = _labels(label.reshape(outer, 1, inner), ignore)
    if valid is not None:
        valid = valid.to(x.dtype)
    norm = normalizer(mode, outer, inner, None if valid is None else valid.sum())
    if h is not None:
        h = h.detach().to(device=x.device, dtype=x.dtype).reshape(k, k)
    elif inner == 1:   # (N, C): torch's last-axis softmax, the one the fused engine's K nets run
        return _WeightedLogLoss.apply(x.reshape(outer, k), lab.view(outer, 1),
                                      None if valid is None else valid.view(outer, 1), None,
                                      floor, norm)
    return _WeightedLogLoss.apply(x.reshape(outer, k, inner), lab, valid, h, floor, norm)


def softmax_loss(x, label, axis=1, ignore=None, mode=VALID):
    """Caffe's SoftmaxWithLoss value (0-D) for scores x with classes on ``axis``."""
    return weighted_log_loss(x, label, axis, ignore, mode)


class _MultinomialLogistic(torch.autograd.Function):
    """p (N, K), labels (N, 1) -> -sum log(max(p_label, 1e-20)) / N; backward
    -g / (N * max(p_label, 1e-20)) at the label, clamped or not."""

    @staticmethod
    def forward(ctx, p, lab):
        picked = p.gather(1, lab).clamp_min(LOG_THRESHOLD)
        ctx.save_for_backward(picked, lab)
        ctx.shape = p.shape
        return -picked.log().sum() / p.shape[0]

    @staticmethod
    def backward(ctx, g):
        picked, lab = ctx.saved_tensors
        dp = torch.zeros(ctx.shape, dtype=picked.dtype, device=picked.device)
        dp.scatter_(1, lab, -(g / ctx.shape[0]) / picked)
        return dp, None


class _Contrastive(torch.autograd.Function):
    """a, b (N, D), similar (N,) bool -> sum(similar: d^2; else max(m - d, 0)^2 or, legacy,
    max(m - d^2, 0)) / 2N. Backward for dissimilar non-legacy pairs is Caffe's
    -(m - d) / (d + 1e-4) * (a - b) / N, not the exact -(m - d) / d * (a - b) / N."""

    @staticmethod
    def forward(ctx, a, b, similar, margin, legacy):
        diff = a - b
        d2 = diff.square().sum(1)
        if legacy:
            mdist = margin - d2
            dissim = mdist.clamp_min(0)
            coef = torch.where(mdist > 0, -torch.ones_like(d2), torch.zeros_like(d2))
        else:
            d = d2.sqrt()
            mdist = margin - d
            dissim = mdist.clamp_min(0).square()
            coef = torch.where(mdist > 0, -mdist / (d + 1e-4), torch.zeros_like(d2))
        coef = torch.where(similar, torch.ones_like(coef), coef)
        ctx.save_for_backward(diff, coef)
        return torch.where(similar, d2, dissim).sum() / a.shape[0] / 2

    @staticmethod
    def backward(ctx, g):
        diff, coef = ctx.saved_tensors
        da = diff * coef[:, None] * (g / diff.shape[0])
        return da, -da, None, None, None


def class_axis(layer: Layer, shapes, axis_field: int) -> int:
    """Canonical class axis of bottom 0; the labels (bottom 1) must count outer * inner."""
    x, label = shapes[0], shapes[1]
    axis = canonical_axis(axis_field, len(x), layer)
    if count(x, 0, axis) * count(x, axis + 1) != count(label):
        raise layer.fail(f"number of labels must match number of predictions: with classes on "
                         f"axis {axis} of {tuple(x)}, label shape {tuple(label)} must count "
                         f"{count(x, 0, axis) * count(x, axis + 1)}")
    return axis


# -- layers ----------------------------------------------------------------------------------------
class _Loss(Layer):
    """Caffe's LossLayer: data + label bottoms of equal shape(0), one 0-D loss top."""

    exact_bottoms = 2
    exact_tops = 1
    is_loss = True

    def allow_backward(self, i):
        return i == 0

    def reshape(self, bottom_shapes):
        a, b = bottom_shapes[0], bottom_shapes[1]
        if not a or not b or a[0] != b[0]:
            raise self.fail(f"the data and label should have the same first dimension; "
                            f"got shapes {tuple(a)} and {tuple(b)}")
        return [()]

    def _ignore(self):
        lp = self.param.loss_param
        return lp.ignore_label if lp.HasField("ignore_label") else None


@register("SoftmaxWithLoss")
class SoftmaxWithLoss(_Loss):
    """Softmax over ``axis`` then multinomial logistic loss (Caffe's SoftmaxWithLoss).

    Bottoms: scores (..., C on axis, ...), labels (count = outer*inner, integer values as floats).
    Tops: loss (0-D) and optionally the probabilities (bottom shape). Params: softmax_param.axis,
    loss_param.ignore_label, normalization (default VALID) / deprecated normalize.
    Differs from torch: log p is clamped at log(FLT_MIN) and the gradient is always p - onehot;
    BVLC Caffe cannot build the two-top form, brewnet can (a diff on prob is ignored, as Caffe's
    backward and InfogainLoss do).
    """

    exact_tops = None
    min_tops = 1
    max_tops = 2

    def setup(self, bottom_shapes):
        self.ignore = self._ignore()
        self.mode = normalization_mode(self.param.loss_param, VALID)

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        class_axis(self, bottom_shapes, self.param.softmax_param.axis)
        return tops + [tuple(bottom_shapes[0])] * (self.num_tops - 1)

    def forward(self, bottoms):
        x, label = bottoms
        axis = canonical_axis(self.param.softmax_param.axis, x.dim(), self)
        check_labels(self, label, x.shape[axis], self.ignore)
        tops = [softmax_loss(x, label, axis, self.ignore, self.mode)]
        if self.num_tops > 1:  # Caffe's backward reads only the loss diff: no gradient via prob
            tops.append(torch.softmax(x.detach(), axis))
        return tops


@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(_Loss):
    """Cross-entropy of sigmoid(x) against targets in [0, 1] (Caffe's SigmoidCrossEntropyLoss).

    Bottoms: scores (N, ...), targets (same count). Top: loss (0-D). Params: loss_param.ignore_label
    (compared with the target truncated to int), normalization (default BATCH_SIZE when neither it
    nor ``normalize`` is given). Gradient: (sigmoid(x) - t) / normalizer, 0 where ignored.
    """

    def setup(self, bottom_shapes):
        self.ignore = self._ignore()
        self.mode = normalization_mode(self.param.loss_param, BATCH_SIZE)

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        if count(bottom_shapes[0]) != count(bottom_shapes[1]):
            raise self.fail(f"inputs must have the same count; got shapes "
                            f"{tuple(bottom_shapes[0])} and {tuple(bottom_shapes[1])}")
        return tops

    def forward(self, bottoms):
        x, t = bottoms[0], bottoms[1].detach().reshape(bottoms[0].shape)
        per = F.softplus(x) - x * t      # stable log(1 + e^x) - x t; d/dx = sigmoid(x) - t
        valid = None
        if self.ignore is not None:
            valid = t.long() != self.ignore
            per = torch.where(valid, per, torch.zeros_like(per))
            valid = valid.sum()
        norm = normalizer(self.mode, x.shape[0], count(x.shape, 1), valid)
        return [per.sum() / norm]


@register("EuclideanLoss")
class EuclideanLoss(_Loss):
    """sum((a - b)^2) / (2N) (Caffe's EuclideanLoss). Bottoms: a, b (N, ...) with equal count per
    item; both get gradients. Top: loss (0-D)."""

    def allow_backward(self, i):
        return True

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        a, b = bottom_shapes[0], bottom_shapes[1]
        if count(a, 1) != count(b, 1):
            raise self.fail(f"inputs must have the same dimension; got shapes {tuple(a)} and {tuple(b)}")
        return tops

    def forward(self, bottoms):
        a, b = bottoms
        diff = a - b.reshape(a.shape)
        return [diff.square().sum() / a.shape[0] / 2]


@register("HingeLoss")
class HingeLoss(_Loss):
    """One-vs-all hinge loss (Caffe's HingeLoss): t = max(0, 1 + s*x), s = -1 at the true class and
    +1 elsewhere; L1: sum(t)/N, L2: sum(t^2)/N. Bottoms: scores (N, ...), labels (N). Top: 0-D.
    Params: hinge_loss_param.norm (L1 default, L2)."""

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        if count(bottom_shapes[1]) != bottom_shapes[0][0]:
            raise self.fail(f"expects one label per item; got label shape {tuple(bottom_shapes[1])} "
                            f"for data shape {tuple(bottom_shapes[0])}")
        return tops

    def forward(self, bottoms):
        x = bottoms[0].reshape(bottoms[0].shape[0], -1)
        check_labels(self, bottoms[1], x.shape[1])
        lab = bottoms[1].detach().reshape(-1, 1).long()
        sign = torch.ones_like(x).scatter_(1, lab, -1.0)
        t = torch.relu(1 + sign * x)
        if self.param.hinge_loss_param.norm == pb.HingeLossParameter.L2:
            t = t * t
        return [t.sum() / x.shape[0]]


@register("InfogainLoss")
class InfogainLoss(_Loss):
    """Softmax over ``axis`` then the infogain-weighted log loss (Caffe's InfogainLoss).

    Bottoms: scores, labels (count outer*inner), optional H (K x K, count K*K); without it H is read
    from infogain_loss_param.source (a binary BlobProto). Tops: loss (0-D), optional probabilities.
    Params: infogain_loss_param.axis (1), source; loss_param.ignore_label, normalization (default
    VALID; the deprecated ``normalize`` is rejected as in Caffe). A diff given to the
    probabilities top is ignored, as Caffe's backward uses only the loss diff.
    """

    exact_bottoms = None
    min_bottoms = 2
    max_bottoms = 3
    exact_tops = None
    min_tops = 1
    max_tops = 2

    def setup(self, bottom_shapes):
        lp = self.param.loss_param
        if lp.HasField("normalize"):
            raise self.fail('loss_param.normalize is deprecated; use "normalization"')
        self.ignore = self._ignore()
        self.mode = lp.normalization
        self.h = None
        if len(bottom_shapes) < 3:
            self.h = _read_blob(self, self.param.infogain_loss_param)

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        axis = class_axis(self, bottom_shapes, self.param.infogain_loss_param.axis)
        k = bottom_shapes[0][axis]
        h_shape = tuple(bottom_shapes[2]) if len(bottom_shapes) > 2 else tuple(self.h.shape)
        if count(h_shape) != k * k:
            raise self.fail(f"infogain matrix H of shape {h_shape} must be {k} x {k} for "
                            f"{k} classes (data shape {tuple(bottom_shapes[0])})")
        return tops + [tuple(bottom_shapes[0])] * (self.num_tops - 1)

    def forward(self, bottoms):
        x, label = bottoms[0], bottoms[1]
        axis = canonical_axis(self.param.infogain_loss_param.axis, x.dim(), self)
        h = bottoms[2] if len(bottoms) > 2 else self.h
        check_labels(self, label, x.shape[axis], self.ignore)
        tops = [weighted_log_loss(x, label, axis, self.ignore, self.mode, h, LOG_THRESHOLD)]
        if self.num_tops > 1:  # Caffe's backward reads only the loss diff: no gradient via prob
            tops.append(torch.softmax(x.detach(), axis))
        return tops


def _read_blob(layer: Layer, infogain_param) -> torch.Tensor:
    """The H matrix of InfogainLoss from its binary BlobProto file."""
    from ..proto.io import ProtoError, read_binaryproto

    if not infogain_param.HasField("source"):
        raise layer.fail("infogain matrix source must be specified (or given as a third bottom)")
    try:
        return torch.from_numpy(read_binaryproto(infogain_param.source))
    except ProtoError as e:
        raise layer.fail(f"cannot read the infogain matrix: {e}") from None


@register("MultinomialLogisticLoss")
class MultinomialLogisticLoss(_Loss):
    """-sum log(max(p_label, 1e-20)) / N on probabilities (Caffe's MultinomialLogisticLoss).
    Bottoms: probabilities (N, ...), labels (N). Top: loss (0-D).
    Differs from torch: the 1e-20 clamp keeps its gradient -1/(N * 1e-20)."""

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        if count(bottom_shapes[1]) != bottom_shapes[1][0]:
            raise self.fail(f"label shape {tuple(bottom_shapes[1])} must be (N) or (N, 1, 1, 1)")
        return tops

    def forward(self, bottoms):
        p = bottoms[0].reshape(bottoms[0].shape[0], -1)
        check_labels(self, bottoms[1], p.shape[1])
        return [_MultinomialLogistic.apply(p, bottoms[1].detach().reshape(-1, 1).long())]


@register("ContrastiveLoss")
class ContrastiveLoss(_Loss):
    """Siamese contrastive loss (Caffe's ContrastiveLoss).

    Bottoms: a, b (N, D[, 1, 1]), similar (N; nonzero = similar pair). Top: loss (0-D).
    Params: contrastive_loss_param.margin (1), legacy_version (false: max(m - d, 0)^2; true:
    max(m - d^2, 0) for dissimilar pairs).
    Differs from torch: dissimilar-pair gradient divides by d + 1e-4 (Caffe's), not d.
    """

    exact_bottoms = 3

    def allow_backward(self, i):
        return i < 2

    def reshape(self, bottom_shapes):
        tops = super().reshape(bottom_shapes)
        a, b, s = bottom_shapes
        if tuple(a) != tuple(b) or count(s) != a[0]:
            raise self.fail(f"needs a and b of equal shape and one similarity per pair; got "
                            f"shapes {tuple(a)}, {tuple(b)}, {tuple(s)}")
        return tops

    def forward(self, bottoms):
        a, b, sim = bottoms
        n = a.shape[0]
        similar = sim.detach().reshape(n).long() != 0
        p = self.param.contrastive_loss_param
        return [_Contrastive.apply(a.reshape(n, -1), b.reshape(n, -1), similar, p.margin,
                                   p.legacy_version)]


@register("Accuracy")
class Accuracy(Layer):
    """Top-k classification accuracy (Caffe's Accuracy); no backward.

    Bottoms: scores (classes on ``axis``), labels (count outer*inner). Tops: accuracy (0-D),
    optional per-class accuracy (K). Params: accuracy_param.top_k (1), axis (1), ignore_label.
    A prediction is correct when fewer than top_k other classes score >= the true class (ties
    count against); the mean is over non-ignored labels (0 if none).
    """

    arithmetic = "exact"
    exact_bottoms = 2
    min_tops = 1
    max_tops = 2

    def allow_backward(self, i):
        return False

    def reshape(self, bottom_shapes):
        x, label = bottom_shapes[0], bottom_shapes[1]
        p = self.param.accuracy_param
        if count(label) == 0 or p.top_k > count(x) // count(label):
            raise self.fail(f"top_k {p.top_k} must be less than or equal to the number of classes "
                            f"(data shape {tuple(x)}, label shape {tuple(label)})")
        axis = class_axis(self, bottom_shapes, p.axis)
        return [()] + [(x[axis],)] * (self.num_tops - 1)

    def forward(self, bottoms):
        p = self.param.accuracy_param
        x = bottoms[0].detach()
        axis = canonical_axis(p.axis, x.dim(), self)
        outer, k, inner = count(x.shape, 0, axis), x.shape[axis], count(x.shape, axis + 1)
        x = x.reshape(outer, k, inner)
        ignore = p.ignore_label if p.HasField("ignore_label") else None
        check_labels(self, bottoms[1], k, ignore)
        lab, valid = _labels(bottoms[1].reshape(outer, 1, inner), ignore)
        if valid is None and self.num_tops == 1:
            # every label counts: fewer than top_k others >= the true class <=> at most top_k
            # classes >= it (itself included); the mean over outer * inner > 0 labels
            hits = (x >= x.gather(1, lab)).sum(1) <= p.top_k
            return [hits.sum().to(x.dtype) / (outer * inner)]
        if valid is None:
            valid = torch.ones_like(lab, dtype=torch.bool)
        better = (x >= x.gather(1, lab)).sum(1, keepdim=True) - 1   # the true class counts itself
        correct = (better < p.top_k) & valid
        n = valid.sum().to(x.dtype)
        tops = [torch.where(n > 0, correct.sum().to(x.dtype) / n.clamp_min(1), torch.zeros_like(n))]
        if self.num_tops > 1:
            seen = torch.zeros(k, dtype=x.dtype, device=x.device)
            seen.scatter_add_(0, lab.reshape(-1), valid.reshape(-1).to(x.dtype))
            hits = torch.zeros_like(seen).scatter_add_(0, lab.reshape(-1), correct.reshape(-1).to(x.dtype))
            tops.append(torch.where(seen > 0, hits / seen.clamp_min(1), torch.zeros_like(seen)))
        return tops
