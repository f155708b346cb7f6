"""Issue 38: detector forks whose files brewnet's SSD/R-FCN reading refused.

* PriorBox layouts of TextBoxes (MhLiao/TextBoxes), TextBoxes++ (MhLiao/TextBoxes_plusplus) and
  FaceBoxes (sfzhang15/FaceBoxes): priors against loops written from each fork's
  src/caffe/layers/prior_box_layer.cpp (commits in tests/data/forks/PROVENANCE.md), and each
  fork's real deploy prototxt building and running forward through DetectionOutput.
* py-R-FCN's Caffe (Microsoft/caffe 1a2be8e) stores psroi_pooling_param at 149, brewnet's
  reorg_param: a caffemodel written in that schema (the vendored excerpt, compiled here) loads
  with the same outputs as brewnet's own file.
"""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import read_net
from tests.helpers import VENDORED, fork_pb2

FORKS = VENDORED / "forks"
F32 = np.float32


# -- py-R-FCN's psroi_pooling_param at 149 ---------------------------------------------------
@pytest.fixture(scope="module")
def rfcn_pb2(tmp_path_factory):
    yield from fork_pb2(tmp_path_factory.mktemp("rfcn_pb2"), FORKS / "rfcn_caffe_excerpt.proto", "rfcn_caffe")


RFCN_NET = """name: "rfcn"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 4 dim: 9 dim: 11 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 3 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 45 kernel_size: 1 } }
layer { name: "ps" type: "PSROIPooling" bottom: "c" bottom: "rois" top: "p"
        psroi_pooling_param { spatial_scale: 0.0625 output_dim: 5 group_size: 3 } }
"""


def test_a_py_rfcn_schema_caffemodel_loads_with_the_same_outputs(rfcn_pb2, tmp_path):
    rng = np.random.default_rng(38)
    ref = caffe.Net(RFCN_NET, caffe.TEST)
    for b in ref.params["conv"]:
        b.data[...] = rng.standard_normal(b.data.shape)
    x = rng.standard_normal((1, 4, 9, 11)).astype(F32)
    rois = np.array([[0, 0, 0, 150, 120], [0, 16, 40, 90, 100], [0, 33.5, 7.25, 170, 140]], F32)
    ref.forward(x=x, rois=rois)
    ref.save(str(tmp_path / "brewnet.caffemodel"))
    # py-R-FCN's own file: psroi_pooling_param at 149 (output_dim 5: a bool there would read 1)
    fork = rfcn_pb2.NetParameter(name="rfcn")
    for lp in read_net(RFCN_NET).layer[2:]:
        layer = fork.layer.add(name=lp.name, type=lp.type, bottom=lp.bottom, top=lp.top)
        if lp.type == "Convolution":
            layer.convolution_param.num_output = 45
            layer.convolution_param.kernel_size.append(1)
        else:
            layer.psroi_pooling_param.spatial_scale = 0.0625
            layer.psroi_pooling_param.output_dim = 5
            layer.psroi_pooling_param.group_size = 3
        for p in ref.params.get(lp.name, []):
            b = layer.blobs.add()
            b.shape.dim.extend(p.data.shape)
            b.data.extend(p.data.reshape(-1).tolist())
    path = tmp_path / "fork.caffemodel"
    path.write_bytes(fork.SerializeToString())
    read = {lp.name: lp for lp in read_net(str(path)).layer}
    assert not read["ps"].HasField("reorg_param")
    assert read["ps"].psroi_pooling_param == pb.PSROIPoolingParameter(
        spatial_scale=0.0625, output_dim=5, group_size=3)
    assert read["ps"].psroi_pooling_param == {
        lp.name: lp for lp in read_net(str(tmp_path / "brewnet.caffemodel")).layer}["ps"].psroi_pooling_param
    for weights in (path, tmp_path / "brewnet.caffemodel"):
        net = caffe.Net(RFCN_NET, caffe.TEST)
        net.copy_from(str(weights))
        net.forward(x=x, rois=rois)
        np.testing.assert_array_equal(net.blobs["p"].data, ref.blobs["p"].data)


