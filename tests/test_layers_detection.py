"""SSD fork layers (Normalize, Permute, PriorBox, DetectionOutput, MultiBoxLoss, DetectionEvaluate)
against hand-computed cases from the fork's formulas, float64 gradient checks, and the
MobileNet-SSD nets with random weights. (No real-Caffe golden data exists for these layers.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from brewnet.layers import bbox as B
from brewnet.layers.base import LayerError
from helpers import MODELS, gradcheck_layer, make_layer, swap_data_layers

RNG = np.random.default_rng(11)


# -- Normalize --------------------------------------------------------------------------------
def norm_text(across, shared, filler='scale_filler { type: "constant" value: 2 }', eps=""):
    return (f'name: "n" type: "Normalize" bottom: "x" top: "y" norm_param {{ across_spatial: '
            f'{str(across).lower()} channel_shared: {str(shared).lower()} {filler} {eps} }}')


def test_normalize_per_position_by_hand():
    x = torch.zeros(1, 2, 1, 2)
    x[0, :, 0, 0] = torch.tensor([3.0, 4.0])     # norm 5
    x[0, :, 0, 1] = torch.tensor([0.0, -2.0])    # norm 2
    layer, tops = make_layer(norm_text(False, False), [x.shape])
    assert [tuple(b.shape) for b in layer.blobs] == [(2,)] and tops == [(1, 2, 1, 2)]
    layer.blobs[0].data.copy_(torch.tensor([2.0, 10.0]))
    y = layer.forward([x])[0].detach()
    np.testing.assert_allclose(y[0, :, 0, 0], [0.6 * 2, 0.8 * 10], rtol=1e-6)
    np.testing.assert_allclose(y[0, :, 0, 1], [0.0, -10.0], rtol=1e-6)


def test_normalize_across_spatial_and_defaults():
    x = torch.tensor(RNG.normal(size=(2, 3, 2, 2)), dtype=torch.float32)
    layer, _ = make_layer(norm_text(True, True, filler=""), [x.shape])
    assert layer.blobs[0].shape == () and float(layer.blobs[0].detach()) == 1.0   # default filler: 1
    y = layer.forward([x])[0].detach().numpy()
    xn = x.numpy()
    want = xn / np.sqrt((xn ** 2).sum(axis=(1, 2, 3), keepdims=True) + 1e-10)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    # eps sits inside the square root: an all-zero sample stays 0, a tiny one is damped
    layer, _ = make_layer(norm_text(False, True, eps="eps: 0.01"), [(1, 2, 1, 1)])
    y = layer.forward([torch.tensor([[[[0.0]], [[0.1]]]])])[0].detach()
    np.testing.assert_allclose(y.flatten(), [0.0, 2 * 0.1 / math.sqrt(0.01 + 0.01)], rtol=1e-6)


@pytest.mark.parametrize("across,shared", [(False, False), (True, True), (True, False), (False, True)])
def test_normalize_gradient(across, shared):
    x = torch.tensor(RNG.normal(size=(2, 3, 2, 3)))
    layer, _ = make_layer(norm_text(across, shared), [x.shape])
    with torch.no_grad():
        layer.blobs[0].copy_(torch.tensor(RNG.uniform(0.5, 2, size=layer.blobs[0].shape)))
    assert gradcheck_layer(layer, [x])


# -- Permute ----------------------------------------------------------------------------------
def test_permute():
    x = torch.tensor(RNG.normal(size=(2, 3, 4, 5)))
    layer, tops = make_layer('name: "p" type: "Permute" bottom: "x" top: "y" '
                             'permute_param { order: 0 order: 2 order: 3 order: 1 }', [x.shape])
    assert tops == [(2, 4, 5, 3)]
    np.testing.assert_array_equal(layer.forward([x])[0].numpy(), x.numpy().transpose(0, 2, 3, 1))
    assert gradcheck_layer(layer, [x])
    layer, tops = make_layer('name: "p" type: "Permute" bottom: "x" top: "y" '
                             'permute_param { order: 2 order: 0 }', [x.shape])
    assert tops == [(4, 2, 3, 5)]   # unnamed axes follow in their order
    with pytest.raises(LayerError, match="distinct axes"):
        make_layer('name: "p" type: "Permute" bottom: "x" top: "y" permute_param { order: 1 order: 1 }',
                   [x.shape])


# -- PriorBox ---------------------------------------------------------------------------------
def prior_text(body):
    return f'name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "p" prior_box_param {{ {body} }}'


def test_prior_box_min_max_one_ratio_by_hand():
    # 2x2 map on a 100x100 image: step 50, centres 25 and 75; ratios 1, 2, 1/2 plus the
    # sqrt(30*60) square: 4 priors per cell in the order min, max, ratio 2, ratio 1/2.
    layer, tops = make_layer(prior_text("min_size: 30 max_size: 60 aspect_ratio: 2 flip: true "
                                        "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2"),
                             [(1, 8, 2, 2), (1, 3, 100, 100)])
    assert tops == [(1, 2, 2 * 2 * 4 * 4)]
    out = layer.forward([torch.zeros(1, 8, 2, 2), torch.zeros(1, 3, 100, 100)])[0]
    assert out.shape == (1, 2, 64)
    boxes = out[0, 0].view(2, 2, 4, 4).double().numpy()
    s, r = math.sqrt(1800), math.sqrt(2)
    half = [(15, 15), (s / 2, s / 2), (15 * r, 15 / r), (15 / r, 15 * r)]   # (w/2, h/2)
    for h, cy in enumerate([25, 75]):
        for w, cx in enumerate([25, 75]):
            want = [[(cx - a) / 100, (cy - b) / 100, (cx + a) / 100, (cy + b) / 100] for a, b in half]
            np.testing.assert_allclose(boxes[h, w], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[0, 1].view(-1, 4).numpy(), np.tile([0.1, 0.1, 0.2, 0.2], (16, 1)))


def test_prior_box_two_ratios_step_clip_and_int_sizes():
    # Explicit img_size and step; min_size 20.9 is truncated to 20 as in the fork; a repeated
    # ratio is ignored; flip adds 1/2 and 1/3: 5 priors per cell; clip keeps [0, 1].
    layer, tops = make_layer(prior_text("min_size: 20.9 aspect_ratio: 2 aspect_ratio: 3 "
                                        "aspect_ratio: 2 flip: true clip: true img_size: 40 "
                                        "step: 20 offset: 0.5 variance: 0.1"),
                             [(1, 8, 2, 2), (1, 3, 7, 9)])
    assert layer.num_priors == 5 and tops == [(1, 2, 2 * 2 * 5 * 4)]
    out = layer.forward([torch.zeros(1, 8, 2, 2), torch.zeros(1, 3, 7, 9)])[0][0]
    boxes = out[0].view(2, 2, 5, 4).double().numpy()
    wh = [(20, 20), (20 * math.sqrt(2), 20 / math.sqrt(2)), (20 / math.sqrt(2), 20 * math.sqrt(2)),
          (20 * math.sqrt(3), 20 / math.sqrt(3)), (20 / math.sqrt(3), 20 * math.sqrt(3))]
    for h, cy in enumerate([10, 30]):
        for w, cx in enumerate([10, 30]):
            want = np.clip([[(cx - a / 2) / 40, (cy - b / 2) / 40, (cx + a / 2) / 40, (cy + b / 2) / 40]
                            for a, b in wh], 0, 1)
            np.testing.assert_allclose(boxes[h, w], want, rtol=1e-6, atol=1e-7)
    assert float(boxes.min()) == 0.0 and float(boxes.max()) == 1.0
    np.testing.assert_allclose(out[1].numpy(), 0.1, rtol=1e-7)


def test_prior_box_errors():
    with pytest.raises(LayerError, match="min_size"):
        make_layer(prior_text("aspect_ratio: 2"), [(1, 1, 2, 2), (1, 3, 8, 8)])
    with pytest.raises(LayerError, match="max_size"):
        make_layer(prior_text("min_size: 30 max_size: 20"), [(1, 1, 2, 2), (1, 3, 8, 8)])
    with pytest.raises(LayerError, match="variance"):
        make_layer(prior_text("min_size: 30 variance: 0.1 variance: 0.2"), [(1, 1, 2, 2), (1, 3, 8, 8)])
    with pytest.raises(LayerError, match="not both"):
        make_layer(prior_text("min_size: 30 img_size: 10 img_h: 10 img_w: 10"),
                   [(1, 1, 2, 2), (1, 3, 8, 8)])


# -- box math ---------------------------------------------------------------------------------
PRIOR = torch.tensor([[0.1, 0.1, 0.3, 0.3]])
VAR = torch.tensor([[0.1, 0.1, 0.2, 0.2]])


def test_decode_known_offsets():
    loc = torch.tensor([[1.0, -1.0, 5 * math.log(2.0), 0.0]])
    # CENTER_SIZE: centre (0.2, 0.2) + 0.1 * (1, -1) * 0.2; width 0.2 * e^(0.2 * 5 ln 2) = 0.4
    got = B.decode(PRIOR, VAR, loc, B.CENTER_SIZE, False)
    np.testing.assert_allclose(got, [[0.02, 0.08, 0.42, 0.28]], rtol=1e-6, atol=1e-7)
    got = B.decode(PRIOR, VAR, torch.tensor([[0.1, -0.1, math.log(2.0), 0.0]]), B.CENTER_SIZE, True)
    np.testing.assert_allclose(got, [[0.02, 0.08, 0.42, 0.28]], rtol=1e-6, atol=1e-7)
    got = B.decode(PRIOR, VAR, torch.tensor([[1.0, 2.0, -1.0, 0.5]]), B.CORNER, False)
    np.testing.assert_allclose(got, [[0.2, 0.3, 0.1, 0.4]], rtol=1e-6)
    got = B.decode(PRIOR, VAR, torch.tensor([[1.0, 2.0, -1.0, 0.5]]), B.CORNER_SIZE, False)
    np.testing.assert_allclose(got, [[0.12, 0.14, 0.26, 0.32]], rtol=1e-6)
    for code in (B.CORNER, B.CENTER_SIZE, B.CORNER_SIZE):   # encode inverts decode
        gt = torch.tensor([[0.05, 0.15, 0.45, 0.25]])
        offsets = B.encode(PRIOR, VAR, gt, code, False)
        np.testing.assert_allclose(B.decode(PRIOR, VAR, offsets, code, False), gt, rtol=1e-5, atol=1e-6)


A, B2, C, D = [0, 0, .5, .5], [.0625, 0, .5625, .5], [.625, .625, .875, .875], [0, 0, .5, .25]


def test_jaccard_by_hand():
    iou = B.jaccard(torch.tensor([A]), torch.tensor([B2, C, D, [.5, 0, 1, .5]]))
    # B2: .4375*.5 / (.25+.25-.21875); C: apart; D inside A: .125/.25; touching edge: 0
    np.testing.assert_allclose(iou, [[0.21875 / 0.28125, 0, 0.5, 0]], rtol=1e-6)


def test_nms_fast_threshold_ties_and_eta():
    boxes = torch.tensor([A, B2, C, D])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.75])
    # A kept; B2 (IoU .78) and D (IoU exactly .5) suppressed at .45; C kept.
    assert B.nms_fast(boxes, scores, 0.0, 0.45).tolist() == [0, 2]
    assert B.nms_fast(boxes, scores, 0.0, 0.5).tolist() == [0, 3, 2]        # overlap <= thr keeps
    assert B.nms_fast(boxes, scores, 0.72, 0.5).tolist() == [0, 3]          # score > threshold
    assert B.nms_fast(boxes, scores, 0.0, 0.5, top_k=2).tolist() == [0]     # top_k before NMS
    # eta: the threshold 0.6 shrinks to .54 after A and .486 after C, then D (IoU .5) goes.
    s2 = torch.tensor([0.9, 0.1, 0.8, 0.7])
    assert B.nms_fast(boxes, s2, 0.2, 0.6).tolist() == [0, 2, 3]
    assert B.nms_fast(boxes, s2, 0.2, 0.6, eta=0.9).tolist() == [0, 2]
    ties = torch.tensor([0.5, 0.5, 0.5, 0.5])
    assert B.nms_fast(torch.tensor([C, A, D, B2]), ties, 0.0, 0.45).tolist() == [0, 1]


def greedy_nms(boxes, scores, score_threshold, nms_threshold, top_k):
    """ApplyNMSFast as written: candidates by score (stable), the whole overlap matrix, keep."""
    idx = np.flatnonzero(scores > np.float32(score_threshold))
    idx = idx[np.argsort(-scores[idx], kind="stable")][:top_k if top_k > -1 else None]
    overlap = B.iou(boxes[idx], boxes[idx])
    keep = []
    for i in range(len(idx)):
        if all(overlap[k, i] <= np.float32(nms_threshold) for k in keep):
            keep.append(i)
    return idx[keep]


@pytest.mark.parametrize("seed", range(6))
def test_nms_fast_in_blocks_keeps_what_the_whole_matrix_keeps(seed):
    """nms_fast computes overlap rows ``NMS_BLOCK`` at a time, and sorts only the ``top_k``
    best: the same kept boxes in the same order as the whole matrix, ties included."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(B.NMS_BLOCK * 3, 900))
    centre = rng.random((k, 2)).astype(np.float32)
    wh = (rng.random((k, 2)) * [0.05, 0.3, 1.0][seed % 3]).astype(np.float32)
    boxes = np.concatenate([centre - wh / 2, centre + wh / 2], 1).astype(np.float32)
    boxes[rng.integers(0, k, 20)] = boxes[0]                          # identical boxes
    scores = np.round(rng.random(k), 1 + seed % 2).astype(np.float32)  # many tied scores
    for thr in (0.0, 0.3, 0.45, 0.7, 1.0):
        for top_k in (-1, 100, 400):
            want = greedy_nms(boxes, scores, 0.01, thr, top_k)
            np.testing.assert_array_equal(B.nms_fast(boxes, scores, 0.01, thr, top_k=top_k), want)


