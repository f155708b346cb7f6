"""The segmentation forks' layers against their own formulas: Interp (DeepLab v2 / PSPNet
src/caffe/util/interp.cpp, transcribed as a loop; and OpenCV's Interp), Upsample (SegNet's
upsample_layer.cpp with Pooling's mask; the YOLO ports' nearest upsample), BN (SegNet's and
PSPNet's bn_layer.cpp, numpy in float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet.proto import caffe_pb2 as pb
from tests.helpers import gradcheck_layer, make_layer

F32 = np.float32


def interp_ref(x, ho, wo):
    """caffe_cpu_interp2 (not packed) over each plane, float32 as the fork."""
    n, c, h, w = x.shape
    if (h, w) == (ho, wo):
        return x.copy()
    rh = F32(h - 1) / F32(ho - 1) if ho > 1 else F32(0)
    rw = F32(w - 1) / F32(wo - 1) if wo > 1 else F32(0)
    out = np.zeros((n, c, ho, wo), F32)
    for i in range(ho):
        h1r = F32(rh * F32(i))
        h1 = int(h1r)
        hp = 1 if h1 < h - 1 else 0
        l1 = F32(h1r - F32(h1))
        l0 = F32(1) - l1
        for j in range(wo):
            w1r = F32(rw * F32(j))
            w1 = int(w1r)
            wp = 1 if w1 < w - 1 else 0
            m1 = F32(w1r - F32(w1))
            m0 = F32(1) - m1
            out[:, :, i, j] = (l0 * (m0 * x[:, :, h1, w1] + m1 * x[:, :, h1, w1 + wp])
                               + l1 * (m0 * x[:, :, h1 + hp, w1] + m1 * x[:, :, h1 + hp, w1 + wp]))
    return out


INTERP = [  # (param text, input HxW, output HxW)
    ("zoom_factor: 8", (5, 6), (33, 41)),
    ("shrink_factor: 2", (9, 10), (5, 5)),
    ("shrink_factor: 2 zoom_factor: 3", (9, 10), (13, 13)),
    ("height: 7 width: 1", (4, 5), (7, 1)),
    ("zoom_factor: 2 pad_beg: -1 pad_end: -1", (6, 7), (7, 9)),
]


@pytest.mark.parametrize("param,hw,out", INTERP)
def test_interp_matches_the_fork_loop(param, hw, out):
    x = np.random.default_rng(0).standard_normal((2, 3) + hw).astype(F32)
    layer, tops = make_layer(f'type: "Interp" top: "y" interp_param {{ {param} }}', [x.shape])
    assert tops == [(2, 3) + out]
    (y,) = layer.forward([torch.from_numpy(x)])
    p = layer.param.interp_param
    crop = x[:, :, -p.pad_beg: hw[0] + p.pad_end, -p.pad_beg: hw[1] + p.pad_end]
    np.testing.assert_allclose(y.numpy(), interp_ref(crop, *out), rtol=0, atol=3e-6)


def test_interp_gradient_and_errors():
    layer, tops = make_layer('type: "Interp" top: "y" interp_param { height: 7 width: 6 }', [(1, 2, 3, 4)])
    assert tops == [(1, 2, 7, 6)]
    assert gradcheck_layer(layer, [torch.randn(1, 2, 3, 4, dtype=torch.float64)])
    with pytest.raises(caffe.layers.LayerError, match="needs zoom_factor"):
        make_layer('type: "Interp" top: "y"', [(1, 1, 4, 4)])
    with pytest.raises(caffe.layers.LayerError, match="non-positive pad_beg"):
        make_layer('type: "Interp" top: "y" interp_param { zoom_factor: 2 pad_beg: 1 }', [(1, 1, 4, 4)])


# OpenCV's Interp reads zoom_factor or height/width only (shrink_factor gives it a 0x0 output).
@pytest.mark.parametrize("param,hw,out", [INTERP[0], INTERP[3]])
def test_interp_matches_opencv(param, hw, out, tmp_path):
    cv2 = pytest.importorskip("cv2")
    text = (f'name: "i" layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 1 dim: 3 '
            f'dim: {hw[0]} dim: {hw[1]} }} }} }}\n'
            f'layer {{ name: "y" type: "Interp" bottom: "x" top: "y" interp_param {{ {param} }} }}\n')
    x = np.random.default_rng(1).standard_normal((1, 3) + hw).astype(F32)
    net = caffe.Net(text, caffe.TEST)
    net.forward(x=x)
    (tmp_path / "i.prototxt").write_text(text)
    net.save(str(tmp_path / "i.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "i.prototxt"), str(tmp_path / "i.caffemodel"))
    cv.setInput(x, "x")
    np.testing.assert_allclose(net.blobs["y"].data, cv.forward("y"), rtol=0, atol=3e-6)


# -- Upsample -------------------------------------------------------------------------------
SEGNET = """name: "seg"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 5 dim: 6 } } }
layer { name: "pool" type: "Pooling" bottom: "x" top: "p" top: "mask"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Upsample" bottom: "p" bottom: "mask" top: "u"
        upsample_param { scale: 2 pad_out_h: true } }
