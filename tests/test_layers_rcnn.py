"""The R-CNN family of the forks (brewnet/layers/rcnn.py) against the forks' own formulas:
ROIPooling and SmoothL1Loss of rbgirshick/caffe-fast-rcnn (faster-rcnn branch), PSROIPooling of
daijifeng001/caffe-rfcn, Proposal = py-faster-rcnn's lib/rpn/proposal_layer.py. References are
per-element loops written from the forks' C++/CUDA/Python (not brewnet's vectorised code), hand
values, and OpenCV's dnn (ROIPooling, PSROIPooling, Proposal: brewnet writes the caffemodel).
Also: a Python layer's top shapes set in setup stand, and ``rpn.proposal_layer`` runs on the
built-in Proposal when it is not importable."""
from __future__ import annotations

import logging
import math
import sys

import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet.layers.rcnn import generate_anchors
from tests.helpers import VENDORED, gradcheck_layer, make_layer

F32 = np.float32
VENDORED_PY = VENDORED / "forks" / "py_faster_rcnn"


def c_round(v):
    return math.floor(v + 0.5) if v >= 0 else -math.floor(-v + 0.5)


# -- references: the forks' loops -----------------------------------------------------------
def roi_pool_ref(x, rois, ph_, pw_, scale):
    """caffe-fast-rcnn ROIPoolingLayer::Forward_cpu, element by element (float32 math)."""
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph_, pw_), F32)
    arg = -np.ones(out.shape, np.int64)
    for r, (b, x1, y1, x2, y2) in enumerate(rois):
        sw, sh = c_round(F32(x1) * F32(scale)), c_round(F32(y1) * F32(scale))
        ew, eh = c_round(F32(x2) * F32(scale)), c_round(F32(y2) * F32(scale))
        rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
        bh, bw = F32(rh) / F32(ph_), F32(rw) / F32(pw_)
        for ch in range(c):
            for i in range(ph_):
                for j in range(pw_):
                    hs = min(max(int(math.floor(F32(i) * bh)) + sh, 0), h)
                    he = min(max(int(math.ceil(F32(i + 1) * bh)) + sh, 0), h)
                    ws = min(max(int(math.floor(F32(j) * bw)) + sw, 0), w)
                    we = min(max(int(math.ceil(F32(j + 1) * bw)) + sw, 0), w)
                    best, where = -np.inf, -1
                    for yy in range(hs, he):
                        for xx in range(ws, we):
                            if x[int(b), ch, yy, xx] > best:
                                best, where = x[int(b), ch, yy, xx], yy * w + xx
                    out[r, ch, i, j] = 0 if where < 0 else best
                    arg[r, ch, i, j] = where
    return out, arg


def psroi_ref(x, rois, dim, g, scale):
    """caffe-rfcn PSROIPoolingForward, element by element (float32 math)."""
    n, c, h, w = x.shape
    out = np.zeros((len(rois), dim, g, g), F32)
    s = F32(scale)
    for r, (b, x1, y1, x2, y2) in enumerate(rois):
        sw, sh = F32(c_round(x1)) * s, F32(c_round(y1)) * s
        ew, eh = F32(c_round(x2) + 1.0) * s, F32(c_round(y2) + 1.0) * s
        rw, rh = F32(max(ew - sw, 0.1)), F32(max(eh - sh, 0.1))
        bh, bw = rh / F32(g), rw / F32(g)
        for d in range(dim):
            for i in range(g):
                for j in range(g):
                    hs = min(max(math.floor(F32(i) * bh + sh), 0), h)
                    he = min(max(math.ceil(F32(i + 1) * bh + sh), 0), h)
                    ws = min(max(math.floor(F32(j) * bw + sw), 0), w)
                    we = min(max(math.ceil(F32(j + 1) * bw + sw), 0), w)
                    ch = (d * g + i) * g + j
                    area = (he - hs) * (we - ws)
                    if he > hs and we > ws:
                        out[r, d, i, j] = x[int(b), ch, hs:he, ws:we].sum(dtype=np.float64) / area
    return out


