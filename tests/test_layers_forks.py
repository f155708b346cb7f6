"""The MobileNet/ShuffleNet/SENet/YOLO forks' layers against their own formulas (loops written
from the forks' C++: mini-caffe's conv_dw_layer.cpp, farmingyard/ShuffleNet's
shuffle_channel_layer.cpp, hujie-frank/SENet's axpy_layer.cpp, eric612/MobileNet-YOLO's
relu6_layer.cpp and reorg_layer.hpp, Darknet's region layer) and OpenCV's dnn where it runs the
type the same way (ReLU6, ShuffleChannel, Reorg, ConvolutionDepthwise on maps > 1 pixel)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import brewnet as caffe
from tests.helpers import gradcheck_layer, make_layer

F32 = np.float32


def opencv_run(tmp_path, layers, shapes, outs, seed=0, scale=4.0):
    """brewnet and OpenCV on one net (random params and inputs); returns (ours, theirs) dicts."""
    cv2 = pytest.importorskip("cv2")
    head = "".join(f'layer {{ name: "{k}" type: "Input" top: "{k}" input_param {{ shape {{ '
                   + " ".join(f"dim: {d}" for d in s) + " } } }\n" for k, s in shapes.items())
    text = 'name: "t"\n' + head + layers
    rng = np.random.default_rng(seed)
    net = caffe.Net(text, caffe.TEST)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.data.shape)
    inputs = {k: (rng.standard_normal(s) * scale).astype(F32) for k, s in shapes.items()}
    net.forward(**inputs)
    (tmp_path / "m.prototxt").write_text(text)
    net.save(str(tmp_path / "m.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "m.prototxt"), str(tmp_path / "m.caffemodel"))
    for k, v in inputs.items():
        cv.setInput(v, k)
    theirs = dict(zip(outs, cv.forward(outs)))
    return {o: net.blobs[o].data.copy() for o in outs}, theirs, net, inputs


# -- depthwise convolution -----------------------------------------------------------------
def conv_dw_ref(x, w, b, stride, pad):
    """mini-caffe's ConvolutionDepthwiseLayer::Forward_cpu: one filter per channel."""
    n, c, h, wd = x.shape
    k = w.shape[-1]
    ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    out = np.zeros((n, c, ho, wo), np.float64)
    for i in range(ho):
        for j in range(wo):
            for kh in range(k):
                for kw in range(k):
                    hi, wi = i * stride - pad + kh, j * stride - pad + kw
                    if 0 <= hi < h and 0 <= wi < wd:
                        out[:, :, i, j] += w[:, 0, kh, kw] * x[:, :, hi, wi]
    return out + b.reshape(1, -1, 1, 1)


@pytest.mark.parametrize("kind", ["ConvolutionDepthwise", "DepthwiseConvolution"])
@pytest.mark.parametrize("hw", [(5, 6), (1, 1)])
def test_depthwise_convolution_is_the_forks_per_channel_filter(kind, hw):
    # ConvolutionDepthwise ignores num_output/group (one filter per channel whatever they say);
    # DepthwiseConvolution is a Convolution with the prototxt's group.
    param = "num_output: 4 group: 4" if kind == "DepthwiseConvolution" else "num_output: 7"
    layer, tops = make_layer(f'type: "{kind}" top: "y" convolution_param {{ {param} kernel_size: 3 '
                             'pad: 1 stride: 2 weight_filler { type: "gaussian" } '
                             'bias_filler { type: "gaussian" } }', [(2, 4) + hw])
    assert [tuple(b.shape) for b in layer.blobs] == [(4, 1, 3, 3), (4,)]
    x = np.random.default_rng(1).standard_normal((2, 4) + hw).astype(F32)
    (y,) = layer.forward([torch.from_numpy(x)])
    w, b = (t.detach().numpy() for t in layer.blobs)
    np.testing.assert_allclose(y.detach().numpy(), conv_dw_ref(x, w, b, 2, 1), rtol=1e-5, atol=1e-5)
    if hw == (1, 1) and kind == "ConvolutionDepthwise":
        # float64 convolutions take brewnet's thread-invariant path (~0.1 s each): inputs only
        # here, the weight gradient is Convolution's (tests/test_layers_vision.py)
        assert gradcheck_layer(layer, [torch.from_numpy(x).double()], check_params=False)