def test_a_yolo_reorg_at_149_still_reads_as_reorg():
    net = read_net('layer { name: "r" type: "Reorg" bottom: "x" top: "y" '
                   'reorg_param { stride: 2 reverse: true } }')
    again = pb.NetParameter.FromString(net.SerializeToString())
    from brewnet.proto.upgrade import upgrade_net

    r = upgrade_net(again).layer[0]
    assert r.reorg_param.stride == 2 and r.reorg_param.reverse
    assert not r.HasField("psroi_pooling_param")


# -- PriorBox layouts: the forks' loops ------------------------------------------------------
def _ratios(p):
    ars = [F32(1.0)]
    for ar in p.aspect_ratio:
        if all(abs(ar - r) >= 1e-6 for r in ars):
            ars.append(F32(ar))
            if p.flip:
                ars.append(F32(1.0) / F32(ar))
    return ars


def _fork_steps(p, lh, lw, ih, iw):
    if p.HasField("img_size"):
        ih = iw = p.img_size
    if p.HasField("step"):
        return ih, iw, F32(p.step), F32(p.step)
    return ih, iw, F32(ih) / F32(lh), F32(iw) / F32(lw)


def _finish(p, data, clip, n):
    data = np.array(data, np.float64).astype(F32)
    if clip:
        data = np.minimum(np.maximum(data, 0), 1)
    var = list(p.variance) or [0.1]
    return np.stack([data, np.resize(np.array(var, F32), n)])


def textboxes_ref(p, lh, lw, ih, iw):
    """MhLiao/TextBoxes fd4d7a9, src/caffe/layers/prior_box_layer.cpp, Forward_cpu: one
    (float) min_size and max_size, step from the image, every prior then its copy centred at
    (h + 1.0) * step_y; clip defaults to true in the fork's caffe.proto."""
    min_size = F32(p.min_size[0])
    max_size = F32(p.max_size[0]) if p.max_size else -1
    step_x, step_y = F32(iw) / lw, F32(ih) / lh
    top = []
    for h in range(lh):
        for w in range(lw):
            center_x = F32((w + 0.5) * float(step_x))
            center_y = F32((h + 0.5) * float(step_y))
            center_y_offset_1 = F32((h + 1.0) * float(step_y))

            def emit(bw, bh):
                # float centres, double arithmetic from here (numpy would keep float32)
                cx = float(center_x)
                for cy in map(float, (center_y, center_y_offset_1)):
                    top.extend([(cx - bw / 2.) / iw, (cy - bh / 2.) / ih,
                                (cx + bw / 2.) / iw, (cy + bh / 2.) / ih])
            emit(float(min_size), float(min_size))
            if max_size > 0:
                s = float(F32(np.sqrt(F32(min_size * max_size))))
                emit(s, s)
            for ar in _ratios(p):
                if abs(ar - 1.) < 1e-6:
                    continue
                emit(float(min_size * np.sqrt(ar)), float(min_size / np.sqrt(ar)))
    return _finish(p, top, p.clip if p.HasField("clip") else True, len(top))