# -- DetectionOutput --------------------------------------------------------------------------
def detout_text(body, n_classes=3):
    return ('name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "o" '
            f'detection_output_param {{ num_classes: {n_classes} background_label_id: 0 {body} }}')


def prior_blob(boxes, var=(0.1, 0.1, 0.2, 0.2)):
    b = torch.tensor(boxes, dtype=torch.float32).reshape(-1)
    return torch.stack([b, torch.tensor(var).repeat(len(boxes))])[None]


def test_detection_output_nms_keep_top_k_and_layout():
    priors = prior_blob([A, B2, C, D])
    conf = torch.tensor([[[.05, .9, .05], [.1, .8, .1], [.2, .1, .7], [.05, .2, .75]]])   # (1, 4, 3)
    loc = torch.zeros(1, 16)     # CORNER, zero offsets: boxes are the priors
    body = 'code_type: CORNER nms_param { nms_threshold: 0.45 } confidence_threshold: 0.15'
    layer, tops = make_layer(detout_text(body), [loc.shape, (1, 12), priors.shape])
    assert tops == [(1, 1, 1, 7)] and not layer.allow_backward(0)
    out = layer.forward([loc, conf.reshape(1, -1), priors])[0][0, 0]
    # class 1: A (.9) kept, B2 suppressed, D (.2, IoU .5 with A) suppressed; class 2: D (.75),
    # C (.7) kept (apart).  Rows by label, then score.
    want = [[0, 1, .9] + A, [0, 2, .75] + D, [0, 2, .7] + C]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
    layer, _ = make_layer(detout_text(body + " keep_top_k: 2"), [loc.shape, (1, 12), priors.shape])
    out = layer.forward([loc, conf.reshape(1, -1), priors])[0][0, 0]
    np.testing.assert_allclose(out.numpy(), [[0, 1, .9] + A, [0, 2, .75] + D], rtol=1e-6)