def test_convolution_depthwise_matches_opencv(tmp_path):
    # OpenCV runs ConvolutionDepthwise (not DepthwiseConvolution). On a 1x1 input its result
    # differs from the fork's (the test above checks the fork's formula there); on 5x6 they agree.
    ours, theirs, _, _ = opencv_run(tmp_path, 'layer { name: "r" type: "ConvolutionDepthwise" '
                                    'bottom: "x" top: "r" convolution_param { num_output: 4 group: 4 '
                                    'kernel_size: 3 pad: 1 } }\n', {"x": (2, 4, 5, 6)}, ["r"])
    np.testing.assert_allclose(ours["r"], theirs["r"], rtol=0, atol=2e-5 * 4 * max(1, np.abs(theirs["r"]).max()))


# -- ReLU6 ----------------------------------------------------------------------------------
def test_relu6_formula_kinks_and_gradient():
    layer, _ = make_layer('type: "ReLU6" top: "y" relu6_param { negative_slope: 0.1 }', [(6,)])
    x = torch.tensor([-2.0, 0.0, 3.0, 6.0, 7.0, 5.999], requires_grad=True)
    (y,) = layer.forward([x])
    np.testing.assert_allclose(y.detach().numpy(), [-0.2, 0, 3, 6, 6, 5.999], rtol=1e-6)
    y.sum().backward()
    # the fork: (x > 0) + slope * (x <= 0), times (x < 6)
    np.testing.assert_allclose(x.grad.numpy(), [np.float32(0.1), np.float32(0.1), 1, 0, 0, 1])
    assert gradcheck_layer(layer, [torch.tensor([-2.0, 0.5, 3.0, 6.5, 7.0, 5.5], dtype=torch.float64)])


# -- ShuffleChannel -------------------------------------------------------------------------
def test_shuffle_channel_order_and_gradient():
    layer, _ = make_layer('type: "ShuffleChannel" top: "y" shuffle_channel_param { group: 2 }', [(1, 6, 1, 1)])
    x = torch.arange(6.0).reshape(1, 6, 1, 1)
    (y,) = layer.forward([x])
    # the fork: output channel j * group + i <- input channel i * (C / group) + j
    assert y.reshape(-1).tolist() == [0, 3, 1, 4, 2, 5]
    assert gradcheck_layer(layer, [torch.randn(2, 6, 2, 3, dtype=torch.float64)])
    with pytest.raises(caffe.layers.LayerError, match="multiple of group"):
        make_layer('type: "ShuffleChannel" top: "y" shuffle_channel_param { group: 4 }', [(1, 6, 1, 1)])


# -- Axpy -----------------------------------------------------------------------------------
def test_axpy_formula_and_gradient():
    # SENet's Axpy: top = a * x + y, a per (n, c). (OpenCV's importer rejects these shapes, so
    # the fork's formula is the reference.)
    rng = np.random.default_rng(2)
    a, x, y = rng.standard_normal((2, 3, 1, 1)), rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    layer, tops = make_layer('type: "Axpy" top: "z"', [a.shape, x.shape, y.shape])
    assert tops == [(2, 3, 4, 5)]
    (z,) = layer.forward([torch.from_numpy(v) for v in (a, x, y)])
    np.testing.assert_allclose(z.numpy(), a * x + y, rtol=1e-12)
    assert gradcheck_layer(layer, [torch.from_numpy(v) for v in (a, x, y)])
    layer, _ = make_layer('type: "Axpy" top: "z"', [(2, 3), x.shape, y.shape])   # a as (N, C)
    with pytest.raises(caffe.layers.LayerError, match="needs a"):
        make_layer('type: "Axpy" top: "z"', [(2, 3, 2, 2), x.shape, y.shape])