ROIS = np.array([[0, 1.2, 2.5, 30.3, 40.1],     # inside
                 [1, -3, 4, 70, 50],             # past the right/bottom edges
                 [0, 10, 10, 10, 10],            # one pixel
                 [1, 2, 6, 0.5, 3]], F32)        # inverted corners: clamped to one cell


# -- ROIPooling -----------------------------------------------------------------------------
def test_roi_pooling_hand_case():
    # 4x4 map 0..15, box (0,0)-(3,3) at scale 1 into 2x2 bins of 2x2 cells: the bin maxima.
    x = torch.arange(16, dtype=torch.float32).reshape(1, 1, 4, 4)
    layer, tops = make_layer('type: "ROIPooling" top: "p" roi_pooling_param { pooled_h: 2 pooled_w: 2 }',
                             [(1, 1, 4, 4), (1, 5)])
    assert tops == [(1, 1, 2, 2)]
    (y,) = layer.forward([x, torch.tensor([[0, 0, 0, 3, 3.]])])
    assert y.tolist() == [[[[5, 7], [13, 15]]]]
    # C's round: 0.5 -> 1, 2.5 -> 3, so rows/cols 1..3 in bins of 1.5 cells: [1, 2] and [2, 3]
    # (numpy's half-to-even, 0 and 2, would give [[5, 6], [9, 10]]).
    (y,) = layer.forward([x, torch.tensor([[0, 0.5, 0.5, 2.5, 2.5]])])
    assert y.tolist() == [[[[10, 11], [14, 15]]]]


def test_roi_pooling_matches_the_fork_loop_and_sends_gradient_to_its_argmax():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 9, 11)).astype(F32)
    x[0, 0, :3, :3] = 0.5   # ties: the fork keeps the first in row-major order
    layer, tops = make_layer('type: "ROIPooling" top: "p" roi_pooling_param { pooled_h: 3 pooled_w: 2 '
                             'spatial_scale: 0.25 }', [x.shape, ROIS.shape])
    xt = torch.from_numpy(x).requires_grad_(True)
    (y,) = layer.forward([xt, torch.from_numpy(ROIS)])
    ref, arg = roi_pool_ref(x, ROIS, 3, 2, 0.25)
    np.testing.assert_array_equal(y.detach().numpy(), ref)
    g = rng.standard_normal(ref.shape).astype(F32)
    y.backward(torch.from_numpy(g))
    want = np.zeros_like(x)
    for r, ch, i, j in np.ndindex(*ref.shape):
        if arg[r, ch, i, j] >= 0:
            want[int(ROIS[r, 0]), ch].reshape(-1)[arg[r, ch, i, j]] += g[r, ch, i, j]
    np.testing.assert_allclose(xt.grad.numpy(), want, rtol=0, atol=1e-6)


