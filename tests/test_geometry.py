"""Receptive fields (brewnet.analysis.geometry): known values, and a brute-force check that the
pixels which move a unit (gradient of a linear twin of the net) lie inside the computed field and
reach its border."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from brewnet.analysis.geometry import describe, receptive_fields
from brewnet.net import Net
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_net

from helpers import MODELS, pick

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
    layer { name: "down" type: "Convolution" bottom: "x" top: "d" convolution_param { num_output: 1 kernel_size: 4 stride: 2 pad: 1 } }
    layer { name: "up" type: "Deconvolution" bottom: "d" top: "u" convolution_param { num_output: 1 kernel_size: 4 stride: 2 } }
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


def _forward_to(net, name):
    last = max(i for i, tops in enumerate(net.top_lists) if name in tops)
    net.forward_tensors(end=last)


def test_shapes_prints_the_field(capsys):
    from brewnet.cli import main

    assert main(["shapes", str(pick("caffe-models") / CAFFENET)]) == 0
    out = capsys.readouterr().out
    assert "163 /16 @-64" in out and "195 /32 @-64" in out