# -- Reorg ----------------------------------------------------------------------------------
def reorg_ref(x, s, reverse):
    """MobileNet-YOLO's reorg_cpu(bottom, W, H, C, N, stride, forward = reverse, top)."""
    n, c, h, w = x.shape
    tc, tw, th = c // (s * s), w * s, h * s
    src, out = x.reshape(-1), np.zeros(x.size, x.dtype)
    for b in range(n):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    bi = i + w * (j + h * (k + c * b))
                    c2, off = k % tc, k // tc
                    ti = (i * s + off % s) + tw * ((j * s + off // s) + th * (c2 + tc * b))
                    if reverse:
                        out[ti] = src[bi]
                    else:
                        out[bi] = src[ti]
    return out


@pytest.mark.parametrize("reverse", [False, True])
def test_reorg_is_the_forks_index_rule(reverse):
    shape = (2, 8, 4, 6)
    x = np.random.default_rng(3).standard_normal(shape).astype(F32)
    layer, tops = make_layer(f'type: "Reorg" top: "y" reorg_param {{ stride: 2 reverse: {str(reverse).lower()} }}',
                             [shape])
    assert tops == [(2, 2, 8, 12)] if reverse else [(2, 32, 2, 3)]
    (y,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_array_equal(y.numpy().reshape(-1), reorg_ref(x, 2, reverse))
    assert gradcheck_layer(layer, [torch.from_numpy(x).double()])


# -- Region ---------------------------------------------------------------------------------
def test_region_outputs_by_hand():
    # 1 anchor (2 x 3 cells), 2 classes, on a 1x2 map; all logits 0 except those set below.
    layer, tops = make_layer('type: "Region" top: "r" region_param { classes: 2 num: 1 anchors: 2 '
                             'anchors: 3 thresh: 0.2 }', [(1, 7, 1, 2)])
    assert tops == [(1, 2, 7)]
    x = torch.zeros(1, 7, 1, 2)
    x[0, 2, 0, 1] = np.log(2.0)      # tw: width doubled
    x[0, 4, 0, 1] = 100.0            # objectness ~1
    x[0, 5, 0, 1] = np.log(3.0)      # class 0 three times as likely as class 1
    (r,) = layer.forward([x])
    # cell 0: x = (0 + 0.5) / 2, y = 0.5, w = 2 / 2, h = 3, obj 0.5, classes 0.25 each (> 0.2)
    np.testing.assert_allclose(r[0, 0].numpy(), [0.25, 0.5, 1.0, 3.0, 0.5, 0.25, 0.25], rtol=1e-6)
    # cell 1: x = 1.5 / 2, w = 2 * 2 / 2; classes 0.75 and 0.25 (> 0.2, kept)
    np.testing.assert_allclose(r[0, 1].numpy(), [0.75, 0.5, 2.0, 3.0, 1.0, 0.75, 0.25], rtol=1e-6)
    layer, _ = make_layer('type: "Region" top: "r" region_param { classes: 2 num: 1 anchors: 2 '
                          'anchors: 3 thresh: 0.3 }', [(1, 7, 1, 2)])
    np.testing.assert_allclose(layer.forward([x])[0][0, :, 5:].numpy(), [[0, 0], [0.75, 0]], rtol=1e-6)
    assert gradcheck_layer(layer, [torch.randn(1, 7, 2, 2, dtype=torch.float64)])


# -- OpenCV ---------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,shapes", [
    ('layer { name: "r" type: "ReLU6" bottom: "x" top: "r" }\n', {"x": (2, 3, 4, 5)}),
    ('layer { name: "r" type: "ShuffleChannel" bottom: "x" top: "r" shuffle_channel_param { group: 3 } }\n',
     {"x": (2, 6, 4, 5)}),
    ('layer { name: "r" type: "Reorg" bottom: "x" top: "r" reorg_param { stride: 2 } }\n', {"x": (2, 8, 4, 6)}),
], ids=["ReLU6", "ShuffleChannel", "Reorg"])
def test_routing_and_neuron_forks_match_opencv(layers, shapes, tmp_path):
    ours, theirs, _, _ = opencv_run(tmp_path, layers, shapes, ["r"])
    np.testing.assert_array_equal(ours["r"], theirs["r"])


# -- Yolov3DetectionOutput ------------------------------------------------------------------
YOLO3 = ('type: "Yolov3DetectionOutput" top: "d" yolov3_detection_output_param { num_classes: 2 '
         'num_box: 1 confidence_threshold: 0.3 nms_threshold: {nms} biases: 32 biases: 64 '
         'anchors_scale: 32 mask_group_num: 1 mask: 0 }')


def test_yolov3_detection_output_by_hand():
    # grid 1x2 (input 64x32 at anchors_scale 32), one 32x64-pixel anchor, 2 classes. Cell 0: all
    # logits 0 -> scores 0.5 * 0.5 = 0.25 (under 0.3). Cell 1: objectness and class 0 logits
    # 100 (-> 1), class 1 logit 0 (-> 0.5). Box of cell 1: x = (1 + 0.5) / 2, y = 0.5 / 1,
    # w = 32 / (2 * 32), h = 64 / (1 * 32).
    x = torch.zeros(1, 7, 1, 2)
    x[0, 4, 0, 1] = x[0, 5, 0, 1] = 100.0
    layer, tops = make_layer(YOLO3.replace("{nms}", "0.45"), [(1, 7, 1, 2)])
    assert tops == [(1, 1, 1, 7)]
    (d,) = layer.forward([x])
    # class 1's box is the same box at 0.5: class-agnostic NMS removes it
    np.testing.assert_allclose(d.reshape(-1, 7).numpy(), [[0, 1, 1, 0.5, -0.5, 1.0, 1.5]], atol=1e-6)
    layer, _ = make_layer(YOLO3.replace("{nms}", "1.01"), [(1, 7, 1, 2)])
    np.testing.assert_allclose(layer.forward([x])[0].reshape(-1, 7).numpy(),
                               [[0, 1, 1, 0.5, -0.5, 1.0, 1.5], [0, 2, 0.5, 0.5, -0.5, 1.0, 1.5]], atol=1e-6)
    (none,) = layer.forward([torch.zeros(1, 7, 1, 2)])
    assert none.tolist() == [[[[0, -1, -1, -1, -1, -1, -1]]]]


def _port_nms_rows(boxes, classes, scores, thr):
    """The port's sort and NMS, loop by loop: every later box's IoU with each kept one."""
    order = np.argsort(-scores, kind="stable")
    boxes, classes, scores = boxes[order], classes[order], scores[order]
    gone = np.zeros(len(boxes), bool)
    for i in range(len(boxes) - 1):
        if gone[i]:
            continue
        for j in range(i + 1, len(boxes)):
            a, b = boxes[i], boxes[j]
            # np.minimum: a NaN edge gives a NaN IoU (never suppresses), as brewnet always did
            w = (np.minimum(a[0] + a[2] / 2, b[0] + b[2] / 2)
                 - np.maximum(a[0] - a[2] / 2, b[0] - b[2] / 2))
            h = (np.minimum(a[1] + a[3] / 2, b[1] + b[3] / 2)
                 - np.maximum(a[1] - a[3] / 2, b[1] - b[3] / 2))
            inter = np.float32(0) if w < 0 or h < 0 else w * h
            with np.errstate(invalid="ignore", divide="ignore"):
                gone[j] |= inter / (a[2] * a[3] + b[2] * b[3] - inter) >= np.float32(thr)
    b = boxes[~gone]
    return np.stack([np.zeros(len(b)), classes[~gone] + 1, scores[~gone], b[:, 0] - b[:, 2] / 2,
                     b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2],
                    1).astype(np.float32)


@pytest.mark.parametrize("thr", [0.0, 0.45, 1.0])
def test_yolo_nms_keeps_the_ports_boxes_bit_for_bit(thr):
    """The packed NMS (only boxes still alive, only those overlapping in x above a zero
    threshold) against the port's loop, on candidates with tied scores, duplicate, empty and
    NaN boxes: the same rows, the same bits."""
    from brewnet.layers.yolo import yolo_output

    rng = np.random.default_rng(int(thr * 100))
    for trial in range(40):
        m = int(rng.integers(1, 300))
        boxes = rng.random((m, 4)).astype(np.float32) * np.float32([1, 1, 0.4, 0.4])
        boxes[rng.integers(0, m, m // 4)] = boxes[rng.integers(0, m, m // 4)]
        boxes[rng.integers(0, m, 2), 2] = 0
        if trial % 4 == 0:
            boxes[rng.integers(0, m, 2), 1] = np.nan
        scores = np.round(rng.random(m), 2).astype(np.float32)
        classes = rng.integers(0, 5, m)
        with np.errstate(invalid="ignore", divide="ignore"):
            got = yolo_output(boxes, classes, scores, thr).reshape(-1, 7).numpy()
        want = _port_nms_rows(boxes, classes, scores, thr)
        np.testing.assert_array_equal(got, want)


def test_yolo_detection_output_by_hand():
    # YOLOv2: 2x2 grid, one anchor of 1 x 2 cells, 2 classes. Cell (row 1, column 0): objectness
    # and class-0 logits large (score ~1); the rest: obj 0.5 x softmax 0.5 = 0.25 (< 0.3).
    layer, tops = make_layer('type: "YoloDetectionOutput" top: "d" yolo_detection_output_param { '
                             'num_classes: 2 num_box: 1 confidence_threshold: 0.3 biases: 1 biases: 2 }',
                             [(1, 7, 2, 2)])
    assert tops == [(1, 1, 1, 7)]
    x = torch.zeros(1, 7, 2, 2)
    x[0, 4, 1, 0] = x[0, 5, 1, 0] = 100.0
    (d,) = layer.forward([x])
    # x = (0 + 0.5) / 2, y = (1 + 0.5) / 2, w = 1 / 2, h = 2 / 2
    np.testing.assert_allclose(d.reshape(-1, 7).numpy(), [[0, 1, 1, 0.0, 0.25, 0.5, 1.25]], atol=1e-6)
    with pytest.raises(caffe.layers.LayerError, match="S, S"):
        make_layer('type: "YoloDetectionOutput" top: "d" yolo_detection_output_param { num_classes: 2 '
                   'num_box: 1 biases: 1 biases: 2 }', [(1, 7, 2, 3)])