def textboxes_pp_ref(p, lh, lw, ih, iw):
    """MhLiao/TextBoxes_plusplus 39d4898, src/caffe/layers/prior_box_layer.cpp, Forward_cpu:
    SSD's loop (int min/max sizes, img_size/step/offset) with each prior followed by its copy
    at center_y_offset_1 = (h + 1.0) * step_h when denser_prior_boxes."""
    ih, iw, step_h, step_w = _fork_steps(p, lh, lw, ih, iw)
    offset = F32(p.offset)
    top = []
    for h in range(lh):
        for w in range(lw):
            center_x = (F32(w) + offset) * step_w
            center_y = (F32(h) + offset) * step_h
            center_y_offset_1 = F32((h + 1.0) * float(step_h))

            def emit(bw, bh):
                cx = float(center_x)
                for cy in map(float, (center_y, center_y_offset_1)[:2 if p.denser_prior_boxes else 1]):
                    top.extend([(cx - bw / 2.) / iw, (cy - bh / 2.) / ih,
                                (cx + bw / 2.) / iw, (cy + bh / 2.) / ih])
            for s, mn in enumerate(p.min_size):
                min_size_ = int(mn)
                emit(float(F32(min_size_)), float(F32(min_size_)))
                if p.max_size:
                    side = float(F32(np.sqrt(min_size_ * int(p.max_size[s]))))
                    emit(side, side)
                for ar in _ratios(p):
                    if abs(ar - 1.) < 1e-6:
                        continue
                    emit(float(F32(min_size_) * np.sqrt(ar)), float(F32(min_size_) / np.sqrt(ar)))
    return _finish(p, top, p.clip, len(top))


def faceboxes_ref(p, lh, lw, ih, iw):
    """sfzhang15/FaceBoxes b52cc92, src/caffe/layers/prior_box_layer.cpp, Forward_cpu: min_size
    32 gives 16 boxes (i, j in -2..1, centre + j * 8, i * 8), 64 gives 4 (-1..0, * 16), any other
    one; those span the centre -+ (box_width - 1) / 2."""
    ih, iw, step_h, step_w = _fork_steps(p, lh, lw, ih, iw)
    offset = F32(p.offset)
    top = []
    for h in range(lh):
        for w in range(lw):
            center_x = (F32(w) + offset) * step_w
            center_y = (F32(h) + offset) * step_h

            def box(cx, cy, half_w, half_h):
                cx, cy, half_w, half_h = float(cx), float(cy), float(half_w), float(half_h)
                top.extend([(cx - half_w) / iw, (cy - half_h) / ih, (cx + half_w) / iw, (cy + half_h) / ih])
            for s, mn in enumerate(p.min_size):
                min_size_ = int(mn)
                box_width = F32(min_size_)
                if min_size_ in (32, 64):
                    n, d = (2, 8) if min_size_ == 32 else (1, 16)
                    for i in range(-n, n):
                        for j in range(-n, n):
                            box(center_x + F32(j * d), center_y + F32(i * d),
                                float(box_width - 1) / 2., float(box_width - 1) / 2.)
                else:
                    box(center_x, center_y, float(box_width - 1) / 2., float(box_width - 1) / 2.)
                if p.max_size:
                    side = float(F32(np.sqrt(min_size_ * int(p.max_size[s]))))
                    box(center_x, center_y, side / 2., side / 2.)
                for ar in _ratios(p):
                    if abs(ar - 1.) < 1e-6:
                        continue
                    bw, bh = F32(min_size_) * np.sqrt(ar), F32(min_size_) / np.sqrt(ar)
                    box(center_x, center_y, float(bw) / 2., float(bh) / 2.)
    return _finish(p, top, p.clip, len(top))


def _priors(param_text, fm, img):
    text = f"""layer {{ name: "f" type: "Input" top: "f"
        input_param {{ shape {{ dim: 1 dim: 2 dim: {fm[0]} dim: {fm[1]} }} }} }}
layer {{ name: "d" type: "Input" top: "d" input_param {{ shape {{ dim: 1 dim: 3 dim: {img[0]} dim: {img[1]} }} }} }}
layer {{ name: "pb" type: "PriorBox" bottom: "f" bottom: "d" top: "pb" prior_box_param {{ {param_text} }} }}
"""
    net = caffe.Net(text, caffe.TEST)
    net.forward()
    return read_net(text).layer[2].prior_box_param, net.blobs["pb"].data[0]