def test_keep_top_k_takes_the_best_ties_by_label_then_nms_order():
    """DetectionOutput's keep_top_k over the boxes NMS kept: the best by score, ties in label
    order and then NMS's order; each label's boxes best first (a reference sort of tuples)."""
    layer, _ = make_layer(detout_text("code_type: CORNER nms_param { nms_threshold: 0.45 } keep_top_k: 1", 5),
                          [(1, 16), (1, 20), (1, 2, 16)])
    rng = np.random.default_rng(0)
    for trial in range(200):
        p = int(rng.integers(5, 200))
        scores = np.round(rng.random((p, 5)), 1 + trial % 2).astype(np.float32)   # many ties
        kept = {c: rng.permutation(p)[:rng.integers(1, p)] for c in range(1, 5) if rng.random() < 0.8}
        if not kept:
            continue
        layer.keep_top_k = int(rng.integers(1, 120))
        entries = sorted(((-float(scores[j, c]), c, n, j) for c in sorted(kept)
                          for n, j in enumerate(kept[c].tolist())), key=lambda e: e[:3])
        want: dict = {}
        for _, c, _, j in entries[:layer.keep_top_k]:
            want.setdefault(c, []).append(j)
        got = layer._keep_top_k(kept, scores)
        assert sorted(got) == sorted(want)
        for c in want:
            assert got[c].dtype == np.int64 and got[c].tolist() == want[c]