"""


def test_segnet_upsample_puts_each_max_back_where_it_was():
    x = np.random.default_rng(2).standard_normal((1, 2, 5, 6)).astype(F32)
    net = caffe.Net(SEGNET, caffe.TEST)
    # Caffe pools 5x6 to 3x3 (ceil); pad_out_h: 3 * 2 - 1 = 5 rows, 3 * 2 = 6 columns
    assert net.blobs["u"].data.shape == (1, 2, 5, 6)
    net.forward(x=x)
    want = np.zeros_like(x)
    mask = net.blobs["mask"].data.astype(int)
    pooled = net.blobs["p"].data
    for c in range(2):
        want[0, c].reshape(-1)[mask[0, c].reshape(-1)] = pooled[0, c].reshape(-1)
    np.testing.assert_array_equal(net.blobs["u"].data, want)
    # each value is a maximum of x at its own position
    kept = want != 0
    np.testing.assert_array_equal(want[kept], x[kept])


def test_segnet_upsample_repeated_index_last_wins_and_backward_gathers():
    layer, tops = make_layer('type: "Upsample" top: "u" upsample_param { upsample_h: 2 upsample_w: 2 }',
                             [(1, 1, 1, 3), (1, 1, 1, 3)])
    assert tops == [(1, 1, 2, 2)]
    x = torch.tensor([[[[1.0, 2.0, 3.0]]]], requires_grad=True)
    mask = torch.tensor([[[[3.0, 0.0, 3.0]]]])
    (u,) = layer.forward([x, mask])
    assert u.tolist() == [[[[2.0, 0.0], [0.0, 3.0]]]]   # index 3 written by 1 then by 3
    u.backward(torch.tensor([[[[10.0, 20.0], [30.0, 40.0]]]]))
    assert x.grad.tolist() == [[[[40.0, 10.0, 40.0]]]]  # the fork reads top_diff[mask[i]] for every i
    with pytest.raises(caffe.layers.LayerError, match="out of range"):
        layer.forward([x, torch.tensor([[[[4.0, 0.0, 1.0]]]])])


def test_segnet_upsample_runs_in_the_lean_graph():
    """The mask's range check reads values into Python: it is left out of the traced graph
    (ENet ran eager for it; a bad index would fail in the scatter there, and the graph's guard
    run the call eagerly, which names it): Pooling's mask in the graph, the eager outputs."""
    from brewnet.execution import lean
    from brewnet.pycaffe import Net

    net, eager = Net(SEGNET, caffe.TEST), Net(SEGNET, caffe.TEST, engine="eager")
    x = np.random.default_rng(4).standard_normal((1, 2, 5, 6)).astype(F32)
    for _ in range(lean.AFTER + 2):
        got = net.forward(x=x)["u"].copy()
    assert net._lean.gm is not None and net._lean.guard.off is None
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        np.testing.assert_array_equal(got, eager.forward(x=x)["u"])


def test_segnet_upsample_gradient_check():
    layer, _ = make_layer('type: "Upsample" top: "u" upsample_param { scale: 2 }', [(2, 3, 2, 3)] * 2)
    mask = torch.stack([torch.randperm(24)[:6] for _ in range(6)]).reshape(2, 3, 2, 3).double()
    assert gradcheck_layer(layer, [torch.randn(2, 3, 2, 3, dtype=torch.float64), mask])


def test_yolo_upsample_is_nearest():
    layer, tops = make_layer('type: "Upsample" top: "u" upsample_param { scale: 2 }', [(1, 1, 2, 2)])
    assert tops == [(1, 1, 4, 4)]
    (u,) = layer.forward([torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])])
    assert u.tolist() == [[[[1, 1, 2, 2], [1, 1, 2, 2], [3, 3, 4, 4], [3, 3, 4, 4]]]]
    assert gradcheck_layer(layer, [torch.randn(1, 1, 2, 2, dtype=torch.float64)])
    _, tops = make_layer('type: "Upsample" top: "u"', [(1, 1, 2, 2)])
    assert tops == [(1, 1, 2, 2)]   # the YOLO ports' UpsampleParameter.scale defaults to 1