@pytest.mark.parametrize("param", [
    "layout: TEXTBOXES min_size: 30 aspect_ratio: 2 aspect_ratio: 3 aspect_ratio: 5 aspect_ratio: 7 "
    "aspect_ratio: 10 flip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2",
    "layout: TEXTBOXES min_size: 60.5 max_size: 114.25 aspect_ratio: 2 aspect_ratio: 3 flip: false",
    "layout: TEXTBOXES min_size: 37.7 aspect_ratio: 3 clip: false variance: 0.2",
])
def test_textboxes_priors_match_the_forks_loop(param):
    p, ours = _priors(param, (5, 7), (300, 310))
    np.testing.assert_array_equal(ours, textboxes_ref(p, 5, 7, 300, 310))


@pytest.mark.parametrize("param", [
    "denser_prior_boxes: true min_size: 30 max_size: 60 aspect_ratio: 2 aspect_ratio: 3 "
    "aspect_ratio: 4 aspect_ratio: 5 flip: true clip: false variance: 0.1 variance: 0.1 "
    "variance: 0.2 variance: 0.2 step: 8 offset: 0.5",
    "denser_prior_boxes: true min_size: 30.9 min_size: 45 max_size: 60.5 max_size: 99 "
    "aspect_ratio: 2 clip: true img_size: 320 step: 41.5 offset: 0.25",
    "denser_prior_boxes: false min_size: 30 max_size: 60 aspect_ratio: 2",
])
def test_textboxes_plusplus_priors_match_the_forks_loop(param):
    p, ours = _priors(param, (6, 5), (384, 350))
    np.testing.assert_array_equal(ours, textboxes_pp_ref(p, 6, 5, 384, 350))


@pytest.mark.parametrize("param", [
    "layout: FACEBOXES min_size: 32 min_size: 64 min_size: 128 clip: false variance: 0.1 "
    "variance: 0.1 variance: 0.2 variance: 0.2 step: 32 offset: 0.5",
    "layout: FACEBOXES min_size: 256 clip: false step: 64 offset: 0.5",
    "layout: FACEBOXES min_size: 512 clip: true",
    "layout: FACEBOXES min_size: 100 max_size: 200 aspect_ratio: 2 clip: false",
])
def test_faceboxes_priors_match_the_forks_loop(param):
    p, ours = _priors(param, (4, 3), (128, 100))
    np.testing.assert_array_equal(ours, faceboxes_ref(p, 4, 3, 128, 100))


def test_faceboxes_mix_the_fork_cannot_run_is_an_error():
    # the fork allocates SSD's 1 prior a cell for min_size 32 alone, and writes 16
    with pytest.raises(Exception, match="writes 16 priors a cell where the fork allocates 1"):
        _priors("layout: FACEBOXES min_size: 32", (2, 2), (64, 64))


# -- the forks' real deploy nets -------------------------------------------------------------
def _deploy(name, hw=None):
    param = read_net(str(FORKS / name))
    if hw is not None:                    # fully convolutional: a smaller image, the same layout
        dims = param.layer[0].input_param.shape[0].dim
        dims[2], dims[3] = hw
    return param


def _run(param, rng):
    net = caffe.Net(param, caffe.TEST)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.data.shape) * 0.01
    shape = net.blobs["data"].data.shape
    net.forward(data=rng.standard_normal(shape).astype(F32))
    return net


def _layouts(param):
    return {lp.name: lp.prior_box_param.layout for lp in param.layer if lp.type == "PriorBox"}


def test_textboxes_deploy_runs_through_detection_output():
    # TextBoxes' deploy (700 x 700 there; 300 x 300 here, its training size): 12 loc/conf
    # predictions a cell for 6 priors (ratios 1, 2, 3, 5, 7, 10, flip false) each twice
    param = _deploy("textboxes_deploy.prototxt", (300, 300))
    assert set(_layouts(param).values()) == {pb.PriorBoxParameter.TEXTBOXES}
    net = _run(param, np.random.default_rng(1))
    p = _layouts(param)
    assert len(p) == 6
    n = net.blobs["mbox_priorbox"].data.shape[2] // 4
    assert net.blobs["mbox_loc"].data.shape[1] == 4 * n and net.blobs["mbox_conf_flatten"].data.shape[1] == 2 * n
    det = net.blobs["detection_out"].data
    assert det.shape[:2] == (1, 1) and det.shape[3] == 7
    # the first PriorBox against the fork's loop
    lp = next(lp for lp in param.layer if lp.name == "conv4_3_norm_mbox_priorbox")
    h, w = net.blobs["conv4_3_norm"].data.shape[2:]
    np.testing.assert_array_equal(net.blobs[lp.top[0]].data[0],
                                  textboxes_ref(lp.prior_box_param, h, w, 300, 300))


