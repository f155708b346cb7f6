"""Receptive fields (brewnet.analysis.geometry): known values, and a brute-force check that the
pixels which move a unit (gradient of a linear twin of the net) lie inside the computed field and
reach its border."""
from __future__ import annotations

import os
import re
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from brewnet.analysis.geometry import describe, receptive_fields
from brewnet.net import Net
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_net
from helpers import need, pick

CAFFENET = "bvlc/models/bvlc_reference_caffenet/deploy.prototxt"


def test_caffenet_conv5_and_pool5():
    net = Net(pick("caffe-models") / CAFFENET, pb.TEST)
    rf = receptive_fields(net)
    assert [(a.size, a.stride) for a in rf["conv5"]] == [(163, 16)] * 2
    assert [(a.size, a.stride) for a in rf["pool5"]] == [(195, 32)] * 2
    assert [(a.size, a.stride, a.start) for a in rf["conv1"]] == [(11, 4, 0)] * 2
    assert rf["conv2"][0].start == -16            # pad 2 at stride 8
    assert rf["fc6"] is None and describe(rf["fc6"]) == "-"
    assert describe(rf["conv5"]) == "163 /16 @-64"


def test_deconvolution_and_crop_are_exact_fractions():
    text = """layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 1 dim: 16 dim: 16 } } }
    layer { name: "down" type: "Convolution" bottom: "x" top: "d"
            convolution_param { num_output: 1 kernel_size: 4 stride: 2 pad: 1 } }
    layer { name: "up" type: "Deconvolution" bottom: "d" top: "u"
            convolution_param { num_output: 1 kernel_size: 4 stride: 2 } }
    layer { name: "crop" type: "Crop" bottom: "u" bottom: "x" top: "c" crop_param { axis: 2 offset: 1 } }"""
    rf = receptive_fields(Net(text, pb.TEST))
    assert (rf["d"][0].size, rf["d"][0].stride, rf["d"][0].start) == (4, 2, -1)
    u = rf["u"][0]
    assert (u.size, u.stride, u.start) == (7, 1, -4)
    assert rf["c"][0].start == -3 and rf["c"][0].stride == Fraction(1)


