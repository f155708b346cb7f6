"""The lean paths against the plain paths on the CPU: the grouped ``_foreach`` updates of every
rule bit for bit, and the one-graph inference of pycaffe's ``Net.forward`` (with its fallback
keeping Caffe's blob semantics) within ``LEAN_RTOL`` where brewnet/lean.py re-chooses a kernel,
bit for bit where it does not."""
import numpy as np
import pytest
import torch

import brewnet
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text
from helpers import ON_DEVICE

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 2 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        param { lr_mult: 1 } param { lr_mult: 2 }
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
RULES = {
    "SGD": "momentum: 0.9", "Nesterov": "momentum: 0.9", "AdaGrad": "", "RMSProp": "rms_decay: 0.95",
    "AdaDelta": "momentum: 0.95 delta: 1e-6", "Adam": "momentum: 0.9 momentum2: 0.999",
}


def run(rule: str, extra: str, foreach: bool, iters: int = 6):
    p = parse_text(f'type: "{rule}" base_lr: 0.05 lr_policy: "fixed" weight_decay: 5e-3 '
                   f'max_iter: 10 random_seed: 7 {extra}', pb.SolverParameter())
    p.net_param.CopyFrom(parse_text(NET, pb.NetParameter()))
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((4, 2, 8, 8)).astype(np.float32), rng.integers(0, 5, 4))
               for _ in range(iters)]
    s = brewnet.get_solver(p, train_feed=lambda i: {"data": batches[i][0], "label": batches[i][1]})
    s.foreach = foreach
    s.step(iters)
    return [t.detach().clone() for t in s.net.learnable], [h.clone() for h in s.history]


@pytest.mark.parametrize("rule,extra", [(r, e) for r, e in RULES.items()]
                         + [("SGD", "momentum: 0"), ("SGD", 'momentum: 0.9 regularization_type: "L1"')])
def test_foreach_updates_are_bit_identical(rule, extra):
    fast, plain = run(rule, extra, True), run(rule, extra, False)
    for a, b in zip(fast[0] + fast[1], plain[0] + plain[1]):
        assert torch.equal(a, b)


def test_subclass_overriding_compute_update_keeps_it():
    from brewnet.solvers import SGDSolver

    class Halved(SGDSolver):
        def compute_update(self, i, param, grad, local_rate):
            grad.mul_(0.5 * local_rate)

    p = parse_text('base_lr: 0.1 lr_policy: "fixed" max_iter: 1 solver_mode: CPU', pb.SolverParameter())
    p.net_param.CopyFrom(parse_text(NET, pb.NetParameter()))
    s = Halved(p)
    assert not s._foreach_ok()


DEPLOY = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 10 dim: 10 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param { use_global_stats: true } }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""


def deploy_net():
    brewnet.set_random_seed(5)
    net = brewnet.Net(parse_text(DEPLOY, pb.NetParameter()), brewnet.TEST)
    rng = np.random.default_rng(1)
    bn = net.params["bn1"]
    bn[0].data[...] = rng.standard_normal(4) * 0.1
    bn[1].data[...] = rng.random(4) + 0.5
    bn[2].data[...] = 1
    net.params["sc1"][0].data[...] = rng.random(4) + 0.5
    return net


@pytest.fixture
def lean_soon(monkeypatch):
    from brewnet import lean

    monkeypatch.setattr(lean, "AFTER", 1)
    monkeypatch.setenv("BREWNET_LEAN", "1")


def plain_forward(net, x, monkeypatch, blobs=()):
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        return {k: v.copy() for k, v in net.forward(blobs=list(blobs), data=x).items()}


@pytest.mark.cpu_only("the default: on CUDA lean is used only when asked for until the GPU run "
                     "has passed (brewnet/solvers/cuda_graph.py DEFAULT_ON_CUDA)")
@pytest.mark.parametrize("env,lean_on", [(None, True), ("1", True), ("0", False)])
def test_lean_inference_default_and_override(monkeypatch, env, lean_on):
    from brewnet import lean

    monkeypatch.setattr(lean, "AFTER", 1)
    if env is None:
        monkeypatch.delenv("BREWNET_LEAN", raising=False)
    else:
        monkeypatch.setenv("BREWNET_LEAN", env)
    net = deploy_net()
    for _ in range(3):
        net.forward()
    assert (net._lean.gm is not None) == lean_on


def test_a_bad_lean_switch_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("BREWNET_LEAN", "yes")
    net = deploy_net()
    with pytest.raises(ValueError, match=r"BREWNET_LEAN='yes': expected one of 0, 1"):
        net.forward()


@pytest.mark.cpu_only("live numpy views of blobs: on CUDA a view is a host mirror refreshed when "
                     "read (Caffe's SyncedMemory), and a mirrored intermediate keeps the plain path")