def test_faceboxes_deploy_runs_through_detection_output():
    # FaceBoxes' deploy at its 640 x 480: 21 priors a cell on inception3 (32 x 16, 64 x 4,
    # 128), one on conv3_2 (256) and conv4_2 (512), all in the fork's (size - 1) boxes
    param = _deploy("faceboxes_deploy.prototxt")
    assert set(_layouts(param).values()) == {pb.PriorBoxParameter.FACEBOXES}
    net = _run(param, np.random.default_rng(2))
    n = net.blobs["mbox_priorbox"].data.shape[2] // 4
    assert net.blobs["mbox_loc"].data.shape[1] == 4 * n
    h, w = net.blobs["inception_a3_concat"].data.shape[2:]
    assert n == h * w * 21 + net.blobs["conv3_2"].data[0, 0].size + net.blobs["conv4_2"].data[0, 0].size
    det = net.blobs["detection_out"].data
    assert det.shape[:2] == (1, 1) and det.shape[3] == 7
    for lp in param.layer:
        if lp.type == "PriorBox":
            h, w = net.blobs[lp.bottom[0]].data.shape[2:]
            np.testing.assert_array_equal(net.blobs[lp.top[0]].data[0],
                                          faceboxes_ref(lp.prior_box_param, h, w, 640, 480))


def test_textboxes_plusplus_deploy_runs_through_its_polygon_detection_output():
    # TextBoxes++' deploy names its layout (denser_prior_boxes); its DetectionOutput decodes 12
    # numbers a prior (box + quadrilateral, use_polygon): rows of 15 against the loop from the
    # fork's code (test_textboxes_pp_output.py), on the net's own blobs (384 x 384, its
    # training size).
    from tests.test_textboxes_pp_output import textboxes_pp_ref as polygon_output_ref

    param = _deploy("textboxes_plusplus_deploy.prototxt", (384, 384))
    assert set(_layouts(param).values()) == {pb.PriorBoxParameter.SSD}
    net = _run(param, np.random.default_rng(3))
    n = net.blobs["mbox_priorbox"].data.shape[2] // 4
    assert net.blobs["mbox_loc"].data.shape[1] == 12 * n
    assert net.blobs["mbox_conf_flatten"].data.shape[1] == 2 * n
    for lp in param.layer:
        if lp.type == "PriorBox":
            h, w = net.blobs[lp.bottom[0]].data.shape[2:]
            np.testing.assert_array_equal(net.blobs[lp.top[0]].data[0],
                                          textboxes_pp_ref(lp.prior_box_param, h, w, 384, 384))
    det = net.blobs["detection_out"].data
    p = next(lp for lp in param.layer if lp.type == "DetectionOutput").detection_output_param
    ref = polygon_output_ref(net.blobs["mbox_loc"].data, net.blobs["mbox_conf_flatten"].data,
                             net.blobs["mbox_priorbox"].data, p.num_classes, p.share_location,
                             p.background_label_id, p.confidence_threshold,
                             p.nms_param.nms_threshold, p.nms_param.top_k, p.keep_top_k)
    assert det.shape == ref.shape and det.shape[2] > 1 and det.shape[3] == 15
    np.testing.assert_array_equal(det[..., :3], ref[..., :3])
    np.testing.assert_allclose(det, ref, rtol=1e-6, atol=1e-7)