def test_roi_pooling_at_inference_takes_adaptive_pooling_where_its_bins_agree(monkeypatch):
    """No gradient: a box inside the map whose float32 bins are adaptive pooling's integer ones
    is pooled by torch's kernel; every box keeps the fork loop's values (many boxes: inside,
    past the edges, tiny, inverted; ties), and a NaN gives what the gradient path gives."""
    import torch.nn.functional as F

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 19, 23)).astype(F32)
    x[1, 2, 5:9, 5:9] = 0.25
    corners = rng.uniform(-20, 110, (60, 4)).astype(F32)
    rois = np.concatenate([rng.integers(0, 2, (60, 1)).astype(F32), corners], 1)
    rois = np.concatenate([rois, ROIS, [[0, 0, 0, 87, 71], [1, 8, 8, 47, 39]]]).astype(F32)
    calls = []
    real = F.adaptive_max_pool2d
    monkeypatch.setattr(F, "adaptive_max_pool2d", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer, _ = make_layer('type: "ROIPooling" top: "p" roi_pooling_param { pooled_h: 3 pooled_w: 4 '
                          'spatial_scale: 0.25 }', [x.shape, rois.shape])
    with torch.no_grad():
        (y,) = layer.forward([torch.from_numpy(x), torch.from_numpy(rois)])
    ref, _ = roi_pool_ref(x, rois, 3, 4, 0.25)
    np.testing.assert_array_equal(y.numpy(), ref)
    assert 5 <= len(calls) < len(rois)
    # 57 cells in 7 bins: float32's ceil(7 * 57/7) is 58, one cell past the box (the fork reads
    # it; adaptive pooling's bins stop at 57): not taken there
    wide = np.zeros((1, 1, 2, 60), F32)
    wide[..., 57] = 100
    layer7, _ = make_layer('type: "ROIPooling" top: "p" roi_pooling_param { pooled_h: 1 pooled_w: 7 }',
                           [wide.shape, (1, 5)])
    with torch.no_grad():
        (y7,) = layer7.forward([torch.from_numpy(wide), torch.tensor([[0, 0, 0, 56, 1.]])])
    assert y7[0, 0, 0, -1] == 100 == roi_pool_ref(wide, np.array([[0, 0, 0, 56, 1]], F32), 1, 7, 1)[0][0, 0, 0, -1]
    x[0, 1, 3, 4] = np.nan      # (the fork's loop skips a NaN; brewnet's maxima keep it, both ways)
    with torch.no_grad():
        (y,) = layer.forward([torch.from_numpy(x), torch.from_numpy(rois)])
    (g,) = layer.forward([torch.from_numpy(x).requires_grad_(True), torch.from_numpy(rois)])
    np.testing.assert_array_equal(y.numpy(), g.detach().numpy())
    assert np.isnan(y.numpy()).any()


def test_roi_pooling_gradient_check():
    x = torch.randn(1, 2, 6, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    layer, _ = make_layer('type: "ROIPooling" top: "p" roi_pooling_param { pooled_h: 2 pooled_w: 3 '
                          'spatial_scale: 0.5 }', [(1, 2, 6, 7), (2, 5)])
    rois = torch.tensor([[0, 0, 0, 12, 10], [0, 2, 3, 7, 9.]], dtype=torch.float64)
    assert gradcheck_layer(layer, [x, rois])


# -- PSROIPooling ---------------------------------------------------------------------------
def test_psroi_pooling_matches_the_fork_loop_and_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 2 * 9, 9, 11)).astype(F32)
    layer, tops = make_layer('type: "PSROIPooling" top: "p" psroi_pooling_param { output_dim: 2 '
                             'group_size: 3 spatial_scale: 0.25 }', [x.shape, ROIS.shape])
    assert tops == [(4, 2, 3, 3)]
    (y,) = layer.forward([torch.from_numpy(x), torch.from_numpy(ROIS)])
    np.testing.assert_allclose(y.numpy(), psroi_ref(x, ROIS, 2, 3, 0.25), rtol=1e-6, atol=1e-6)
    xd = torch.from_numpy(x[:, :8, :4, :5]).double()
    layer, _ = make_layer('type: "PSROIPooling" top: "p" psroi_pooling_param { output_dim: 2 '
                          'group_size: 2 spatial_scale: 0.5 }', [xd.shape, (2, 5)])
    rois = torch.tensor([[0, 0, 0, 9, 7], [1, 3, 2, 8, 9.]], dtype=torch.float64)
    assert gradcheck_layer(layer, [xd, rois])


def test_psroi_pooling_needs_its_required_fields():
    with pytest.raises(caffe.layers.LayerError, match="group_size is required"):
        make_layer('type: "PSROIPooling" top: "p" psroi_pooling_param { output_dim: 2 spatial_scale: 1 }',
                   [(1, 8, 4, 4), (1, 5)])


