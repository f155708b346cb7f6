"""Real fork nets (tests/data/forks, see PROVENANCE.md) build with the forks' shapes and run, and
caffemodels cross between brewnet's schema and a fork's own (PSPNet's caffe.proto, compiled here
from the vendored excerpt): the fork reads brewnet's weights with its blob shapes (BN as
(1, C, 1, 1)), and a file the fork wrote loads in brewnet with the same outputs."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import brewnet as caffe
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import read_net
from tests.helpers import VENDORED, fork_pb2

FORKS = VENDORED / "forks"
F32 = np.float32


def subnet(net, inputs: dict, start: str, stop: str | None = None) -> str:
    """The layers of fork net ``net`` (a NetParameter) from layer ``start`` up to layer ``stop``
    that are computable from ``inputs`` (blob -> shape), fed by Input layers."""
    out = pb.NetParameter(name=net.name)
    for name, shape in inputs.items():
        lp = out.layer.add(name=name, type="Input", top=[name])
        lp.input_param.shape.add().dim.extend(shape)
    have = set(inputs)
    names = [lp.name for lp in net.layer]
    for lp in net.layer[names.index(start):]:
        if lp.name == stop:
            break
        if lp.type != "Input" and lp.bottom and set(lp.bottom) <= have:
            out.layer.append(lp)
            have.update(lp.top)
    return text_format.MessageToString(out)


def fill(net, rng, scale=0.1):
    """Random params; BatchNorm/BN statistics that keep activations in range."""
    for name, blobs in net.params.items():
        kind = net.layer_dict[name].type
        for i, b in enumerate(blobs):
            v = rng.standard_normal(b.data.shape) * scale
            if kind == "BatchNorm":
                v = [np.zeros, lambda s: np.ones(s), lambda s: np.ones(s)][i](b.data.shape)
            elif kind == "BN" and i == 3:
                v = np.abs(v) + 1
            elif kind == "BN" and i == 0:
                v = v + 1
            b.data[...] = v


def test_faster_rcnn_zf_runs_its_python_proposal_on_the_builtin():
    net = caffe.Net(str(FORKS / "faster_rcnn_zf_test.prototxt"), caffe.TEST)
    rng = np.random.default_rng(0)
    fill(net, rng, 0.01)
    assert net.layer_dict["proposal"].type == "Python"
    net.blobs["data"].reshape(1, 3, 160, 160)   # a smaller image than the prototxt's, for speed
    net.forward(data=(rng.standard_normal((1, 3, 160, 160)) * 50).astype(F32),
                im_info=np.array([[160, 160, 1]], F32))
    rois = net.blobs["rois"].data
    r = len(rois)
    assert 1 < r <= 300 and (rois[:, 0] == 0).all()                          # TEST's post-NMS top-N
    assert (rois[:, 1:] >= 0).all() and (rois[:, 1:] <= 159).all()         # clipped to the image
    assert ((rois[:, 3] - rois[:, 1] + 1 >= 16) & (rois[:, 4] - rois[:, 2] + 1 >= 16)).all()
    assert net.blobs["roi_pool_conv5"].data.shape == (r, 256, 6, 6)
    assert net.blobs["cls_prob"].data.shape == (r, 21)
    np.testing.assert_allclose(net.blobs["cls_prob"].data.sum(1), 1, rtol=1e-5)
    assert net.blobs["bbox_pred"].data.shape == (r, 84)
    drop6 = next(lp for lp in read_net(str(FORKS / "faster_rcnn_zf_test.prototxt")).layer if lp.name == "drop6")
    assert drop6.dropout_param.scale_train is False   # parsed; its TEST scaling: test_layers_rcnn


def yolo2_ref(v, p):
    """MobileNet-YOLO's YoloDetectionOutputLayer::Forward_cpu candidates, element by element:
    (label, score, xmin, ymin, xmax, ymax) before its sort and NMS."""
    s = v.shape[-1]
    v = v.reshape(p.num_box, 5 + p.num_classes, s, s).astype(np.float64)
    out = []
    for j in range(s):
        for i in range(s):
            for n in range(p.num_box):
                t = v[n, :, j, i]
                sig = 1 / (1 + np.exp(-t[:5]))
                e = np.exp(t[5:] - t[5:].max())
                prob = e / e.sum()
                c = int(np.argmax(prob))
                score = sig[4] * prob[c]
                if score >= p.confidence_threshold:
                    x, y = (i + sig[0]) / s, (j + sig[1]) / s
                    w, h = np.exp(t[2]) * p.biases[2 * n] / s, np.exp(t[3]) * p.biases[2 * n + 1] / s
                    out.append((c + 1, score, x - w / 2, y - h / 2, x + w / 2, y + h / 2))
    return np.array(out)


def test_yolov2_darknet19_passthrough_and_detections(tmp_path):
    cv2 = pytest.importorskip("cv2")
    # The real prototxt's layers from conv13 and conv20 on (the passthrough: Concat, conv21,
    # Reorg, Concat, conv22, conv23, YoloDetectionOutput) at an 8x8 / 4x4 grid; the backbone
    # before them is plain Caffe. OpenCV (no YoloDetectionOutput) checks up to conv23.
    head = read_net(str(FORKS / "yolov2_darknet19_deploy.prototxt"))
    text = subnet(head, {"conv13": (1, 512, 8, 8), "conv20": (1, 1024, 4, 4)}, "concat1")
    net = caffe.Net(text, caffe.TEST)
    assert {"Reorg", "YoloDetectionOutput"} <= {l.type for l in net.layer_list}
    assert net.blobs["reorg1"].data.shape == (1, 256, 4, 4)
    rng = np.random.default_rng(1)
    fill(net, rng, 0.02)
    # conv23's objectness and first-class biases up, so that many boxes pass the 0.3 threshold
    net.params["conv23_indoor"][1].data[4::25] = net.params["conv23_indoor"][1].data[5::25] = 3
    x = {"conv13": rng.standard_normal((1, 512, 8, 8)).astype(F32),
         "conv20": rng.standard_normal((1, 1024, 4, 4)).astype(F32)}
    net.forward(**x)
    spec = read_net(text)
    conv23, det = spec.layer[-2], spec.layer[-1]
    del spec.layer[-1]
    (tmp_path / "y.prototxt").write_text(text_format.MessageToString(spec))
    net.save(str(tmp_path / "y.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "y.prototxt"), str(tmp_path / "y.caffemodel"))
    for k, v in x.items():
        cv.setInput(v, k)
    theirs = cv.forward(conv23.name)
    ours = net.blobs[conv23.top[0]].data
    assert ours.shape == theirs.shape == (1, 125, 4, 4)
    # sums of ~10^4 products in another order, over a few layers: test_opencv_oracle's ATOL_MODEL
    assert np.abs(ours - theirs).max() <= 2e-4 * max(1, np.abs(theirs).max())
    ref = yolo2_ref(ours, det.yolo_detection_output_param)
    out = net.blobs[det.top[0]].data.reshape(-1, 7)
    assert len(ref) > 1 and 0 < len(out) < len(ref)   # NMS removed overlapping ones
    assert (out[:, 0] == 0).all() and (np.diff(out[:, 2]) <= 0).all()
    assert out[0, 2] == pytest.approx(ref[:, 1].max(), rel=1e-6)
    for row in out:
        assert (np.abs(ref - row[1:]).max(1) < 1e-4).any(), row


def test_pspnet_pyramid_head_builds_with_the_forks_shapes_and_runs():
    # PSPNet50's layers from conv5_3_pool1 up to its concat (the pyramid pooling module:
    # Pooling, Convolution, BN, ReLU, Interp), on conv5_3's real shape.
    text = subnet(read_net(str(FORKS / "pspnet50_ADE20K_473.prototxt")), {"conv5_3": (1, 2048, 60, 60)},
                  "conv5_3_pool1", "conv5_4")
    net = caffe.Net(text, caffe.TEST)
    kinds = {l.type for l in net.layer_list}
    assert {"BN", "Interp", "Pooling", "Concat"} <= kinds
    assert [tuple(b.data.shape) for b in net.params["conv5_3_pool1_conv/bn"]] == [(1, 512, 1, 1)] * 4
    for k in (1, 2, 3, 6):
        assert net.blobs[f"conv5_3_pool{k}"].data.shape == (1, 2048, k, k)
        assert net.blobs[f"conv5_3_pool{k}_interp"].data.shape == (1, 512, 60, 60)
    assert net.blobs["conv5_3_concat"].data.shape == (1, 4096, 60, 60)
    rng = np.random.default_rng(2)
    fill(net, rng)
    x = rng.standard_normal((1, 2048, 60, 60)).astype(F32)
    net.forward(conv5_3=x)
    out = net.blobs["conv5_3_concat"].data
    np.testing.assert_array_equal(out[:, :2048], x)                 # the concat keeps conv5_3
    # the 1x1 pyramid level, interpolated from one cell, is constant over the map
    one = net.blobs["conv5_3_pool1_interp"].data
    np.testing.assert_allclose(one, np.broadcast_to(one[:, :, :1, :1], one.shape), rtol=1e-6)


# -- caffemodels in PSPNet's own schema ------------------------------------------------------
@pytest.fixture(scope="module")
def pspnet_pb2(tmp_path_factory):
    yield from fork_pb2(tmp_path_factory.mktemp("pspnet_pb2"), FORKS / "pspnet_caffe_excerpt.proto", "pspnet_caffe")


PSP_NET = """name: "psp"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 7 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "conv/bn" type: "BN" bottom: "c" top: "c" bn_param { slope_filler { type: "constant" value: 1 }
        bias_filler { type: "constant" value: 0 } frozen: true } }
