"""oneDNN post-op fusion in the lean graph (brewnet/execution/postops.py): each fused pattern
gives the plain path's outputs within ``RTOL`` of their scale (a post-op convolution may run
another oneDNN algorithm: measured up to ~5e-7 on MobileNet, bit for bit on most), past the
call where the graph takes over, at the user's defaults; a weight written after the graph was
built (net surgery) is seen; a convolution whose output has another reader is left alone; the
add goes in place only where nothing reads its other operand later."""
import numpy as np
import pytest
import torch

import brewnet
from brewnet.execution import lean, postops
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text

pytestmark = [pytest.mark.cpu_only("oneDNN post-ops: a CPU graph pass"),
              pytest.mark.skipif(not postops.available(), reason="no oneDNN in this torch")]
RTOL = 1e-5          # lean.py's LEAN_RTOL: another kernel, another summation order
MK = torch.ops.mkldnn
INPUT = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 16 dim: 24 dim: 24 } } }'


def conv(name, bottom, top, n=32, extra=""):
    # 2 x 32 x 24 x 24 outputs of 16 or 32 channels: over lean.SMALL_CONV_FLOPS (oneDNN's)
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
            f'convolution_param {{ num_output: {n} kernel_size: 3 pad: 1 {extra} '
            f'weight_filler {{ type: "xavier" }} bias_filler {{ type: "constant" value: 0.1 }} }} }}')


def pool(bottom):
    return (f'layer {{ name: "pool" type: "Pooling" bottom: "{bottom}" top: "pool" '
            f'pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}')


ACTS = {"relu": ('type: "ReLU"', "relu"),
        "leaky_relu": ('type: "ReLU" relu_param { negative_slope: 0.1 }', "leaky_relu"),
        "sigmoid": ('type: "Sigmoid"', "sigmoid"), "tanh": ('type: "TanH"', "tanh"),
        "clip": ('type: "Clip" clip_param { min: -0.5 max: 0.75 }', "hardtanh")}


def make(text: str):
    brewnet.set_random_seed(3)
    net = brewnet.Net(parse_text(text, pb.NetParameter()), brewnet.TEST)
    net.engine = "eager"        # the lean graph itself, whatever engine ``auto`` would time
    return net