# -- SmoothL1Loss ---------------------------------------------------------------------------
def test_smooth_l1_loss_hand_values_and_gradient():
    # sigma 2: quadratic below |x| = 1/4. d = w_in (a - b) = [0.1, -0.5, 1, 0], w_out = [1, 2, 1, 3]
    a = torch.tensor([[0.1, -0.5, 2.0, 7.0]])
    b = torch.tensor([[0.0, 0.0, 1.5, 7.0]])
    w_in = torch.tensor([[1.0, 1.0, 2.0, 1.0]])
    w_out = torch.tensor([[1.0, 2.0, 1.0, 3.0]])
    layer, tops = make_layer('type: "SmoothL1Loss" top: "l" smooth_l1_loss_param { sigma: 2 }',
                             [(1, 4)] * 4)
    assert tops == [()]
    (loss,) = layer.forward([a, b, w_in, w_out])
    want = 0.5 * 4 * 0.01 + 2 * (0.5 - 0.125) + (1 - 0.125) + 0
    assert loss.item() == pytest.approx(want, rel=1e-6)
    rng = np.random.default_rng(4)
    bot = [torch.from_numpy(rng.standard_normal((3, 4, 2, 2))) for _ in range(2)]
    bot += [torch.from_numpy(rng.uniform(0.5, 2, (3, 4, 2, 2))) for _ in range(2)]
    layer, _ = make_layer('type: "SmoothL1Loss" top: "l" smooth_l1_loss_param { sigma: 3 }', [(3, 4, 2, 2)] * 4)
    assert gradcheck_layer(layer, bot)
    assert not layer.allow_backward(2) and not layer.allow_backward(3)
    with pytest.raises(caffe.layers.LayerError, match="inside and outside"):
        make_layer('type: "SmoothL1Loss" top: "l"', [(1, 4)] * 3)


# -- Proposal -------------------------------------------------------------------------------
def test_anchors_are_py_faster_rcnns():
    # The docstring of py-faster-rcnn's lib/rpn/generate_anchors.py lists the MATLAB (1-based)
    # anchors, each coordinate one more than what its Python code returns. By hand, ratio 0.5
    # scale 8: the 16x16 box has centre 7.5; width round(sqrt(256 / 0.5)) = 23, height
    # round(23 * 0.5) = 12, scaled by 8: 184 x 96 -> 7.5 -/+ 91.5, 7.5 -/+ 47.5.
    want = np.array([[-83, -39, 100, 56], [-175, -87, 192, 104], [-359, -183, 376, 200],
                     [-55, -55, 72, 72], [-119, -119, 136, 136], [-247, -247, 264, 264],
                     [-35, -79, 52, 96], [-79, -167, 96, 184], [-167, -343, 184, 360]]) - 1
    assert generate_anchors()[0].tolist() == [-84, -40, 99, 55]
    np.testing.assert_array_equal(generate_anchors(), want)


def rpn_inputs(seed=0, a=9, h=6, w=8):
    rng = np.random.default_rng(seed)
    s = rng.uniform(0, 1, (1, 2 * a, h, w)).astype(F32)
    d = (rng.standard_normal((1, 4 * a, h, w)) * 0.2).astype(F32)
    return s, d, np.array([[h * 16, w * 16, 1.0]], F32)


def rpn_net(params, tops=('rois', 'sc'), a=9, h=6, w=8):
    head = (f'name: "rpn" layer {{ name: "s" type: "Input" top: "s" input_param {{ shape {{ dim: 1 dim: {2 * a} '
            f'dim: {h} dim: {w} }} }} }}\n'
            f'layer {{ name: "d" type: "Input" top: "d" input_param {{ shape {{ dim: 1 dim: {4 * a} dim: {h} '
            f'dim: {w} }} }} }}\n'
            'layer { name: "im" type: "Input" top: "im" input_param { shape { dim: 1 dim: 3 } } }\n')
    t = " ".join(f'top: "{x}"' for x in tops)
    return head + f'layer {{ name: "p" bottom: "s" bottom: "d" bottom: "im" {t} {params} }}\n'


