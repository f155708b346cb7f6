"""to_torch and brewnet export: the graph module and the ONNX / .pt2 files compute what the Net
computes, on the real deploy nets (random weights scaled by fan-in, so activations stay in
range) and on the trained LeNet and open_nsfw."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from brewnet.deploy import export_onnx, export_program, to_torch
from brewnet.errors import NetError
from brewnet.net import Net
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_net
from helpers import MODELS, SHARED, need

LENET = MODELS / "bvlc/examples/mnist/lenet.prototxt"
TRAINED_LENET = SHARED / "caffe-models/trained/lenet_mnist_ethereon/examples/mnist"
NSFW = SHARED / "caffe-models/trained/open_nsfw"
# One of each family, small enough for CI (the full sweep over ../shared: benchmarks/export.py).
NETS = ["bvlc/examples/mnist/lenet.prototxt", "bvlc/examples/cifar10/cifar10_quick.prototxt",
        "bvlc/examples/cifar10/cifar10_full.prototxt", "bvlc/examples/siamese/mnist_siamese.prototxt",
        "bvlc/models/bvlc_reference_caffenet/deploy.prototxt",
        "squeezenet/SqueezeNet_v1.1/deploy.prototxt", "mobilenet/mobilenet_deploy.prototxt"]
ONNX_TOO = set(NETS) - {"mobilenet/mobilenet_deploy.prototxt"}   # CI time; open_nsfw covers BN
RTOL = 1e-5


def random_net(path, batch=1) -> Net:
    param = read_net(str(need(path)))
    for lp in param.layer:
        for s in lp.input_param.shape:
            s.dim[0] = batch
    torch.manual_seed(0)
    net = Net(param, pb.TEST)
    with torch.no_grad():
        for layer in net.layer_list:
            for k, b in enumerate(layer.blobs):
                if layer.type == "BatchNorm":     # mean, variance, scale factor
                    b.normal_().mul_(0.1) if k == 0 else b.uniform_(0.5, 1.5) if k == 1 else b.fill_(1)
                elif b.dim() >= 2:
                    b.normal_().mul_(b[0].numel() ** -0.5)
                else:
                    b.normal_().mul_(0.1).add_(1.0 if layer.type == "Scale" and k == 0 else 0.0)
    return net


def net_outputs(net, xs):
    for n, x in zip(net.inputs, xs):
        net.blobs[n].tensor.copy_(x)
    with torch.no_grad():
        net.forward_tensors()
    return [net.blobs[n].tensor.clone() for n in net.outputs]


def rel(a, b) -> float:
    a, b = (t.detach() if isinstance(t, torch.Tensor) else t for t in (a, b))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def as_tuple(y):
    return y if isinstance(y, tuple) else (y,)


def check_onnx(gm, net, xs, tmp_path, batch_dynamic=True):
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "net.onnx"
    export_onnx(gm, out, dynamic_batch=batch_dynamic)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == net.inputs
    got = sess.run(None, {n: x.numpy() for n, x in zip(net.inputs, xs)})
    return max(rel(g, w) for g, w in zip(got, net_outputs(net, xs)))


@pytest.mark.parametrize("path", NETS)
def test_deploy_nets_equal_the_net_in_torch_and_onnx(path, tmp_path):
    net = random_net(MODELS / path)
    gm = to_torch(net)
    assert isinstance(gm, torch.fx.GraphModule) and gm.dynamic_batch
    # Plain torch ops only: no layer objects, no calls into brewnet.
    assert all(n.op in ("placeholder", "get_attr", "call_function", "output") for n in gm.graph.nodes)
    assert "brewnet" not in gm.code
    xs = [torch.randn(net.shapes[n]) for n in net.inputs]
    want = net_outputs(net, xs)
    got = as_tuple(gm(*xs))
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    assert max(rel(g, w) for g, w in zip(got, want)) < RTOL
    assert max(float(w.std()) for w in want) > 0     # the comparison saw real values
    if path in ONNX_TOO:
        assert check_onnx(gm, net, xs, tmp_path) < RTOL


def test_lenet_module_surface(tmp_path):
    net = random_net(LENET, batch=4)
    gm = to_torch(net)
    sd = gm.state_dict()
    assert list(sd) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                        "ip1.weight", "ip1.bias", "ip2.weight", "ip2.bias"]
    assert torch.equal(sd["ip1.weight"], net.layer_by_name["ip1"].blobs[0].detach())
    assert gm.input_names == ["data"] and gm.output_names == ["prob"]
    x = torch.rand(7, 1, 28, 28)                 # another batch size than the prototxt's
    y = gm(x)
    half = to_torch(net).half()
    assert half(x.half()).dtype == torch.float16
    assert (half(x.half()).float() - y).abs().max() < 1e-2
    meta = to_torch(net).to("meta")               # no tensor left behind on the CPU
    assert meta(x.to("meta")).device.type == "meta"
    gm2 = to_torch(LENET)                         # the loaded state_dict gives the same numbers
    gm2.load_state_dict(sd)
    assert torch.equal(gm2(x), y)
    ep = torch.export.export(gm, (x,), dynamic_shapes=({0: torch.export.Dim("b")},))
    assert torch.equal(ep.module()(x), y)
    export_program(gm, tmp_path / "lenet.pt2")
    assert rel(torch.export.load(str(tmp_path / "lenet.pt2")).module()(x), y) < RTOL
    y.sum().backward()                            # trainable: gradients reach the parameters
    assert gm.conv1.weight.grad is not None


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_torch_compile_lenet():
    net = random_net(LENET, batch=2)
    gm = to_torch(net)
    x = torch.rand(2, 1, 28, 28)
    assert rel(torch.compile(gm)(x).detach(), net_outputs(net, [x])[0]) < RTOL


def test_trained_lenet():
    d = need(TRAINED_LENET)
    net = Net(str(d / "lenet.prototxt"), pb.TEST, weights=str(d / "lenet_iter_10000.caffemodel"))
    gm = to_torch(str(d / "lenet.prototxt"), weights=str(d / "lenet_iter_10000.caffemodel"))
    x = torch.rand(net.shapes["data"])
    assert rel(gm(x).detach(), net_outputs(net, [x])[0]) < RTOL


def test_open_nsfw_folded_and_onnx(tmp_path):
    model, weights = need(NSFW / "deploy.prototxt"), NSFW / "resnet_50_1by2_nsfw.caffemodel"
    net = Net(str(model), pb.TEST, weights=str(need(weights)))
    x = torch.randn(net.shapes["data"]) * 50
    want = net_outputs(net, [x])[0]
    plain, folded = to_torch(net), to_torch(net, fold=True)
    assert not any(n.endswith("running_mean") for n in folded.state_dict())
    assert any(n.endswith("running_mean") for n in plain.state_dict())
    with torch.no_grad():
        assert rel(plain(x), want) < RTOL
        assert rel(folded(x), want) < RTOL
    assert check_onnx(folded, net, [x], tmp_path) < RTOL


def test_layers_without_a_graph_are_named():
    spec = """name: "p" layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
    layer { name: "mine" type: "Python" bottom: "data" top: "y" python_param { module: "m" layer: "L" } }"""
    param = pb.NetParameter()
    from google.protobuf import text_format

    text_format.Parse(spec, param)
    with pytest.raises(Exception) as e:   # the Python layer fails to load, or to_torch refuses it
        to_torch(param)
    assert "mine" in str(e.value)
    dummy = pb.NetParameter()
    text_format.Parse("""name: "d" layer { name: "noise" type: "DummyData" top: "x"
        dummy_data_param { shape { dim: 1 dim: 3 } } }
        layer { name: "r" type: "ReLU" bottom: "x" top: "y" }""", dummy)
    with pytest.raises(NetError, match="Layer 'noise' \\(type DummyData\\) makes its own data"):
        to_torch(dummy)


def test_export_cli(tmp_path):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "lenet.onnx"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "brewnet.cli", "export", "--model", str(LENET),
                        "--out", str(out), "--batch", "dynamic", "--opset", "17"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "max |diff| vs the Net" in r.stderr and out.stat().st_size > 1000
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"data": np.zeros((3, 1, 28, 28), np.float32)})[0].shape == (3, 10)
    r = subprocess.run([sys.executable, "-m", "brewnet.cli", "export", "--model", str(LENET),
                        "--out", str(tmp_path / "x.onnx"), "--opset", "13"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "opset 17 or later" in r.stderr