def test_detection_output_decodes_and_reports_nothing_found():
    priors = prior_blob([[0.1, 0.1, 0.3, 0.3]])
    loc = torch.tensor([[1.0, -1.0, 5 * math.log(2.0), 0.0]]).repeat(2, 1)
    conf = torch.tensor([[0.4, 0.6], [0.9, 0.1]])
    layer, _ = make_layer(detout_text("code_type: CENTER_SIZE confidence_threshold: 0.5", 2),
                          [loc.shape, conf.shape, priors.shape])
    out = layer.forward([loc, conf, priors])[0][0, 0]
    np.testing.assert_allclose(out.numpy(), [[0, 1, 0.6, 0.02, 0.08, 0.42, 0.28]], rtol=1e-5, atol=1e-7)
    out = layer.forward([loc, torch.tensor([[0.6, 0.4], [0.9, 0.1]]), priors])[0]
    np.testing.assert_array_equal(out.numpy()[0, 0], [[0] + [-1] * 6, [1] + [-1] * 6])


def test_detection_output_per_class_locations():
    priors = prior_blob([A, C])
    # share_location false: 3 loc classes per prior; class 2 moves its box right by 0.1
    # (offsets 1 and 0.5 times variances 0.1 and 0.2)
    loc = torch.zeros(1, 2, 3, 4)
    loc[0, :, 2] = torch.tensor([1.0, 0.0, 0.5, 0.0])
    conf = torch.tensor([[[0.0, 0.6, 0.5], [0.0, 0.0, 0.9]]]).reshape(1, -1)
    layer, _ = make_layer(detout_text("share_location: false code_type: CORNER "
                                      "confidence_threshold: 0.4"), [(1, 24), (1, 6), priors.shape])
    out = layer.forward([loc.reshape(1, -1), conf, priors])[0][0, 0].numpy()
    shifted = lambda b: [b[0] + .1, b[1], b[2] + .1, b[3]]
    np.testing.assert_allclose(out, [[0, 1, .6] + A, [0, 2, .9] + shifted(C), [0, 2, .5] + shifted(A)],
                               rtol=1e-6)