def test_proposal_hand_case():
    # One anchor (ratio 1, scale 1: the 16x16 box 0..15) on a 1x2 map, stride 16: anchors at
    # x 0..15 and 16..31. The fork decodes about x1 + w / 2 (8, not 7.5), so zero deltas give
    # 0..16 (y clipped to rows - 1 = 15); the second is moved by dx = 0.25 (4 px) and grown by
    # exp(log 2) = 2 in width: centre 24 + 4, width 32 -> x 12..44, clipped to cols - 1 = 31.
    net = caffe.Net(rpn_net('type: "Proposal" proposal_param { feat_stride: 16 ratio: 1 scale: 1 '
                            'min_size: 4 nms_thresh: 0.7 }', a=1, h=1, w=2), caffe.TEST)
    d = np.zeros((1, 4, 1, 2), F32)
    d[0, 0, 0, 1], d[0, 2, 0, 1] = 0.25, math.log(2)
    net.forward(s=np.array([[[[0.9, 0.1]], [[0.2, 0.8]]]], F32), d=d,
                im=np.array([[16, 32, 1]], F32))
    np.testing.assert_allclose(net.blobs["rois"].data, [[0, 12, 0, 31, 15], [0, 0, 0, 16, 15]],
                               atol=1e-5)
    np.testing.assert_allclose(net.blobs["sc"].data, [[0.8], [0.2]])


def test_proposal_drops_boxes_under_min_size():
    # min_size 20: the first box (0..16, 17 px) goes (OpenCV would keep it); the second, doubled
    # in both sides about (24, 8), is x 8..40, y -8..24 clipped to 0..24 (25 px): kept.
    net = caffe.Net(rpn_net('type: "Proposal" proposal_param { feat_stride: 16 ratio: 1 scale: 1 '
                            'min_size: 20 }', a=1, h=1, w=2), caffe.TEST)
    d = np.zeros((1, 4, 1, 2), F32)
    d[0, 2, 0, 1] = d[0, 3, 0, 1] = math.log(2)
    net.forward(s=np.full((1, 2, 1, 2), 0.5, F32), d=d, im=np.array([[64, 64, 1]], F32))
    np.testing.assert_allclose(net.blobs["rois"].data, [[0, 8, 0, 40, 24]], atol=1e-5)
    net.forward(s=np.full((1, 2, 1, 2), 0.5, F32), d=d, im=np.array([[64, 64, 2]], F32))
    assert net.blobs["rois"].data.shape == (0, 5)   # min size scales with im_info[2]