# -- BN -------------------------------------------------------------------------------------
def _bn(param, x_shape, phase=caffe.TEST):
    return make_layer(f'type: "BN" top: "y" bn_param {{ {param} }}', [x_shape], phase=phase)


def test_pspnet_bn_test_and_train_against_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 5))
    slope, bias, mean, var = (rng.standard_normal((1, 3, 1, 1)) for _ in range(4))
    var = np.abs(var) + 0.5
    layer, tops = _bn("eps: 1e-4", x.shape)
    assert [tuple(b.shape) for b in layer.blobs] == [(1, 3, 1, 1)] * 4
    for b, v in zip(layer.blobs, (slope, bias, mean, var)):
        b.data.copy_(torch.from_numpy(v))
    (y,) = layer.forward([torch.from_numpy(x).float()])
    want = (x - mean) / np.sqrt(var + np.float32(1e-4)) * slope + bias
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-5, atol=1e-5)
    layer, _ = _bn("momentum: 0.9", x.shape, phase=caffe.TRAIN)
    for b, v in zip(layer.blobs, (slope, bias, mean, var)):
        b.data.copy_(torch.from_numpy(v))
    (y,) = layer.forward([torch.from_numpy(x).float()])
    bm, bv = x.mean((0, 2, 3), keepdims=True), x.var((0, 2, 3), keepdims=True)
    np.testing.assert_allclose(y.detach().numpy(), (x - bm) / np.sqrt(bv + 1e-5) * slope + bias,
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.blobs[2].detach().numpy(), 0.1 * bm + 0.9 * mean, rtol=1e-5)
    np.testing.assert_allclose(layer.blobs[3].detach().numpy(), 0.1 * bv + 0.9 * var, rtol=1e-5)


def test_pspnet_bn_gradients_train_and_frozen():
    x = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    layer, _ = _bn('slope_filler { type: "gaussian" } bias_filler { type: "gaussian" }', x.shape,
                   phase=caffe.TRAIN)
    assert gradcheck_layer(layer, [x])   # batch statistics: the output does not read blobs 2, 3
    layer.blobs = [b.detach().double().requires_grad_(True) for b in layer.blobs]
    layer.forward([x.requires_grad_(True)])[0].sum().backward()
    assert layer.blobs[2].grad is None and layer.blobs[3].grad is None
    # frozen: stored statistics in TRAIN too, variance initialised to 1, slope/bias not learned
    frozen, _ = _bn("frozen: true", x.shape, phase=caffe.TRAIN)
    assert not any(b.requires_grad for b in frozen.blobs) and (frozen.blobs[3] == 1).all()
    frozen.blobs[0].data.fill_(2)
    y = frozen.forward([x.float()])[0]
    np.testing.assert_allclose(y.detach().numpy(), 2 * x.detach().numpy() / np.sqrt(1 + 1e-5), rtol=1e-5)


def test_segnet_bn_learn_and_inference_against_numpy():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4, 5))
    scale, shift = rng.standard_normal((1, 3, 1, 1)), rng.standard_normal((1, 3, 1, 1))
    for mode, phase in (("LEARN", caffe.TEST), ("INFERENCE", caffe.TRAIN)):
        layer, _ = _bn(f"bn_mode: {mode}", x.shape, phase=phase)
        assert len(layer.blobs) == 2 and tuple(layer.blobs[0].shape) == (1, 3, 1, 1)
        for b, v in zip(layer.blobs, (scale, shift)):
            b.data.copy_(torch.from_numpy(v))
        (y,) = layer.forward([torch.from_numpy(x).float()])
        if mode == "LEARN":   # batch statistics in every phase, var = E[x^2] - E[x]^2, eps 1e-9
            m = x.mean((0, 2, 3), keepdims=True)
            v = (x * x).mean((0, 2, 3), keepdims=True) - m * m
            want = (x - m) / np.sqrt(v + 1e-9) * scale + shift
        else:
            want = x * scale + shift
        np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-4, atol=1e-5)
    layer, _ = _bn('scale_filler { type: "constant" value: 1 }', (2, 3, 2, 2), phase=caffe.TRAIN)
    layer.blobs = [b.detach().double().requires_grad_(True) for b in layer.blobs]
    assert gradcheck_layer(layer, [torch.randn(2, 3, 2, 2, dtype=torch.float64)])
    assert layer.param.bn_param.bn_mode == pb.BNParameter.LEARN