def test_detection_output_shape_errors():
    with pytest.raises(LayerError, match="num_classes"):
        make_layer('name: "d" type: "DetectionOutput" bottom: "a" bottom: "b" bottom: "c" top: "o"',
                   [(1, 8), (1, 6), (1, 2, 8)])
    with pytest.raises(LayerError, match="priors"):
        make_layer(detout_text(""), [(1, 8), (1, 9), (1, 2, 8)])


# -- MultiBoxLoss -----------------------------------------------------------------------------
MB = ('name: "l" type: "MultiBoxLoss" bottom: "loc" bottom: "conf" bottom: "prior" bottom: "label" '
      'top: "loss" propagate_down: true propagate_down: true propagate_down: false '
      'propagate_down: false '
      'multibox_loss_param {{ num_classes: 3 overlap_threshold: 0.5 neg_pos_ratio: {ratio} '
      'code_type: CENTER_SIZE {extra} }}')
PRIORS6 = [A, B2, C, D, [.5, .5, 1, 1], [0, .5, .5, 1]]


def mb_case(n=1):
    priors = prior_blob(PRIORS6)
    # image 0: gt label 2 equal to A; image n-1 (if 2): label 1 at C
    gt = [[0, 2, 0] + A + [0]] + ([[1, 1, 0] + C + [0]] if n > 1 else []) + [[-1, 0, 0, 0, 0, 0, 0, 0]]
    label = torch.tensor(gt, dtype=torch.float64)[None, None]
    loc = torch.tensor(RNG.normal(scale=0.5, size=(n, 6 * 4)))
    conf = torch.tensor(RNG.normal(size=(n, 6 * 3)))
    return loc, conf, priors.double(), label