def plain(net, x, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        return {k: v.copy() for k, v in net.forward(data=x).items()}


def lean_calls(net, x, monkeypatch, n=lean.AFTER + 2):
    """``n`` forwards at the user's defaults; the last one's outputs (on the graph)."""
    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    for _ in range(n):
        out = {k: v.copy() for k, v in net.forward(data=x).items()}
    assert net._lean.gm is not None and net._lean._stale, "not on the lean graph"
    return out


def close(got, want):
    for k, v in want.items():
        assert np.abs(got[k] - v).max() <= RTOL * np.abs(v).max(), k


def fused(net):
    return [n for n in net._lean.gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("mkldnn._convolution_pointwise")]


def x_in(seed=0):
    return np.random.default_rng(seed).standard_normal((2, 16, 24, 24)).astype(np.float32)


@pytest.mark.parametrize("act", list(ACTS))
def test_conv_activation_is_one_call_with_the_plain_outputs(act, monkeypatch):
    layer, attr = ACTS[act]
    net = make("\n".join([INPUT, conv("conv", "data", "conv"),
                          f'layer {{ name: "act" {layer} bottom: "conv" top: "conv" }}', pool("conv")]))
    x = x_in()
    want = plain(net, x, monkeypatch)
    got = lean_calls(net, x, monkeypatch)
    (node,) = fused(net)
    assert node.target is MK._convolution_pointwise.default and node.args[7] == attr
    assert not any(n.target in (torch.relu, torch.sigmoid, torch.tanh, torch.clamp)
                   for n in net._lean.gm.graph.nodes)
    close(got, want)


def residual(relu: bool, later_reader: bool = False, direct: bool = False) -> str:
    """c1 = relu(conv1(data)); a branch (conv2, relu2, conv3, or conv2 alone: ``direct``) added
    to c1 (Eltwise SUM), ReLU after it; ``later_reader``: c1 read again after the add."""
    branch = ([conv("conv2", "c1", "c3")] if direct else
              [conv("conv2", "c1", "c2"), 'layer { name: "r2" type: "ReLU" bottom: "c2" top: "c2" }',
               conv("conv3", "c2", "c3")])
    lines = [INPUT, conv("conv1", "data", "c1"), 'layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }',
             *branch, 'layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c3" top: "s" }']
    if relu:
        lines.append('layer { name: "rs" type: "ReLU" bottom: "s" top: "s" }')
    if later_reader:
        lines.append('layer { name: "prod" type: "Eltwise" bottom: "s" bottom: "c1" top: "t" '
                     'eltwise_param { operation: PROD } }')
    lines.append(pool("t" if later_reader else "s"))
    return "\n".join(lines)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("case", ["in_place", "later_reader", "direct"])
def test_residual_add_goes_into_the_convolution(relu, case, monkeypatch):
    """The add (and the ReLU after it) is the branch's last convolution's post-op: in place into
    the shortcut where nothing reads it later, else into a fresh output (a later reader of the
    shortcut, or the convolution reading the shortcut itself)."""
    net = make(residual(relu, later_reader=case == "later_reader", direct=case == "direct"))
    x = x_in(1)
    want = plain(net, x, monkeypatch)
    got = lean_calls(net, x, monkeypatch)
    adds = [n for n in fused(net) if n.target in (MK._convolution_pointwise.binary,
                                                  MK._convolution_pointwise_.binary)]
    assert len(adds) == 1
    (add,) = adds
    assert add.target is (MK._convolution_pointwise_.binary if case == "in_place"
                          else MK._convolution_pointwise.binary)
    assert add.args[10] == ("relu" if relu else None)
    assert not any(n.target in (torch.add, torch.ops.aten.add.Tensor) for n in net._lean.gm.graph.nodes)
    close(got, want)
    close(lean_calls(net, x_in(2), monkeypatch, 2), plain(net, x_in(2), monkeypatch))   # a new input


def test_a_convolution_read_elsewhere_is_not_fused(monkeypatch):
    """conv's output is read by the ReLU (not in place) and by the pooling: it must be kept, so
    the ReLU stays a separate op and the convolution aten's."""
    net = make("\n".join([INPUT, conv("conv", "data", "conv"),
                          'layer { name: "act" type: "ReLU" bottom: "conv" top: "r" }',
                          'layer { name: "sum" type: "Eltwise" bottom: "conv" bottom: "r" top: "s" }',
                          pool("s")]))
    x = x_in(3)
    want = plain(net, x, monkeypatch)
    got = lean_calls(net, x, monkeypatch)
    assert not fused(net)
    assert any(n.target is torch.relu for n in net._lean.gm.graph.nodes)
    close(got, want)


BN = """
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" batch_norm_param { use_global_stats: true } }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
"""


@pytest.mark.parametrize("folded", [False, True])
def test_net_surgery_after_the_graph_is_built_is_seen(folded, monkeypatch):
    """Weights written through ``net.params`` (numpy: no torch version bump) or in place by torch
    after the graph was built re-pack the weight at the next call; nothing written, no re-pack."""
    net = make("\n".join([INPUT, conv("conv", "data", "conv"), BN if folded else "",
                          'layer { name: "act" type: "ReLU" bottom: "conv" top: "conv" }', pool("conv")]))
    if folded:
        rng = np.random.default_rng(4)
        net.params["bn"][0].data[...] = rng.standard_normal(32) * 0.1
        net.params["bn"][1].data[...] = rng.random(32) + 0.5
        net.params["bn"][2].data[...] = 1
        net.params["sc"][0].data[...] = rng.random(32) + 0.5
    x = x_in(5)
    lean_calls(net, x, monkeypatch)
    assert [n.args[7] for n in fused(net)] == ["relu"]
    packs = []
    real = postops._pack
    monkeypatch.setattr(postops, "_pack", lambda *a: packs.append(1) or real(*a))
    net.forward(data=x)
    assert not packs                                         # cached: same tensor, same version
    net.params["conv"][0].data[...] = -0.5 * net.params["conv"][0].data
    got = net.forward(data=x)
    assert net._lean._stale and packs                        # still the graph, re-packed
    close(got, plain(net, x, monkeypatch))
    if folded:
        net.params["sc"][0].data[...] *= 3                   # a folded chain's other layer
        close(net.forward(data=x), plain(net, x, monkeypatch))
    with torch.no_grad():
        net.layer_list[1].blobs[1].add_(1.0)                 # a torch write: the version counter
    got = net.forward(data=x)
    assert net._lean._stale
    close(got, plain(net, x, monkeypatch))