def test_proposal_matches_opencv(tmp_path):
    cv2 = pytest.importorskip("cv2")
    # min_size 0: OpenCV does not filter small boxes (the fork does); otherwise the same layer.
    # OpenCV needs ratio and scale spelled out (py-faster-rcnn's defaults).
    text = rpn_net('type: "Proposal" proposal_param { feat_stride: 16 min_size: 0 pre_nms_topn: 100 '
                   'post_nms_topn: 20 nms_thresh: 0.6 ratio: 0.5 ratio: 1 ratio: 2 scale: 8 scale: 16 '
                   'scale: 32 }')
    s, d, im = rpn_inputs()
    net = caffe.Net(text, caffe.TEST)
    net.forward(s=s, d=d, im=im)
    (tmp_path / "n.prototxt").write_text(text)
    net.save(str(tmp_path / "n.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "n.prototxt"), str(tmp_path / "n.caffemodel"))
    for k, v in dict(s=s, d=d, im=im).items():
        cv.setInput(v, k)
    theirs = cv.forward("p").reshape(-1, 5)
    ours = net.blobs["rois"].data
    assert 1 < len(ours) <= len(theirs) and not theirs[len(ours):].any()   # OpenCV pads with zeros
    # float32 decoding in another order: an ulp of coordinates up to 128
    np.testing.assert_allclose(ours, theirs[:len(ours)], rtol=0, atol=3e-5)


PY_PROPOSAL = ('type: "Python" python_param { module: "rpn.proposal_layer" layer: "ProposalLayer" '
               "param_str: \"'feat_stride': 16\" }")


def test_python_proposal_layer_runs_on_the_builtin(caplog):
    assert "rpn" not in sys.modules
    s, d, im = rpn_inputs(5)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        py = caffe.Net(rpn_net(PY_PROPOSAL), caffe.TEST)
        caffe.Net(rpn_net(PY_PROPOSAL), caffe.TEST)
    said = [r for r in caplog.records if "rpn.proposal_layer" in r.getMessage()]
    assert len(said) <= 1   # once per process (an earlier test may have said it)
    built = caffe.Net(rpn_net('type: "Proposal" proposal_param { feat_stride: 16 pre_nms_topn: 6000 '
                              'post_nms_topn: 300 min_size: 16 nms_thresh: 0.7 }'), caffe.TEST)
    py.forward(s=s, d=d, im=im)
    built.forward(s=s, d=d, im=im)
    assert py.blobs["rois"].data.shape[0] > 1
    np.testing.assert_array_equal(py.blobs["rois"].data, built.blobs["rois"].data)
    # ROIPooling downstream sees every proposal
    with pytest.raises(caffe.layers.LayerError, match="param_str"):
        caffe.Net(rpn_net(PY_PROPOSAL.replace("feat_stride", "stride")), caffe.TEST)


class FixedShapeLayer:
    """A pycaffe layer shaping its top only in setup, as py-faster-rcnn's proposal layer."""

    def __init__(self, param):
        pass

    def setup(self, bottom, top):
        top[0].reshape(1, 5)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        top[0].data[...] = 3
        if bottom[0].data.sum() > 0:
            top[0].reshape(4, 5)
            top[0].data[...] = 7


def test_python_layer_top_shape_from_setup_stands():
    text = ('name: "p" layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
            f'layer {{ name: "f" type: "Python" bottom: "x" top: "r" python_param {{ module: "{__name__}" '
            'layer: "FixedShapeLayer" } }\n')
    net = caffe.Net(text, caffe.TEST)
    assert net.blobs["r"].data.shape == (1, 5)
    net.forward(x=np.zeros(2, F32))
    assert (net.blobs["r"].data == 3).all() and net.blobs["r"].data.shape == (1, 5)
    net.forward(x=np.ones(2, F32))
    assert net.blobs["r"].data.shape == (4, 5) and (net.blobs["r"].data == 7).all()


# -- OpenCV --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["ROIPooling", "PSROIPooling"])
def test_roi_layers_match_opencv(kind, tmp_path):
    cv2 = pytest.importorskip("cv2")
    ch, param = ((3, 'roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.25 }')
                 if kind == "ROIPooling" else
                 (18, 'psroi_pooling_param { output_dim: 2 group_size: 3 spatial_scale: 0.25 }'))
    text = (f'name: "t" layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 2 dim: {ch} '
            'dim: 9 dim: 11 } } }\n'
            'layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 4 dim: 5 } } }\n'
            f'layer {{ name: "p" type: "{kind}" bottom: "x" bottom: "rois" top: "p" {param} }}\n')
    x = np.random.default_rng(7).standard_normal((2, ch, 9, 11)).astype(F32)
    net = caffe.Net(text, caffe.TEST)
    net.forward(x=x, rois=ROIS)
    (tmp_path / "n.prototxt").write_text(text)
    net.save(str(tmp_path / "n.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "n.prototxt"), str(tmp_path / "n.caffemodel"))
    cv.setInput(x, "x")
    cv.setInput(ROIS, "rois")
    np.testing.assert_allclose(net.blobs["p"].data, cv.forward("p"), rtol=0, atol=2e-6)


def test_dropout_scale_train_false_scales_test_output():
    # caffe-fast-rcnn's DropoutLayer: TEST multiplies by 1 / scale_ = 1 - ratio; TRAIN keeps
    # the kept values unscaled.
    x = torch.full((1000,), 2.0)
    p = 'type: "Dropout" top: "y" dropout_param { dropout_ratio: 0.25 scale_train: false }'
    layer, _ = make_layer(p, [(1000,)])
    (y,) = layer.forward([x])
    assert (y == np.float32(2 * np.float32(1 / np.float32(1 / np.float32(0.75))))).all()
    layer, _ = make_layer(p, [(1000,)], phase=caffe.TRAIN)
    (y,) = layer.forward([x])
    assert set(y.unique().tolist()) == {0.0, 2.0}
    layer, _ = make_layer(p.replace("false", "true"), [(1000,)])
    assert (layer.forward([x])[0] == 2).all()


# -- py-faster-rcnn's own Python layer as the reference ------------------------------------
PY_SHIMS = {   # what py-faster-rcnn's lib provides around its proposal layer, minimal
    "caffe.py": "from brewnet import Layer  # noqa: F401\n",
    "fast_rcnn/__init__.py": "",
    "fast_rcnn/config.py": (
        "class _C(dict):\n    __getattr__ = dict.__getitem__\n"
        "TRAIN = _C(RPN_PRE_NMS_TOP_N=12000, RPN_POST_NMS_TOP_N=2000, RPN_NMS_THRESH=0.7, RPN_MIN_SIZE=16)\n"
        "TEST = _C(RPN_PRE_NMS_TOP_N=6000, RPN_POST_NMS_TOP_N=300, RPN_NMS_THRESH=0.7, RPN_MIN_SIZE=16)\n"
        # str(phase) is 'TRAIN'/'TEST' in the fork's pycaffe, '0'/'1' here
        "cfg = _C(TRAIN=TRAIN, TEST=TEST, **{'0': TRAIN, '1': TEST})\n"),
    "fast_rcnn/nms_wrapper.py": "from py_cpu_nms import py_cpu_nms as nms  # noqa: F401\n",
    "rpn/__init__.py": "",
}


def test_builtin_proposal_equals_py_faster_rcnns_python_layer(tmp_path, monkeypatch):
    # py-faster-rcnn's lib/rpn/proposal_layer.py itself (tests/data/forks/py_faster_rcnn, py3
    # print/xrange/yaml edits only), run through brewnet's Python layer, against the built-in.
    src = VENDORED_PY
    for rel, text in PY_SHIMS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for name, dest in (("proposal_layer.py", "rpn"), ("generate_anchors.py", "rpn"),
                       ("bbox_transform.py", "fast_rcnn"), ("py_cpu_nms.py", ".")):
        (tmp_path / dest / name).write_text((src / name).read_text())
    for p in (tmp_path, tmp_path / "rpn"):
        monkeypatch.syspath_prepend(str(p))
    for m in [m for m in sys.modules if m == "caffe" or m.split(".")[0] in ("rpn", "fast_rcnn")]:
        monkeypatch.delitem(sys.modules, m)
    pytest.importorskip("yaml")
    s, d, _ = rpn_inputs(9, h=12, w=14)
    fork = caffe.Net(rpn_net(PY_PROPOSAL, h=12, w=14), caffe.TEST)
    assert sys.modules["rpn.proposal_layer"].__file__.startswith(str(tmp_path))   # the fork's own ran
    ours = caffe.Net(rpn_net('type: "Proposal" proposal_param { feat_stride: 16 }', h=12, w=14), caffe.TEST)
    for net in (fork, ours):
        net.forward(s=s, d=d, im=np.array([[150, 200, 1.5]], F32))
    assert fork.blobs["rois"].data.shape[0] > 10
    np.testing.assert_array_equal(ours.blobs["rois"].data, fork.blobs["rois"].data)
    np.testing.assert_array_equal(ours.blobs["sc"].data, fork.blobs["sc"].data)
    monkeypatch.undo()
    for m in [m for m in sys.modules if m == "caffe" or m.split(".")[0] in ("rpn", "fast_rcnn")]:
        del sys.modules[m]