def np_softmax_nll(row, k):
    e = np.exp(row - row.max())
    return -math.log(e[k] / e.sum())


def test_multibox_loss_by_hand():
    loc, conf, priors, label = mb_case()
    shapes = [loc.shape, conf.shape, priors.shape, label.shape]
    layer, tops = make_layer(MB.format(ratio=1.0, extra=""), shapes)
    assert tops == [()] and [layer.allow_backward(i) for i in range(4)] == [True, True, False, False]
    loss = layer.forward([loc, conf, priors, label])[0]
    # Overlaps with the gt (= A): A 1 (bipartite match), B2 .78 (per-prediction match),
    # D .5 (>= .5: match), others 0. 3 positives; ratio 1 -> the 3 negatives with overlap < .5,
    # i.e. all of C, [.5,.5,1,1], [0,.5,.5,1], taken by background loss.
    pos, neg = [0, 1, 3], [2, 4, 5]
    c = conf.numpy().reshape(6, 3)
    conf_loss = sum(np_softmax_nll(c[j], 2) for j in pos) + sum(np_softmax_nll(c[j], 0) for j in neg)
    pr, v = np.array(PRIORS6, dtype=np.float32), np.array([.1, .1, .2, .2], dtype=np.float32)
    g = np.array(A)
    loc_loss = 0.0
    for j in pos:
        p = pr[j]
        pw, ph = p[2] - p[0], p[3] - p[1]
        t = [((g[0] + g[2]) / 2 - (p[0] + p[2]) / 2) / pw / v[0],
             ((g[1] + g[3]) / 2 - (p[1] + p[3]) / 2) / ph / v[1],
             math.log((g[2] - g[0]) / pw) / v[2], math.log((g[3] - g[1]) / ph) / v[3]]
        d = loc.numpy().reshape(6, 4)[j] - np.array(t)
        loc_loss += sum(0.5 * x * x if abs(x) < 1 else abs(x) - 0.5 for x in d)
    np.testing.assert_allclose(float(loss), (loc_loss + conf_loss) / 3, rtol=1e-5)


def test_multibox_loss_mining_picks_hardest_negatives():
    loc, conf, priors, label = mb_case()
    c = torch.zeros(6, 3, dtype=torch.float64)
    c[4, 1] = 3.0       # prior 4 has the largest background loss, prior 5 the next
    c[5, 2] = 1.0
    shapes = [loc.shape, conf.shape, priors.shape, label.shape]
    layer, _ = make_layer(MB.format(ratio=0.5, extra=""), shapes)
    x = c.reshape(1, -1).requires_grad_(True)
    layer.forward([loc, x, priors, label])[0].backward()
    # int(3 positives * 0.5) = 1 negative: prior 4. Rows not selected get no gradient.
    touched = (x.grad.reshape(6, 3).abs().sum(1) > 0).tolist()
    assert touched == [True, True, False, True, True, False]


def test_multibox_loss_gradient_and_normalization():
    loc, conf, priors, label = mb_case(n=2)
    shapes = [loc.shape, conf.shape, priors.shape, label.shape]
    layer, _ = make_layer(MB.format(ratio=3.0, extra=""), shapes)
    assert gradcheck_layer(layer, [loc, conf, priors, label])
    full, _ = make_layer(MB.format(ratio=3.0, extra="") + " loss_param { normalization: NONE }", shapes)
    num_matches = 3 + 1         # image 0: A, B2, D; image 1: C
    bottoms = [loc, conf, priors, label]
    np.testing.assert_allclose(float(full.forward(bottoms)[0]),
                               num_matches * float(layer.forward(bottoms)[0]), rtol=1e-9)
    loc, conf, priors, label = mb_case(n=1)
    nomine, _ = make_layer(MB.format(ratio=3.0, extra="mining_type: NONE"),
                           [loc.shape, conf.shape, priors.shape, label.shape])
    assert gradcheck_layer(nomine, [loc, conf, priors, label])