def test_lean_forward_matches_and_keeps_blob_semantics(lean_soon, monkeypatch):
    net = deploy_net()
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((2, 3, 10, 10)).astype(np.float32) for _ in range(4)]
    ref = [plain_forward(net, x, monkeypatch, ["conv1", "pool1", "ip1"]) for x in xs]
    net.forward(data=xs[0])                         # counted
    out = net.forward(data=xs[1])["prob"]           # traced, then run as one graph
    assert net._lean.gm is not None and net._lean._stale
    # Within float32 rounding of the plain path (the graph may choose other kernels).
    np.testing.assert_allclose(out, ref[1]["prob"], rtol=1e-5, atol=1e-7)
    # An intermediate read after a lean forward shows that forward's values, even when the
    # input blob was written since: the plain path runs on the inputs the graph saw.
    net.blobs["data"].data[...] = 0
    for name in ("conv1", "pool1", "ip1"):
        np.testing.assert_array_equal(net.blobs[name].data, ref[1][name])
    # A live view of an intermediate blob follows each forward: the plain path serves it.
    view = net.blobs["ip1"].data
    net.forward(data=xs[2])
    np.testing.assert_array_equal(view, ref[2]["ip1"])
    assert not net._lean._stale
    # Writing an intermediate blob and running the rest of the net uses what was written.
    view[...] = 0
    tail = net.forward(start="prob")["prob"]
    np.testing.assert_allclose(tail, np.full((2, 6), 1 / 6, np.float32), rtol=1e-6)
    del view, tail
    net.forward(data=xs[3])
    out = net.forward(data=xs[3])["prob"]
    assert net._lean._stale                          # back on the graph
    np.testing.assert_allclose(out, ref[3]["prob"], rtol=1e-5, atol=1e-7)


def test_lean_forward_sees_net_surgery(lean_soon, monkeypatch):
    net = deploy_net()
    x = np.random.default_rng(3).standard_normal((2, 3, 10, 10)).astype(np.float32)
    for _ in range(3):
        net.forward(data=x)
    assert net._lean.gm is not None
    net.params["ip1"][0].data[...] *= 2             # an unfolded layer's weights
    net.params["sc1"][0].data[...] *= 3             # and a folded chain's
    got = net.forward(data=x)["prob"].copy()
    np.testing.assert_allclose(got, plain_forward(net, x, monkeypatch)["prob"], rtol=1e-5, atol=1e-7)