layer { name: "up" type: "Interp" bottom: "c" top: "up" interp_param { zoom_factor: 3 } }
"""


def test_brewnet_weights_read_in_pspnets_schema(pspnet_pb2, tmp_path):
    net = caffe.Net(PSP_NET, caffe.TEST)
    fill(net, np.random.default_rng(3))
    net.save(str(tmp_path / "b.caffemodel"))
    theirs = pspnet_pb2.NetParameter.FromString((tmp_path / "b.caffemodel").read_bytes())
    by = {l.name: l for l in theirs.layer}
    bn = by["conv/bn"]
    assert [tuple(b.shape.dim) for b in bn.blobs] == [(1, 4, 1, 1)] * 4
    for b, ours in zip(bn.blobs, net.params["conv/bn"]):
        np.testing.assert_array_equal(np.asarray(b.data, F32).reshape(1, 4, 1, 1), ours.data)
    assert [tuple(b.shape.dim) for b in by["conv"].blobs] == [(4, 3, 3, 3), (4,)]


def test_a_pspnet_schema_caffemodel_loads_with_the_same_outputs(pspnet_pb2, tmp_path):
    rng = np.random.default_rng(4)
    ref = caffe.Net(PSP_NET, caffe.TEST)
    fill(ref, rng)
    x = rng.standard_normal((2, 3, 5, 7)).astype(F32)
    ref.forward(x=x)
    # PSPNet's own file: its field numbers (interp_param 143, bn_param 152), legacy 4-D blob shapes
    fork = pspnet_pb2.NetParameter(name="psp")
    spec = read_net(PSP_NET)
    for lp in spec.layer[1:]:
        l = fork.layer.add(name=lp.name, type=lp.type, bottom=lp.bottom, top=lp.top)
        if lp.type == "Interp":
            l.interp_param.zoom_factor = 3
        if lp.type == "BN":
            l.bn_param.frozen = True
        for p in ref.params.get(lp.name, []):
            b = l.blobs.add()
            b.shape.dim.extend(p.data.shape)
            b.data.extend(p.data.reshape(-1).tolist())
    path = tmp_path / "fork.caffemodel"
    path.write_bytes(fork.SerializeToString())
    net = caffe.Net(PSP_NET, caffe.TEST)
    net.copy_from(str(path))
    net.forward(x=x)
    np.testing.assert_array_equal(net.blobs["up"].data, ref.blobs["up"].data)
    # read as a net, the fork's numbers come back as brewnet's fields
    read = {l.name: l for l in read_net(str(path)).layer}
    assert read["up"].interp_param.zoom_factor == 3 and not read["up"].HasField("input_param")
    assert read["conv/bn"].bn_param.frozen


def yolo3_ref(outs, p):
    """Detections of MobileNet-YOLO's Yolov3DetectionOutputLayer::Forward_cpu, element by
    element: (label, score, x, y, w, h) per detection before its sort and NMS."""
    dets = []
    for t, v in enumerate(outs):
        _, _, h, w = v.shape
        v = v.reshape(p.num_box, 5 + p.num_classes, h, w).astype(np.float64)
        for i in range(h):
            for j in range(w):
                for n in range(p.num_box):
                    m = p.mask[n + t * p.num_box]
                    sig = 1 / (1 + np.exp(-v[n, :, i, j]))
                    for c in range(p.num_classes):
                        score = sig[5 + c] * sig[4]
                        if score > p.confidence_threshold:
                            dets.append((c + 1, score, (j + sig[0]) / w, (i + sig[1]) / h,
                                         np.exp(v[n, 2, i, j]) * p.biases[2 * m] / (w * p.anchors_scale[t]),
                                         np.exp(v[n, 3, i, j]) * p.biases[2 * m + 1] / (h * p.anchors_scale[t])))
    return dets


def test_mobilenet_yolov3_lite_runs_depthwise_and_yolo_output(tmp_path):
    cv2 = pytest.importorskip("cv2")
    path = FORKS / "yolov3_lite_mobilenetv2_deploy.prototxt"
    net = caffe.Net(str(path), caffe.TEST)
    rng = np.random.default_rng(5)
    fill(net, rng, 0.05)
    for head in ("yolo/conv4", "yolo/conv5"):   # objectness biases low: tens of candidates, not 10^4
        net.params[head][1].data[4::25] = -4
    x = rng.uniform(-1, 1, (1, 3, 352, 352)).astype(F32)
    net.forward(data=x)
    heads = ["yolo/conv4", "yolo/conv5"]
    assert [net.blobs[b].data.shape for b in heads] == [(1, 75, 11, 11), (1, 75, 22, 22)]
    # OpenCV has no DepthwiseConvolution; the fork's is Caffe's Convolution with the prototxt's
    # group, so OpenCV runs the same text with the type renamed (and the detection head left off).
    text = path.read_text().replace('"DepthwiseConvolution"', '"Convolution"')
    text = text[: text.rindex("layer {", 0, text.index('type: "Yolov3DetectionOutput"'))]
    (tmp_path / "cv.prototxt").write_text(text)
    net.save(str(tmp_path / "y.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "cv.prototxt"), str(tmp_path / "y.caffemodel"))
    cv.setInput(x, "data")
    for b, theirs in zip(heads, cv.forward(heads)):
        ours = net.blobs[b].data
        assert np.abs(ours - theirs).max() <= 2e-4 * max(1, np.abs(theirs).max()), b   # ATOL_MODEL
    # the detections: each row is one of the fork loop's (label, score, box), the best first
    p = read_net(str(path)).layer[-1].yolov3_detection_output_param
    ref = np.array([(lab, sc, bx - bw / 2, by - bh / 2, bx + bw / 2, by + bh / 2)
                    for lab, sc, bx, by, bw, bh in yolo3_ref([net.blobs[b].data for b in heads], p)])
    out = net.blobs["detection_out"].data.reshape(-1, 7)
    assert len(ref) > 0 and 0 < len(out) < len(ref)   # NMS removed overlapping ones
    assert (out[:, 0] == 0).all() and (np.diff(out[:, 2]) <= 0).all()
    assert out[0, 2] == pytest.approx(ref[:, 1].max(), rel=1e-6)
    for row in out:
        assert (np.abs(ref - row[1:]).max(1) < 1e-4).any(), row


RFCN = FORKS / "rfcn_resnet50_test_agnostic.prototxt"


def test_rfcn_heads_run_with_the_builtin_proposal_and_psroi_pooling():
    # py-R-FCN's ResNet-50 test net from res4f / res5c on (the backbone is plain Caffe): the
    # RPN, its Python proposal layer (on the built-in Proposal), the position-sensitive heads.
    text = subnet(read_net(str(RFCN)), {"res4f": (1, 1024, 10, 12), "res5c": (1, 2048, 10, 12),
                                        "im_info": (1, 3)}, "rpn_conv/3x3")
    net = caffe.Net(text, caffe.TEST)
    assert {"Python", "PSROIPooling"} <= {l.type for l in net.layer_list}
    rng = np.random.default_rng(6)
    fill(net, rng, 0.01)
    net.forward(res4f=rng.standard_normal((1, 1024, 10, 12)).astype(F32),
                res5c=rng.standard_normal((1, 2048, 10, 12)).astype(F32),
                im_info=np.array([[160, 192, 1]], F32))
    r = len(net.blobs["rois"].data)
    assert 1 < r <= 300
    assert net.blobs["psroipooled_cls_rois"].data.shape == (r, 21, 7, 7)
    assert net.blobs["psroipooled_loc_rois"].data.shape == (r, 8, 7, 7)
    assert net.blobs["cls_prob"].data.shape == (r, 21) and net.blobs["bbox_pred"].data.shape == (r, 8)
    np.testing.assert_allclose(net.blobs["cls_prob"].data.sum(1), 1, rtol=1e-5)


def test_rfcn_head_matches_opencv(tmp_path):
    cv2 = pytest.importorskip("cv2")
    # The R-FCN head (conv_new_1 ... cls_prob, bbox_pred) on given rois, both sides.
    text = subnet(read_net(str(RFCN)), {"res5c": (1, 2048, 6, 7), "rois": (5, 5)}, "conv_new_1")
    net = caffe.Net(text, caffe.TEST)
    rng = np.random.default_rng(7)
    fill(net, rng, 0.02)
    rois = np.array([[0, 0, 0, 111, 95], [0, 10, 20, 60, 70], [0, 33.3, 5.5, 90.2, 40.7],
                     [0, 50, 50, 50, 50], [0, -8, 70, 130, 120]], F32)
    x = rng.standard_normal((1, 2048, 6, 7)).astype(F32)
    net.forward(res5c=x, rois=rois)
    (tmp_path / "r.prototxt").write_text(text)
    net.save(str(tmp_path / "r.caffemodel"))
    cv = cv2.dnn.readNetFromCaffe(str(tmp_path / "r.prototxt"), str(tmp_path / "r.caffemodel"))
    cv.setInput(x, "res5c")
    cv.setInput(rois, "rois")
    where = {lp.top[0]: lp.name for lp in read_net(text).layer}
    for blob in ("psroipooled_cls_rois", "cls_prob", "bbox_pred"):
        theirs = cv.forward(where[blob])
        ours = net.blobs[blob].data
        assert np.abs(ours - theirs.reshape(ours.shape)).max() <= 2e-4 * max(1, np.abs(theirs).max()), blob