def test_multibox_loss_rejects_unimplemented():
    loc, conf, priors, label = mb_case()
    with pytest.raises(NotImplementedError, match="HARD_EXAMPLE"):
        make_layer(MB.format(ratio=3.0, extra="mining_type: HARD_EXAMPLE"),
                   [loc.shape, conf.shape, priors.shape, label.shape])
    with pytest.raises(NotImplementedError, match="LOGISTIC"):
        make_layer(MB.format(ratio=3.0, extra="conf_loss_type: LOGISTIC"),
                   [loc.shape, conf.shape, priors.shape, label.shape])


# -- DetectionEvaluate ------------------------------------------------------------------------
def test_detection_evaluate_by_hand():
    det = torch.tensor([[0, 1, .6] + D,      # overlaps A .5 >= .5 but A already taken: fp
                        [0, 1, .9] + A,      # tp (highest score first)
                        [0, 2, .8] + C,      # no gt of label 2 in image 0: fp
                        [1, 1, .7] + C,      # matches a difficult gt: neither tp nor fp
                        [-1, 0, 0, 0, 0, 0, 0]])[None, None]
    gt = torch.tensor([[0, 1, 0] + A + [0], [1, 1, 0] + C + [1], [1, 2, 0] + A + [0],
                       [-1, 0, 0, 0, 0, 0, 0, 0], [0, 2, 0] + C + [0]])[None, None]   # stops at -1
    layer, tops = make_layer('name: "e" type: "DetectionEvaluate" bottom: "d" bottom: "g" top: "e" '
                             'detection_evaluate_param { num_classes: 3 background_label_id: 0 '
                             'evaluate_difficult_gt: false }', [det.shape, gt.shape])
    assert tops == [(1, 1, 2 + 5, 5)]
    out = layer.forward([det, gt])[0][0, 0].numpy()
    want = [[-1, 1, 1, -1, -1], [-1, 2, 1, -1, -1],          # gt counts (difficult excluded)
            [0, 1, .9, 1, 0], [0, 1, .6, 0, 1], [0, 2, .8, 0, 1], [1, 1, .7, 0, 0], [0, 0, 0, 0, 0]]
    np.testing.assert_allclose(out, want, rtol=1e-6)


# -- MobileNet-SSD end to end ---------------------------------------------------------------
def _init_batchnorm(net):
    for layer in net.layer_list:
        if layer.type == "BatchNorm":     # random nets have zero running stats: use mean 0, var 1
            with torch.no_grad():
                layer.blobs[0].zero_()
                layer.blobs[1].fill_(1)
                layer.blobs[2].fill_(1)


def test_mobilenet_ssd_deploy_runs():
    from brewnet import Net
    from brewnet.proto import caffe_pb2 as pb

    torch.manual_seed(0)
    net = Net(str(MODELS / "mobilenet-ssd" / "deploy.prototxt"), pb.TEST)
    _init_batchnorm(net)
    assert net.blobs["mbox_priorbox"].shape == (1, 2, 1917 * 4)
    net.blobs["data"].data[...] = RNG.normal(size=(1, 3, 300, 300))
    out = net.forward()["detection_out"]
    assert out.shape[:2] == (1, 1) and out.shape[3] == 7 and np.isfinite(out).all()
    det = out[0, 0]
    if det[0, 1] != -1:
        assert (det[:, 2] > 0.25).all() and len(det) <= 100
        assert set(det[:, 1].astype(int)) <= set(range(1, 21))


def test_mobilenet_ssd_train_loss_and_backward():
    from brewnet import Net
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import read_net

    param = swap_data_layers(read_net(str(MODELS / "mobilenet-ssd" / "train.prototxt")),
                             [[[1, 3, 160, 160], [1, 1, 2, 8]]])   # 160: fast, every map >= 1x1
    torch.manual_seed(0)
    net = Net(param, pb.TRAIN)
    _init_batchnorm(net)
    net.blobs["data"].data[...] = RNG.normal(size=(1, 3, 160, 160))
    net.blobs["label"].data[...] = [[[[0, 15, 0, .1, .2, .5, .9, 0], [0, 7, 0, .4, .4, .9, .7, 0]]]]
    loss = net.forward()["mbox_loss"]
    assert np.isfinite(loss) and loss > 0
    net.backward()
    grads = [p for p in net.learnable if p.grad is not None]
    assert grads and all(torch.isfinite(p.grad).all() for p in grads)