BIGCONV = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 8 dim: 32 dim: 32 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 32 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
"""


@pytest.mark.cpu_only("oneDNN's NHWC weights: a CPU kernel choice")
def test_nhwc_weights_are_bit_identical_and_follow_surgery(lean_soon, monkeypatch):
    """A oneDNN convolution's weight is bound in NHWC memory (cached): the plain path's numbers
    bit for bit, and a write through ``net.params`` is seen at the next forward."""
    from brewnet import lean

    brewnet.set_random_seed(2)
    net = brewnet.Net(parse_text(BIGCONV, pb.NetParameter()), brewnet.TEST)
    x = np.random.default_rng(5).standard_normal((1, 8, 32, 32)).astype(np.float32)
    for _ in range(3):
        got = net.forward(data=x)["pool"].copy()
    assert lean.conv_weights(net._lean.gm)                   # a oneDNN convolution, not small
    np.testing.assert_array_equal(got, plain_forward(net, x, monkeypatch)["pool"])
    net.params["conv"][0].data[...] *= -0.5
    got = net.forward(data=x)["pool"].copy()
    assert net._lean._stale                                  # still the graph
    np.testing.assert_array_equal(got, plain_forward(net, x, monkeypatch)["pool"])


def backward_net(text: str):
    brewnet.set_random_seed(6)
    return brewnet.Net(parse_text(text, pb.NetParameter()), brewnet.TEST)


@pytest.mark.parametrize("how", ["force_backward", "loss_weight"])
def test_nets_that_need_backward_run_forwards_on_the_graph_and_backward_as_eager(how, lean_soon, monkeypatch):
    """A net that may be asked for a backward (force_backward, saliency's deploy nets; a loss)
    runs its forward-only calls on the graph; a backward() after one of them gives the eager
    net's gradients bit for bit (the plain forward runs again under autograd), and the next
    ``AFTER`` forwards stay plain (a forward-backward loop)."""
    text = ("force_backward: true\n" + DEPLOY if how == "force_backward"
            else DEPLOY.replace('type: "Softmax"', 'type: "Softmax" loss_weight: 1'))
    net, eager = backward_net(text), backward_net(text)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((2, 3, 10, 10)).astype(np.float32) for _ in range(4)]
    top = rng.standard_normal((2, 6)).astype(np.float32)
    from brewnet import lean

    for i, x in enumerate(xs):
        got = net.forward(data=x)["prob"].copy()
        assert net._lean.replayed == (i >= lean.AFTER), i      # at the same call as any net
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        want = eager.forward(data=xs[-1])["prob"].copy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        for n in (net, eager):
            n.blobs["data"].data[...] = 0           # backward reads the forward's inputs
            n.blobs["prob"].diff[...] = top
        ref = eager.backward()["data"].copy()
    diff = net.backward()["data"].copy()
    np.testing.assert_array_equal(diff, ref)
    np.testing.assert_array_equal(net.blobs["prob"].data, got)    # the graph's outputs stay
    for name in ("conv1", "ip1"):
        for a, b in zip(net.params[name], eager.params[name]):
            np.testing.assert_array_equal(a.diff, b.diff)
    assert not net._lean.replayed
    net.forward(data=xs[0])                          # after a backward: plain again
    assert not net._lean.replayed


LEAN_RTOL = 1e-5      # brewnet/lean.py: other kernels sum in another order (float32 rounding)
MODEL_NETS = {
    "LeNet": ("caffe-models/trained/lenet_mnist_ethereon/examples/mnist/lenet.prototxt",
              "caffe-models/trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel"),
    "CIFAR-10": ("caffe-models/bvlc/examples/cifar10/cifar10_quick.prototxt", None),
    "open_nsfw": ("caffe-models/trained/open_nsfw/deploy.prototxt",
                  "caffe-models/trained/open_nsfw/resnet_50_1by2_nsfw.caffemodel"),
}


@pytest.mark.parametrize("name,batch", [("LeNet", 1), ("LeNet", 4), ("CIFAR-10", 1), ("open_nsfw", 1)])
def test_lean_matches_plain_on_models(name, batch, lean_soon, monkeypatch):
    """The graph with its kernel choices (small convolutions on torch's own kernel, large inner
    products on oneDNN's) gives the plain path's outputs within ``LEAN_RTOL`` of their scale."""
    from helpers import SHARED, need, pick

    proto, weights = MODEL_NETS[name]
    proto = need(pick(proto) if weights is None else SHARED / proto)
    brewnet.set_random_seed(3)
    net = brewnet.Net(str(proto), brewnet.TEST, weights=str(need(SHARED / weights)) if weights else None)
    shape = (batch,) + net.blobs[net.inputs[0]].shape[1:]
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    feed = net.inputs[0]
    ref = [plain_forward(net, x, monkeypatch) for x in xs]
    net.forward(**{feed: xs[0]})                    # counted (AFTER is 1)
    for x, want in zip(xs, ref):
        got = net.forward(**{feed: x})
        assert net._lean.gm is not None
        for k, v in want.items():
            assert np.abs(got[k] - v).max() <= LEAN_RTOL * np.abs(v).max() + 1e-30, k
            fused = any(str(n.target).startswith("mkldnn._convolution_pointwise")
                        for n in net._lean.gm.graph.nodes)     # execution/postops.py: re-chosen
            if name == "open_nsfw" and not fused:   # no kernel re-chosen there: the same numbers
                np.testing.assert_array_equal(got[k], v)
    if name == "LeNet" and batch == 1 and not ON_DEVICE:   # both convolutions under SMALL_CONV_FLOPS
        from brewnet import lean

        assert sum(n.target is lean.small_conv for n in net._lean.gm.graph.nodes) == 2


def test_graph_is_recorded_not_exported(lean_soon, monkeypatch):
    """The graph comes from one recorded run (milliseconds); torch.export (seconds on its first
    call in a process) only when the recording refuses, with the same outputs."""
    from brewnet import graph_record
    from brewnet.deploy import graph as deploy_graph

    exported = []
    real = deploy_graph.traced_program
    monkeypatch.setattr(deploy_graph, "traced_program", lambda *a, **k: exported.append(1) or real(*a, **k))
    x = np.random.default_rng(1).standard_normal((2, 3, 10, 10)).astype(np.float32)
    brewnet.set_random_seed(4)
    net = brewnet.Net(parse_text(DEPLOY, pb.NetParameter()), brewnet.TEST)
    for _ in range(3):
        recorded = net.forward(data=x)["prob"].copy()
    assert net._lean.gm is not None and not exported

    def refuse(*a, **k):
        raise graph_record.RecordError("the run branched on a value")
    monkeypatch.setattr(graph_record, "record", refuse)
    brewnet.set_random_seed(4)
    net = brewnet.Net(parse_text(DEPLOY, pb.NetParameter()), brewnet.TEST)
    for _ in range(3):
        got = net.forward(data=x)["prob"].copy()
    assert net._lean.gm is not None and exported
    np.testing.assert_array_equal(got, recorded)


def test_an_image_pyramid_gets_its_graph_per_scale_at_the_defaults(monkeypatch):
    """MTCNN's P-Net runs each image at several scales, one input shape each: every scale is
    traced once and kept (``lean.SHAPES``), not started afresh whenever the shape changes; its
    outputs are the plain path's (within LEAN_RTOL). At the defaults but for the engine: the
    graph itself is what is tested here."""
    from pathlib import Path

    from brewnet.execution import lean

    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    proto = Path(__file__).resolve().parents[1] / "benchmarks/zoo/nets/mtcnn_det1.prototxt"
    net = brewnet.pycaffe.Net(str(proto), brewnet.TEST, engine="eager")
    plain = brewnet.pycaffe.Net(str(proto), brewnet.TEST, engine="eager")
    for a, b in zip(net.layers, plain.layers):
        for pa, pb_ in zip(a.blobs, b.blobs):
            pb_.data[...] = pa.data = np.random.default_rng(0).standard_normal(pa.data.shape) * 0.1
    scales = [(1, 3, 60, 80), (1, 3, 43, 57), (1, 3, 30, 40)]
    rng = np.random.default_rng(1)
    for image in range(lean.AFTER + 2):
        for shape in scales:
            x = rng.standard_normal(shape).astype(np.float32)
            got = {k: v.copy() for k, v in net.forward(data=x).items()}
            want = plain_forward(plain, x, monkeypatch)
            for k in want:
                scale = float(np.abs(want[k]).max())
                assert np.abs(got[k] - want[k]).max() <= LEAN_RTOL * scale, (image, shape, k)
    assert net._lean.traces == len(scales)
    assert net._lean.gm is not None and len(net._lean._shapes) == len(scales) - 1
    assert all(s["gm"] is not None for s in net._lean._shapes.values())
    # more shapes than SHAPES: the oldest are let go
    for h in range(lean.SHAPES + 2):
        net.forward(data=np.zeros((1, 3, 20 + h, 20), np.float32))
    assert len(net._lean._shapes) == lean.SHAPES


def test_mtcnn_pnet_takes_the_size_chosen_kernels_with_the_numbers_of_torchs(monkeypatch):
    """MTCNN's P-Net on a 320x240 image at the defaults (but for the engine: the graph is what is
    tested) hits each size rule of the inference kernels: its 10-channel 2x2 pooling as a chain
    of maxima (brewnet/layers/pooling.py), its 10-channel PReLU as NHWC rows (layers/neuron.py),
    its 2-output 1x1 convolution on oneDNN (not ``small_conv``, which would copy the 32x115x155
    input to NCHW: lean.SMALL_CONV_MAX_INPUT). Every call, plain and past the graph's, against
    the plain path on torch's own kernels: the same values on the plain path, within LEAN_RTOL
    on the graph."""
    from pathlib import Path

    from brewnet.execution import lean
    from brewnet.layers import neuron, pooling

    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    proto = Path(__file__).resolve().parents[1] / "benchmarks/zoo/nets/mtcnn_det1.prototxt"
    net = brewnet.pycaffe.Net(str(proto), brewnet.TEST, engine="eager")
    rng = np.random.default_rng(0)
    for layer in net.layers:
        for p in layer.blobs:
            p.data[...] = rng.standard_normal(p.data.shape) * 0.1
    net.blobs["data"].reshape(1, 3, 240, 320)
    net.reshape()
    x = rng.standard_normal((1, 3, 240, 320)).astype(np.float32)
    with monkeypatch.context() as m:               # torch's kernels: the rules say no
        m.setattr(pooling, "_window_max_ok", lambda *a: False)
        m.setattr(neuron, "_prelu_rows_ok", lambda *a: False)
        want = plain_forward(net, x, monkeypatch)
    taken = {"pool": 0, "prelu": 0}
    for name, key in (("_window_max", "pool"), ("_prelu_rows_ok", "prelu")):
        mod = pooling if key == "pool" else neuron
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, key=key: (
            taken.__setitem__(key, taken[key] + bool(real(*a)) if key == "prelu" else taken[key] + 1)
            or real(*a)))
    for call in range(lean.AFTER + 3):
        got = net.forward(data=x)
        for k, v in want.items():
            if net._lean.gm is None:
                np.testing.assert_array_equal(got[k], v)
            else:
                assert np.abs(got[k] - v).max() <= LEAN_RTOL * np.abs(v).max(), (call, k)
    assert taken["pool"] >= 1 and taken["prelu"] >= 1      # (recorded: in the graph as its ops)
    nodes = net._lean.gm.graph.nodes
    assert any(getattr(n.target, "__name__", "") == "maximum" for n in nodes)
    assert not any(n.target is lean.small_conv for n in nodes)