def _linear_twin(param):
    """The net with its in-place activations dropped and MAX pooling made AVE: each unit then
    depends on exactly the pixels its receptive field covers (positive weights; LRN, kept, is
    pointwise in space)."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    out.force_backward = True
    del out.layer[:]
    for lp in param.layer:
        if lp.type in ("ReLU", "Dropout", "PReLU", "Sigmoid", "TanH"):
            if list(lp.bottom) != list(lp.top):
                raise ValueError("twin assumes in-place activations")
            continue
        if lp.type == "Pooling":
            lp.pooling_param.pool = pb.PoolingParameter.AVE
        out.layer.append(lp)
    return out


DEPLOY = ["bvlc/models/bvlc_reference_caffenet/deploy.prototxt",
          "bvlc/examples/mnist/lenet.prototxt",
          "bvlc/examples/cifar10/cifar10_quick.prototxt"]


@pytest.mark.parametrize("path", DEPLOY)
def test_field_bounds_the_pixels_that_move_a_unit(path):
    torch.manual_seed(0)
    param = read_net(pick("caffe-models") / path)
    net = Net(_linear_twin(param), pb.TEST)
    for layer in net.layer_list:           # positive weights: no accidental cancellation
        for b in layer.blobs:
            with torch.no_grad():
                b.copy_(torch.rand_like(b) + 0.1)
    rf = receptive_fields(net)
    x = torch.zeros(net.blobs[net.inputs[0]].shape[1:]).unsqueeze(0).requires_grad_(True)
    h, w = x.shape[2:]
    checked = 0
    for name, field in rf.items():
        shape = net.shapes[name]
        if field is None or name in net.inputs or len(shape) != 4:
            continue
        for i, j in {(0, 0), (shape[2] // 2, shape[3] // 2), (shape[2] - 1, shape[3] - 1)}:
            net.blobs[net.inputs[0]].tensor = x
            with torch.enable_grad():
                _forward_to(net, name)
                y = net.blobs[name].tensor
                g, = torch.autograd.grad(y[0, 0, i, j], x)
            rows = g[0].abs().sum(0).nonzero()
            lo = [int(f.start + k * f.stride) for f, k in zip(field, (i, j))]
            hi = [l + int(f.size) - 1 for l, f in zip(lo, field)]
            got_lo, got_hi = rows.min(0).values.tolist(), rows.max(0).values.tolist()
            for ax, n in enumerate((h, w)):
                assert lo[ax] <= got_lo[ax] and got_hi[ax] <= hi[ax], (name, i, j, lo, hi, got_lo, got_hi)
                # The field reaches the moving pixels' border unless that border is the image's.
                assert got_lo[ax] == max(lo[ax], 0) and got_hi[ax] == min(hi[ax], n - 1), \
                    (name, i, j, lo, hi, got_lo, got_hi)
            checked += 1
    assert checked >= 6


# -- every deploy net: one impulse forward per pixel checks every unit of every blob ------------
# Every deploy net in ../shared/caffe-models, at an input size the geometry permits (layers that
# need more are cut). The first group runs by default; BREWNET_ALL_NETS=1 adds the large ones
# (minutes on 2 cores).
ALL_DEPLOY = {
    "bvlc/examples/cifar10/cifar10_full.prototxt": 32,
    "bvlc/examples/cifar10/cifar10_quick.prototxt": 32,
    "bvlc/examples/mnist/lenet.prototxt": 28,
    "bvlc/models/bvlc_alexnet/deploy.prototxt": 64,
    "bvlc/models/bvlc_googlenet/deploy.prototxt": 64,
    "bvlc/models/bvlc_reference_caffenet/deploy.prototxt": 64,
    "bvlc/models/bvlc_reference_rcnn_ilsvrc13/deploy.prototxt": 64,
    "bvlc/models/finetune_flickr_style/deploy.prototxt": 64,
    "squeezenet/SqueezeNet_v1.0/deploy.prototxt": 64,
    "squeezenet/SqueezeNet_v1.1/deploy.prototxt": 64,
}
LARGE = [f"densenet/DenseNet_{n}.prototxt" for n in (121, 161, 169, 201)] + [
    "fcn/voc-fcn8s/deploy.prototxt", "mobilenet-ssd/deploy.prototxt",
    "mobilenet-ssd/voc/MobileNetSSD_deploy.prototxt", "mobilenet/mobilenet_deploy.prototxt",
    "mobilenet/mobilenet_v2_deploy.prototxt"] + [
    f"resnet/prototxt/ResNet-{n}-deploy.prototxt" for n in (50, 101, 152)] + [
    "soeaver/cls/vgg/deploy_vgg16-pytorch.prototxt", "soeaver/cls/vgg/deploy_vgg16bn-pytorch.prototxt",
    "vgg/model/VGG_ILSVRC_16_layers_deploy.prototxt", "vgg/model/VGG_ILSVRC_19_layers_deploy.prototxt"]
# Below their own input size the Inception nets and SSD lose blocks (branches that no longer
# line up are cut), so they keep it (0).
LARGE_NATIVE = [f"soeaver/cls/inception/deploy_{n}.prototxt" for n in ("inception-v2", "inception-v3",
             "inception-v4", "xception")] + ["ssd/models/VGGNet/VOC0712/SSD_300x300/deploy.prototxt"]
if os.environ.get("BREWNET_ALL_NETS") == "1":
    ALL_DEPLOY.update({p: 64 for p in LARGE})
    ALL_DEPLOY.update({p: 0 for p in LARGE_NATIVE})


def _impulse_net(param, size: int):
    """The net at a batch of 5 of size x size inputs (0: the prototxt's), MAX pooling made AVE (a MAX unit moves
    only when its maximum does), positive weights / fan-in, zero biases, BatchNorm the
    identity, float64. Layers that cannot take the size (and what they feed) are cut."""
    drop: set[str] = set()
    while True:
        out = pb.NetParameter()
        out.CopyFrom(param)
        del out.layer[:]
        gone: set[str] = set()
        for lp in param.layer:
            if lp.name in drop or any(b in gone for b in lp.bottom):
                gone |= set(lp.top)
                continue
            new = out.layer.add()
            new.CopyFrom(lp)
            lp = new
            if lp.type == "Pooling" and lp.pooling_param.pool == pb.PoolingParameter.MAX:
                lp.pooling_param.pool = pb.PoolingParameter.AVE
            for shape in lp.input_param.shape:
                shape.dim[0] = 5
                if size:
                    shape.dim[2], shape.dim[3] = size, size
        try:
            net = Net(out, pb.TEST)
            break
        except ValueError as e:
            m = re.search(r"Layer '([^']+)'", str(e))
            if not m or m.group(1) in drop:
                raise
            drop.add(m.group(1))
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in net.layer_list:
            for k, b in enumerate(layer.blobs):
                if layer.type == "BatchNorm":
                    b.fill_((0.0, 1.0, 1.0)[k])
                elif k == 0:
                    b.copy_((torch.rand_like(b) + 0.5) / (b[0].numel() if b.dim() > 1 else 1))
                else:
                    b.zero_()
    return net.to(dtype=torch.float64)


def impulse_check(param, size: int):
    """(failures, checks): for 4 input pixels p, the units of each blob that change when p alone
    is raised must lie among the units whose field holds p, and span the same box. Inputs are 1
    (so products such as LRN's see their neighbours), every activation stays positive; a pixel
    no unit of a bottom reaches (past the last window of a stride) is held out of the fields
    above it. Above a layer where the field is only a bound (``_loose``): inclusion only."""
    net = _impulse_net(param, size)
    rf = receptive_fields(net)
    name = net.inputs[0]
    h, w = net.shapes[name][2:]
    pixels = [(0, 0), (h // 2, w // 2), (h // 3, 2 * w // 3), (h - 1, w - 1)]
    x = torch.ones(net.shapes[name], dtype=torch.float64)
    for k, (i, j) in enumerate(pixels, 1):
        x[k, :, i, j] += 1
    net.blobs[name].tensor = x
    with torch.no_grad():
        net.forward_tensors()
    reach = {name: ((0, h - 1), (0, w - 1))}   # input pixels some unit of the blob sees
    bound: set[str] = set()
    for layer, bottoms, tops in zip(net.layer_list, net.bottom_lists, net.top_lists):
        if not bottoms:
            continue
        if any(b in bound for b in bottoms) or _loose(layer):
            bound |= set(tops)
        for t in tops:
            up = [reach[b] for b in bottoms if b in reach]
            if rf.get(t) is None or not up or len(net.shapes[t]) != 4:
                reach.pop(t, None)
                continue
            own = [(f.start, f.start + (n - 1) * f.stride + f.size - 1) for f, n in zip(rf[t], net.shapes[t][2:])]
            reach[t] = tuple((max(o[0], min(u[a][0] for u in up)), min(o[1], max(u[a][1] for u in up)))
                             for a, o in enumerate(own))
    failures, checks = [], 0
    for blob, field in rf.items():
        if blob not in reach or blob == name:
            continue
        y = net.blobs[blob].tensor
        moved = (y[1:] != y[:1]).any(1).numpy()
        for k, p in enumerate(pixels):
            sees = [np.array([f.start + u * f.stride <= q <= f.start + u * f.stride + f.size - 1
                              and lo <= q <= hi for u in range(n)])
                    for f, n, q, (lo, hi) in zip(field, net.shapes[blob][2:], p, reach[blob])]
            want = np.outer(*sees)
            inside = not (moved[k] & ~want).any()
            if not inside or (blob not in bound and _box(moved[k]) != _box(want)):
                failures.append((blob, p, describe(field), _box(moved[k]), _box(want)))
            checks += 1
    return failures, checks


def _loose(layer) -> bool:
    """Is the field formula only a bound above this layer: a strided Deconvolution (the union
    over its phases), or a window layer whose pad reaches a whole kernel, so that its border
    units see only padding (SqueezeNet v1.0's conv10: 1 x 1, pad 1) and no pixel at all."""
    if layer.type == "Deconvolution":
        return max(layer.stride) > 1
    if layer.type in ("Convolution", "Pooling") and getattr(layer, "kernel", None) is not None:
        dil = getattr(layer, "dilation", None) or [1] * len(layer.kernel)
        return any(p >= (k - 1) * d + 1 for k, p, d in zip(layer.kernel, layer.pad, dil))
    return False


def _box(mask):
    r, c = np.nonzero(mask)
    return (int(r.min()), int(r.max()), int(c.min()), int(c.max())) if len(r) else None


@pytest.mark.parametrize("path", sorted(ALL_DEPLOY))
def test_every_deploy_net_field_holds_what_an_impulse_moves(path):
    failures, checks = impulse_check(read_net(need(pick("caffe-models") / path)), ALL_DEPLOY[path])
    assert checks >= 12 and not failures, failures[:5]


def test_impulse_check_catches_a_wrong_field(monkeypatch):
    """The check is not vacuous: a field one pixel too small, or shifted, fails it."""
    import dataclasses

    param = read_net(pick("caffe-models") / "bvlc/examples/mnist/lenet.prototxt")
    real = receptive_fields
    for change in ({"size": -1}, {"start": 1}):
        def wrong(net, change=change):
            return {b: f and tuple(dataclasses.replace(a, **{k: getattr(a, k) + v for k, v in change.items()})
                                   for a in f) for b, f in real(net).items()}
        monkeypatch.setattr(sys.modules[__name__], "receptive_fields", wrong)
        failures, _ = impulse_check(param, 28)
        assert failures, change


def _forward_to(net, name):
    last = max(i for i, tops in enumerate(net.top_lists) if name in tops)
    net.forward_tensors(end=last)


def test_shapes_prints_the_field(capsys):
    from brewnet.cli import main

    assert main(["shapes", str(pick("caffe-models") / CAFFENET)]) == 0
    out = capsys.readouterr().out
    assert "163 /16 @-64" in out and "195 /32 @-64" in out
