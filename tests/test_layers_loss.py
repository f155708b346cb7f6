"""Loss layers and Accuracy against numpy references and Caffe's C++ test facts; float64 gradient
checks, and numpy copies of Caffe's gradient where it deliberately differs from the derivative."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brewnet.layers.base import LayerError
from brewnet.proto import caffe_pb2 as pb
from helpers import gradcheck_layer, make_layer

RNG = np.random.default_rng(1701)
FLT_MIN = np.finfo(np.float32).tiny


def randn(*shape, std=1.0):
    return torch.tensor(RNG.normal(0, std, shape))


def labels(shape, k, ignore=None, frac=0.0):
    lab = RNG.integers(0, k, shape).astype(np.float64)
    if ignore is not None:
        lab[RNG.random(shape) < frac] = ignore
    return torch.tensor(lab)


def layer_of(kind, bottoms, extra="", tops=("loss",), phase=pb.TRAIN):
    text = (f'name: "l" type: "{kind}" ' + " ".join(f'bottom: "b{i}"' for i in range(len(bottoms)))
            + " " + " ".join(f'top: "{t}"' for t in tops) + " " + extra)
    return make_layer(text, [tuple(b.shape) for b in bottoms], phase)


def loss_and_grads(layer, bottoms, weight=1.0):
    xs = [b.clone().requires_grad_(layer.allow_backward(i)) for i, b in enumerate(bottoms)]
    loss = layer.forward(xs)[0]
    (loss * weight).backward()
    return loss.detach(), [x.grad for x in xs]


# -- SoftmaxWithLoss -------------------------------------------------------------------------------
def softmax_loss_ref(x, lab, axis, ignore, mode):
    """numpy: per position -log(max(p, FLT_MIN)); grad (p - onehot)/normalizer, 0 if ignored."""
    xm = np.moveaxis(x, axis, -1)
    p = np.exp(xm - xm.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lab = lab.reshape(xm.shape[:-1]).astype(int)
    valid = np.ones(lab.shape, bool) if ignore is None else lab != ignore
    safe = np.where(valid, lab, 0)
    picked = np.take_along_axis(p, safe[..., None], -1)[..., 0]
    total = -(np.log(np.maximum(picked, FLT_MIN)) * valid).sum()
    outer = int(np.prod(x.shape[:axis]))
    norm = {"FULL": lab.size, "VALID": valid.sum(), "BATCH_SIZE": outer, "NONE": 1}[mode]
    norm = max(1, norm)
    g = p.copy()
    np.put_along_axis(g, safe[..., None], np.take_along_axis(g, safe[..., None], -1) - 1, -1)
    g *= valid[..., None] / norm
    return total / norm, np.moveaxis(g, -1, axis)


@pytest.mark.parametrize("norm_text,mode", [("normalization: FULL", "FULL"),
                                            ("normalization: VALID", "VALID"),
                                            ("normalization: BATCH_SIZE", "BATCH_SIZE"),
                                            ("normalization: NONE", "NONE"),
                                            ("normalize: true", "VALID"),
                                            ("normalize: false", "BATCH_SIZE"),
                                            ("", "VALID")])
def test_softmax_loss_normalizations(norm_text, mode):
    x, lab = randn(4, 5, 2, 3, std=2), labels((4, 1, 2, 3), 5, ignore=255, frac=0.3)
    layer, tops = layer_of("SoftmaxWithLoss", [x, lab],
                           f"loss_param {{ ignore_label: 255 {norm_text} }}")
    assert tops == [()]
    loss, (gx, gl) = loss_and_grads(layer, [x, lab], weight=2.5)   # loss weight scales diffs
    ref, gref = softmax_loss_ref(x.numpy(), lab.numpy(), 1, 255, mode)
    assert loss.shape == () and gl is None
    np.testing.assert_allclose(loss.item(), ref, rtol=1e-10)
    np.testing.assert_allclose(gx.numpy(), 2.5 * gref, rtol=1e-10, atol=1e-14)


def test_softmax_loss_ignore_label_sum_identity():
    # test_softmax_with_loss_layer.cpp: with normalize false, the losses ignoring each of the 5
    # labels in turn sum to 4x the loss without ignore_label.
    x, lab = randn(10, 5, 2, 3).float(), labels((10, 1, 2, 3), 5).float()
    full = layer_of("SoftmaxWithLoss", [x, lab], "loss_param { normalize: false }")[0].forward([x, lab])[0]
    parts = sum(layer_of("SoftmaxWithLoss", [x, lab], f"loss_param {{ normalize: false "
                         f"ignore_label: {k} }}")[0].forward([x, lab])[0] for k in range(5))
    np.testing.assert_allclose(parts.item(), 4 * full.item(), rtol=1e-4)


def test_softmax_loss_axis2_and_gradcheck():
    x, lab = randn(2, 3, 4), labels((2, 3), 4, ignore=1, frac=0.3)
    layer = layer_of("SoftmaxWithLoss", [x, lab], "softmax_param { axis: -1 } "
                     "loss_param { ignore_label: 1 }")[0]
    loss, (gx, _) = loss_and_grads(layer, [x, lab])
    ref, gref = softmax_loss_ref(x.numpy(), lab.numpy(), 2, 1, "VALID")
    np.testing.assert_allclose(loss.item(), ref, rtol=1e-10)
    np.testing.assert_allclose(gx.numpy(), gref, rtol=1e-10, atol=1e-14)
    assert gradcheck_layer(layer, [x, lab])


def test_softmax_loss_flt_min_clamp_keeps_caffe_gradient():
    x = torch.tensor([[0.0, -200.0, 0.0]], dtype=torch.float32)   # p(label 1) underflows
    lab = torch.tensor([1.0])
    loss, (gx, _) = loss_and_grads(layer_of("SoftmaxWithLoss", [x, lab])[0], [x, lab])
    np.testing.assert_allclose(loss.item(), -np.log(FLT_MIN), rtol=1e-6)
    np.testing.assert_allclose(gx.numpy(), [[0.5, -1.0, 0.5]], atol=1e-7)


def test_softmax_loss_all_ignored_gives_zero():
    x, lab = randn(2, 3), torch.full((2,), 7.0)
    loss, (gx, _) = loss_and_grads(layer_of("SoftmaxWithLoss", [x, lab],
                                            "loss_param { ignore_label: 7 }")[0], [x, lab])
    assert loss.item() == 0 and torch.all(gx == 0)


def test_softmax_loss_prob_top():
    x, lab = randn(3, 4), labels((3,), 4)
    layer, tops = layer_of("SoftmaxWithLoss", [x, lab], tops=("loss", "prob"))
    assert tops == [(), (3, 4)]
    loss, prob = layer.forward([x, lab])
    np.testing.assert_allclose(prob.numpy(), torch.softmax(x, 1).numpy(), rtol=1e-12)
    assert not prob.requires_grad                # Caffe's backward ignores a diff on prob
    assert gradcheck_layer(layer, [x, lab])


def test_softmax_loss_label_count_mismatch():
    with pytest.raises(LayerError, match=r"\(4, 2\)"):
        make_layer('name: "l" type: "SoftmaxWithLoss" bottom: "x" bottom: "y" top: "loss"',
                   [(4, 5, 3), (4, 2)])


# -- SigmoidCrossEntropyLoss -----------------------------------------------------------------------
def sigmoid_ce_ref(x, t, ignore, norm_mode):
    per = -(x * (t - (x >= 0)) - np.log1p(np.exp(x - 2 * x * (x >= 0))))
    valid = np.ones(x.shape, bool) if ignore is None else t.astype(int) != ignore
    norm = {"BATCH_SIZE": x.shape[0], "VALID": valid.sum(), "FULL": x.size}[norm_mode]
    sig = 1 / (1 + np.exp(-x))
    return (per * valid).sum() / max(1, norm), (sig - t) * valid / max(1, norm)


def test_sigmoid_ce_soft_targets_default_batch_size():
    x, t = randn(3, 4, 2, std=3), torch.tensor(RNG.random((3, 4, 2)))
    layer = layer_of("SigmoidCrossEntropyLoss", [x, t])[0]
    loss, (gx, gt) = loss_and_grads(layer, [x, t])
    ref, gref = sigmoid_ce_ref(x.numpy(), t.numpy(), None, "BATCH_SIZE")
    np.testing.assert_allclose(loss.item(), ref, rtol=1e-12)
    np.testing.assert_allclose(gx.numpy(), gref, rtol=1e-10, atol=1e-15)
    assert gt is None
    assert gradcheck_layer(layer, [x, t])


def test_sigmoid_ce_ignore_valid():
    x, t = randn(4, 5, std=3), labels((4, 5), 2, ignore=-1, frac=0.3)
    layer = layer_of("SigmoidCrossEntropyLoss", [x, t],
                     "loss_param { ignore_label: -1 normalization: VALID }")[0]
    loss, (gx, _) = loss_and_grads(layer, [x, t])
    ref, gref = sigmoid_ce_ref(x.numpy(), t.numpy(), -1, "VALID")
    np.testing.assert_allclose(loss.item(), ref, rtol=1e-12)
    np.testing.assert_allclose(gx.numpy(), gref, rtol=1e-10, atol=1e-15)


def test_sigmoid_ce_extreme_scores_stay_finite():
    x, t = torch.tensor([[100.0, -100.0, 0.0]]).double(), torch.tensor([[0.0, 1.0, 1.0]]).double()
    loss, (gx, _) = loss_and_grads(layer_of("SigmoidCrossEntropyLoss", [x, t])[0], [x, t])
    np.testing.assert_allclose(loss.item(), 200 + np.log(2), rtol=1e-12)
    np.testing.assert_allclose(gx.numpy(), [[1.0, -1.0, -0.5]], atol=1e-12)


# -- EuclideanLoss / HingeLoss ---------------------------------------------------------------------
def test_euclidean():
    a, b = randn(4, 3, 2), randn(4, 6)
    layer = layer_of("EuclideanLoss", [a, b])[0]
    loss, (ga, gb) = loss_and_grads(layer, [a, b], weight=2.0)
    d = a.numpy().reshape(4, 6) - b.numpy()
    np.testing.assert_allclose(loss.item(), (d ** 2).sum() / 8, rtol=1e-12)
    np.testing.assert_allclose(ga.numpy().reshape(4, 6), 2 * d / 4, rtol=1e-12)
    np.testing.assert_allclose(gb.numpy(), -2 * d / 4, rtol=1e-12)
    assert gradcheck_layer(layer, [a, b])
    with pytest.raises(LayerError, match=r"\(4, 5\)"):
        layer.reshape([(4, 3, 2), (4, 5)])


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge(norm):
    x, lab = randn(5, 4, std=2), labels((5,), 4)
    layer = layer_of("HingeLoss", [x, lab], f"hinge_loss_param {{ norm: {norm} }}")[0]
    loss, (gx, _) = loss_and_grads(layer, [x, lab])
    s = np.ones((5, 4))
    s[np.arange(5), lab.numpy().astype(int)] = -1
    t = np.maximum(0, 1 + s * x.numpy())
    np.testing.assert_allclose(loss.item(), (t if norm == "L1" else t * t).sum() / 5, rtol=1e-12)
    gref = (np.sign(t) if norm == "L1" else 2 * t) * s / 5
    np.testing.assert_allclose(gx.numpy(), gref, rtol=1e-12)
    assert gradcheck_layer(layer, [x, lab])


# -- InfogainLoss ----------------------------------------------------------------------------------
def infogain_ref(x, lab, h, ignore=None):
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    lab = lab.astype(int)
    valid = np.ones(len(lab), bool) if ignore is None else lab != ignore
    safe = np.where(valid, lab, 0)
    rows = h[safe]
    total = -(rows * np.log(np.maximum(p, 1e-20)) * valid[:, None]).sum()
    n = max(1, valid.sum())
    g = (p * rows.sum(1, keepdims=True) - rows) * valid[:, None] / n
    return total / n, g


def test_infogain_h_bottom_with_ignore():
    x, lab, h = randn(6, 5, std=2), labels((6,), 5, ignore=3, frac=0.3), torch.tensor(RNG.random((1, 1, 5, 5)))
    layer, tops = layer_of("InfogainLoss", [x, lab, h], "loss_param { ignore_label: 3 }",
                           tops=("loss", "prob"))
    assert tops == [(), (6, 5)] and not layer.allow_backward(1) and not layer.allow_backward(2)
    loss, (gx, _, gh) = loss_and_grads(layer, [x, lab, h])
    ref, gref = infogain_ref(x.numpy(), lab.numpy(), h.numpy().reshape(5, 5), 3)
    np.testing.assert_allclose(loss.item(), ref, rtol=1e-10)
    np.testing.assert_allclose(gx.numpy(), gref, rtol=1e-10, atol=1e-14)
    assert gh is None
    assert gradcheck_layer(layer, [x, lab, h])


def test_infogain_prob_top_diff_is_ignored():
    """Caffe's InfogainLoss backward reads only top[0]'s diff: a diff on the prob top (weight 0
    in Caffe, random in the golden harness) adds nothing to the data diff."""
    x, lab, h = randn(4, 5, std=2), labels((4,), 5), torch.tensor(RNG.random((1, 1, 5, 5)))
    layer, _ = layer_of("InfogainLoss", [x, lab, h], tops=("loss", "prob"))
    xg = x.clone().requires_grad_(True)
    loss, prob = layer.forward([xg, lab, h])
    np.testing.assert_allclose(prob.numpy(), torch.softmax(x, 1).numpy(), rtol=1e-12)
    (loss + (prob * RNG.standard_normal(prob.shape)).sum()).backward()
    _, gref = infogain_ref(x.numpy(), lab.numpy(), h.numpy().reshape(5, 5))
    np.testing.assert_allclose(xg.grad.numpy(), gref, rtol=1e-10, atol=1e-14)


def test_infogain_identity_h_equals_softmax_loss(tmp_path):
    # H from a binary BlobProto file; with H = I the loss is SoftmaxWithLoss's.
    blob = pb.BlobProto()
    blob.shape.dim.extend([1, 1, 4, 4])
    blob.data.extend(np.eye(4).ravel().tolist())
    path = tmp_path / "h.binaryproto"
    path.write_bytes(blob.SerializeToString())
    x, lab = randn(2, 4, 3), labels((2, 3), 4)
    info = layer_of("InfogainLoss", [x, lab], f'infogain_loss_param {{ source: "{path}" }}')[0]
    soft = layer_of("SoftmaxWithLoss", [x, lab])[0]
    l1, (g1, _) = loss_and_grads(info, [x, lab])
    l2, (g2, _) = loss_and_grads(soft, [x, lab])
    np.testing.assert_allclose(l1.item(), l2.item(), rtol=1e-12)
    np.testing.assert_allclose(g1.numpy(), g2.numpy(), rtol=1e-10, atol=1e-14)


def test_infogain_errors():
    x, lab, h = randn(2, 3), labels((2,), 3), randn(4, 4)
    with pytest.raises(LayerError, match=r"\(4, 4\)"):
        layer_of("InfogainLoss", [x, lab, h])[0].reshape([(2, 3), (2,), (4, 4)])
    with pytest.raises(LayerError, match="normalize is deprecated"):
        layer_of("InfogainLoss", [x, lab, h], "loss_param { normalize: true }")
    with pytest.raises(LayerError, match="source"):
        layer_of("InfogainLoss", [x, lab])


# -- MultinomialLogisticLoss -----------------------------------------------------------------------
def test_multinomial_logistic():
    p = torch.softmax(randn(4, 5), 1)
    lab = labels((4,), 5)
    layer = layer_of("MultinomialLogisticLoss", [p, lab])[0]
    loss, (gp, _) = loss_and_grads(layer, [p, lab])
    i = lab.numpy().astype(int)
    picked = p.numpy()[np.arange(4), i]
    np.testing.assert_allclose(loss.item(), -np.log(picked).sum() / 4, rtol=1e-12)
    gref = np.zeros((4, 5))
    gref[np.arange(4), i] = -1 / (4 * picked)
    np.testing.assert_allclose(gp.numpy(), gref, rtol=1e-12)
    assert gradcheck_layer(layer, [p, lab])


def test_multinomial_logistic_threshold():
    p, lab = torch.tensor([[0.0, 1.0], [0.5, 0.5]]).double(), torch.tensor([0.0, 1.0])
    loss, (gp, _) = loss_and_grads(layer_of("MultinomialLogisticLoss", [p, lab])[0], [p, lab])
    np.testing.assert_allclose(loss.item(), (-np.log(1e-20) - np.log(0.5)) / 2, rtol=1e-12)
    np.testing.assert_allclose(gp.numpy(), [[-1 / (2 * 1e-20), 0], [0, -1]], rtol=1e-12)


# -- ContrastiveLoss -------------------------------------------------------------------------------
def contrastive_ref(a, b, sim, margin, legacy):
    """numpy copy of Caffe's forward and its backward (d + 1e-4 in the dissimilar branch)."""
    n = len(a)
    diff = a - b
    d2 = (diff ** 2).sum(1)
    d = np.sqrt(d2)
    loss, coef = 0.0, np.zeros(n)
    for i in range(n):
        if sim[i]:
            loss, coef[i] = loss + d2[i], 1
        elif legacy:
            loss += max(margin - d2[i], 0)
            coef[i] = -1 if margin - d2[i] > 0 else 0
        else:
            loss += max(margin - d[i], 0) ** 2
            coef[i] = -(margin - d[i]) / (d[i] + 1e-4) if margin - d[i] > 0 else 0
    return loss / n / 2, coef[:, None] * diff / n


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_matches_caffe_formula(legacy):
    a, b = randn(8, 3, 1, 1, std=0.4), randn(8, 3, 1, 1, std=0.4)
    b[0] = a[0] + 1e-3           # a dissimilar pair at tiny distance: 1/(d + 1e-4) != 1/d
    sim = torch.tensor([0, 1, 0, 1, 0, 0, 1, 0], dtype=torch.float64).reshape(8, 1, 1, 1)
    layer = layer_of("ContrastiveLoss", [a, b, sim],
                     f"contrastive_loss_param {{ margin: 1.5 legacy_version: {str(legacy).lower()} }}")[0]
    loss, (ga, gb, gs) = loss_and_grads(layer, [a, b, sim])
    ref, gref = contrastive_ref(a.numpy().reshape(8, 3), b.numpy().reshape(8, 3),
                                sim.numpy().ravel(), 1.5, legacy)
    np.testing.assert_allclose(loss.item(), ref, rtol=1e-12)
    np.testing.assert_allclose(ga.numpy().reshape(8, 3), gref, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(gb.numpy().reshape(8, 3), -gref, rtol=1e-10, atol=1e-15)
    assert gs is None
    if not legacy:               # the epsilon is visible: exact derivative differs by ~10%
        exact = -(1.5 - 1e-3 * np.sqrt(3)) / (1e-3 * np.sqrt(3)) * (a - b).numpy()[0, :, 0, 0] / 8
        assert not np.allclose(ga.numpy()[0, :, 0, 0], exact, rtol=1e-2)


def test_contrastive_legacy_gradcheck():
    # legacy_version's backward is the exact derivative (away from the margin kink).
    a, b = randn(6, 4, std=0.3), randn(6, 4, std=0.3)
    sim = torch.tensor([1.0, 0, 1, 0, 0, 1])
    layer = layer_of("ContrastiveLoss", [a, b, sim], "contrastive_loss_param { legacy_version: true }")[0]
    assert gradcheck_layer(layer, [a, b, sim])


# -- Accuracy --------------------------------------------------------------------------------------
def accuracy_ref(x, lab, top_k, ignore=None):
    correct, total, k = 0, 0, x.shape[1]
    hits, seen = np.zeros(k), np.zeros(k)
    for i in range(len(lab)):
        y = int(lab[i])
        if y == ignore:
            continue
        total += 1
        seen[y] += 1
        if sum(x[i, c] >= x[i, y] for c in range(k) if c != y) < top_k:
            correct += 1
            hits[y] += 1
    return correct / max(total, 1), total, np.where(seen > 0, hits / np.maximum(seen, 1), 0)


def test_accuracy_top3_ignore_counts_97():
    # test_accuracy_layer.cpp: 100x10 data, top_k 3, ignore_label -1 at indices 2, 5, 32.
    x, lab = randn(100, 10).float(), labels((100,), 10).float()
    lab[[2, 5, 32]] = -1
    layer, tops = layer_of("Accuracy", [x, lab], "accuracy_param { top_k: 3 ignore_label: -1 }",
                           tops=("acc", "per_class"))
    assert tops == [(), (10,)] and not layer.allow_backward(0)
    acc, per_class = layer.forward([x, lab])
    ref, total, per_ref = accuracy_ref(x.numpy(), lab.numpy(), 3, -1)
    assert total == 97
    np.testing.assert_allclose(acc.item(), ref, rtol=1e-6)
    np.testing.assert_allclose(per_class.numpy(), per_ref, rtol=1e-6)


def test_accuracy_spatial_axis1():
    x, lab = randn(2, 10, 4, 5).float(), labels((2, 4, 5), 10).float()
    acc = layer_of("Accuracy", [x, lab], "accuracy_param { top_k: 2 }", tops=("acc",))[0].forward([x, lab])[0]
    xm = np.moveaxis(x.numpy(), 1, -1).reshape(-1, 10)
    np.testing.assert_allclose(acc.item(), accuracy_ref(xm, lab.numpy().ravel(), 2)[0], rtol=1e-6)


def test_accuracy_ties_count_against():
    x, lab = torch.ones(3, 4), torch.tensor([0.0, 1.0, 3.0])
    layer = layer_of("Accuracy", [x, lab], tops=("acc",))[0]
    assert layer.forward([x, lab])[0].item() == 0
    layer = layer_of("Accuracy", [x, lab], "accuracy_param { top_k: 4 }", tops=("acc",))[0]
    assert layer.forward([x, lab])[0].item() == 1


def test_accuracy_errors():
    with pytest.raises(LayerError, match="top_k 5"):
        make_layer('name: "a" type: "Accuracy" bottom: "x" bottom: "y" top: "a" '
                   'accuracy_param { top_k: 5 }', [(3, 4), (3,)])
    with pytest.raises(LayerError, match="number of labels"):
        make_layer('name: "a" type: "Accuracy" bottom: "x" bottom: "y" top: "a"', [(3, 4, 2), (3, 4)])


FIRST_DIM_CASES = [("SoftmaxWithLoss", [(4, 3), (4,)]), ("SigmoidCrossEntropyLoss", [(4, 3), (4, 3)]),
                   ("EuclideanLoss", [(4, 3), (4, 3)]), ("HingeLoss", [(4, 3), (4,)]),
                   ("MultinomialLogisticLoss", [(4, 3), (4,)]), ("InfogainLoss", [(4, 3), (4,), (3, 3)]),
                   ("ContrastiveLoss", [(4, 3), (4, 3), (4,)])]


@pytest.mark.parametrize("kind,shapes", FIRST_DIM_CASES, ids=[k for k, _ in FIRST_DIM_CASES])
def test_loss_first_dims_must_match(kind, shapes):
    bottoms = " ".join(f'bottom: "b{i}"' for i in range(len(shapes)))
    layer, tops = make_layer(f'name: "l" type: "{kind}" {bottoms} top: "l"', shapes)
    assert layer.is_loss and tops == [()]
    bad = [(5,) + tuple(shapes[1][1:])]
    with pytest.raises(LayerError, match="first dimension"):
        layer.reshape([shapes[0]] + bad + list(shapes[2:]))
