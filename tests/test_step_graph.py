"""The recorded forward-backward (brewnet/solvers/step_graph.py): the same bits as the eager
step, its fallbacks, and pycaffe's blob semantics around it. The tests marked with the
``backend`` parameter drive both backends, the CPU's recorded graph and its CUDA graph
(brewnet/solvers/cuda_graph.py); the CUDA case skips with one reason without a GPU."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import parse_text
from brewnet.solvers import SOLVERS
from helpers import DEVICE, host, random_digits_lmdb

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here)"
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason=NO_CUDA))]

LOGREG = """name: "logreg"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 10 dim: 4 } shape { dim: 10 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def conv_net(source: str, extra: str = "") -> str:
    return f"""name: "small"
layer {{ name: "d" type: "Data" top: "data" top: "label" transform_param {{ scale: 0.0039 }}
        data_param {{ source: "{source}" batch_size: 8 backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }}
{extra}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
"""


def make_solver(net: str, solver_type: str = "SGD", feed=None, extra: str = "", device=DEVICE):
    param = parse_text(f"""type: "{solver_type}" base_lr: 0.05 momentum: 0.9 weight_decay: 5e-4
        lr_policy: "inv" gamma: 0.0001 power: 0.75 max_iter: 1000 display: 0 random_seed: 3
        {extra}""", pb.SolverParameter())
    if solver_type == "Adam":
        param.momentum2 = 0.999
    param.net_param.CopyFrom(parse_text(net, pb.NetParameter()))
    return SOLVERS[solver_type](param, train_feed=feed, device=device)


def logreg_feed(bad_at: int | None = None):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((50, 10, 4)).astype(np.float32)
    ys = rng.integers(0, 3, (50, 10)).astype(np.float32)
    if bad_at is not None:
        ys[bad_at, 4] = 7
    return lambda i: {"data": xs[i % 50], "label": ys[i % 50]}


def state(s) -> list[np.ndarray]:
    return ([host(p).copy() for p in s.net.learnable]
            + [host(h).copy() for h in s.history]
            + [s.net.blobs[n].data.copy() for n in s.net.blobs])


def run_both(monkeypatch, make, steps: int):
    """(eager solver, graph solver) after ``steps`` iterations each."""
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    eager = make()
    eager.step(steps)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    graph = make()
    graph.step(steps)
    return eager, graph


def assert_same(a, b):
    for x, y in zip(state(a), state(b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("solver_type", ["SGD", "Adam", "Nesterov"])
def test_logreg_graph_equals_eager_bitwise(monkeypatch, solver_type, backend):
    from brewnet.solvers.cuda_graph import CudaStepGraph

    eager, graph = run_both(monkeypatch, lambda: make_solver(LOGREG, solver_type, logreg_feed(),
                                                             device=backend), 30)
    assert getattr(eager, "_graph", None) is None
    assert graph._graph.gm is not None          # the graph ran the steps after the first
    assert isinstance(graph._graph, CudaStepGraph) == (backend == "cuda")
    assert graph._graph.side_tops == ["accuracy"]
    assert_same(eager, graph)
    assert eager.smoothed_loss == graph.smoothed_loss


def test_conv_net_on_lmdb_equals_eager_bitwise(monkeypatch, tmp_path):
    src = random_digits_lmdb(tmp_path / "db", 40, 12, seed=1)
    eager, graph = run_both(monkeypatch, lambda: make_solver(conv_net(src)), 12)
    assert graph._graph.gm is not None
    assert_same(eager, graph)


SHARED = """name: "shared"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 10 dim: 4 } shape { dim: 10 } } }
layer { name: "a" type: "InnerProduct" bottom: "data" top: "a" param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "b" type: "InnerProduct" bottom: "data" top: "b" param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 6 } }
layer { name: "relu" type: "ReLU" bottom: "a" top: "a" }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" }
layer { name: "cat" type: "Concat" bottom: "sum" bottom: "b" top: "cat" }
layer { name: "out" type: "InnerProduct" bottom: "cat" top: "out"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }
"""


def test_shared_weights_split_blobs_and_in_place_layers_equal_eager_bitwise(monkeypatch):
    eager, graph = run_both(monkeypatch, lambda: make_solver(SHARED, "Nesterov", logreg_feed()), 20)
    assert graph._graph.gm is not None
    assert len(graph._graph.params) == 4          # the shared pair counted once
    assert_same(eager, graph)


@pytest.mark.parametrize("extra", ["", "momentum: 0", "regularization_type: 'L1'"])
def test_long_run_equals_eager_bitwise_with_diffs(monkeypatch, extra):
    """A few hundred steps under a step lr policy: losses, params, history and the param diffs
    (which hold the last step, copied in when the run ends) are the eager step's bits."""
    def make():
        s = make_solver(LOGREG, feed=logreg_feed())
        s.param.MergeFrom(parse_text(f'lr_policy: "step" stepsize: 100 gamma: 0.5 {extra}',
                                     pb.SolverParameter()))
        s.losses = []
        s.add_callback(on_gradients=lambda: s.losses.append(s.loss))
        return s
    eager, graph = run_both(monkeypatch, make, 300)
    assert graph._graph.gm is not None
    assert_same(eager, graph)
    assert eager.losses == graph.losses
    for a, b in zip(eager.net.learnable, graph.net.learnable):
        np.testing.assert_array_equal(host(a.grad), host(b.grad))


def test_loss_diff_written_after_capture_is_seen(monkeypatch):
    """The seed over the batch size is computed once at capture; a later write of the loss
    weight's diff (numpy view or torch) must reach the replay as it reaches the eager step."""
    def run():
        s = make_solver(LOGREG, feed=logreg_feed())
        s.step(5)
        folded = getattr(s, "_graph", None) is not None and "_folded" in s._graph.gm.code
        s.net.blobs["loss"].diff[...] = 2.0
        s.step(5)
        s.net.blobs["loss"].diff_tensor.mul_(0.25)
        s.step(5)
        return s, folded
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    eager, _ = run()
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    graph, folded = run()
    assert folded
    assert graph._graph.gm is not None
    assert_same(eager, graph)


@pytest.mark.cpu_only("a live numpy view: on CUDA a blob's view is a host mirror refreshed when "
                     "read (Caffe's SyncedMemory)")
def test_lazy_side_top_follows_reads_and_views(monkeypatch):
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    eager = make_solver(LOGREG, feed=logreg_feed())
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    graph = make_solver(LOGREG, feed=logreg_feed())
    for k in range(6):                          # read after every step: the step's own value
        eager.step(1)
        graph.step(1)
        assert graph.net.blobs["accuracy"].data == eager.net.blobs["accuracy"].data
    view = graph.net.blobs["accuracy"].data     # a live view must follow each step at once
    eager.step(3)
    graph.step(3)
    assert view == eager.net.blobs["accuracy"].data
    assert_same(eager, graph)


def test_out_of_range_label_is_still_caught(monkeypatch):
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    s = make_solver(LOGREG, feed=logreg_feed(bad_at=5))
    s.step(3)
    assert s._graph.gm is not None
    with pytest.raises(Exception, match=r"label 7 at position 4 is out of range"):
        s.step(5)


def test_bad_label_in_a_replay_raises_the_eager_error(monkeypatch):
    def first_error(mode):
        monkeypatch.setenv("BREWNET_STEP_GRAPH", mode)
        s = make_solver(LOGREG, feed=logreg_feed(bad_at=40))
        with pytest.raises(Exception) as e:
            s.step(50)
        return s, str(e.value)
    eager, msg = first_error("0")
    graph, graph_msg = first_error("1")
    assert graph._graph.gm is not None and graph.iter == eager.iter == 40
    assert graph_msg == msg and "label 7 at position 4 is out of range" in msg


def test_weights_changed_between_steps_are_seen(monkeypatch):
    def run():
        s = make_solver(LOGREG, feed=logreg_feed())
        s.step(5)
        s.net.layer_by_name["ip1"].blobs[0].data.mul_(0.5)     # surgery, in place
        s.step(5)
        return s
    eager, graph = run_both(monkeypatch, run, 0)
    assert graph._graph.gm is not None
    assert_same(eager, graph)


def test_input_reshape_retraces_or_runs_eager(monkeypatch):
    def feed(i):
        n = 10 if i < 6 else 6
        rng = np.random.default_rng(i)
        return {"data": rng.standard_normal((n, 4)).astype(np.float32),
                "label": rng.integers(0, 3, n).astype(np.float32)}
    eager, graph = run_both(monkeypatch, lambda: make_solver(LOGREG, feed=feed), 12)
    assert graph._graph.gm is not None and graph._graph.key[0][0][0] == (6, 4)
    assert_same(eager, graph)


@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_nets_keep_the_eager_step(monkeypatch, tmp_path, caplog, backend):
    src = random_digits_lmdb(tmp_path / "db", 20, 12, seed=2)
    drop = 'layer { name: "drop" type: "Dropout" bottom: "pool1" top: "pool1" }'
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    with caplog.at_level(logging.DEBUG, logger="brewnet"):
        s = make_solver(conv_net(src, drop), device=backend)
        s.step(3)
    assert getattr(s, "_graph", None) is None
    assert "layer 'drop' of type Dropout" in caplog.text
    s = make_solver(LOGREG, feed=logreg_feed(), extra="iter_size: 2", device=backend)
    s.step(2)
    assert getattr(s, "_graph", None) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replay_that_differs_at_capture_keeps_the_eager_step(monkeypatch, caplog, backend):
    """The bitwise check at capture: a graph whose first replay is one ulp off the eager step
    (here made so) is dropped, with a warning, and the run keeps the eager step's bits."""
    from brewnet.solvers.cuda_graph import CudaStepGraph
    from brewnet.solvers.step_graph import StepGraph

    cls = CudaStepGraph if backend == "cuda" else StepGraph
    real = cls._run

    def off_by_an_ulp(self, xs):
        out = real(self, xs)
        return (torch.nextafter(out[0], out[0] + 1), *out[1:])
    monkeypatch.setattr(cls, "_run", off_by_an_ulp)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        eager, graph = run_both(monkeypatch, lambda: make_solver(LOGREG, feed=logreg_feed(),
                                                                 device=backend), 8)
    assert graph._graph.gm is None and graph._graph.captures == 3
    assert "the recorded step differs from the eager one" in caplog.text
    assert_same(eager, graph)


class StaticMemory:
    """A CPU stand-in for ``cuda_graph.CapturedGraph`` with its memory semantics: inputs copied
    into static buffers, outputs handed out in memory the next call rewrites in place, and the
    warm-up runs whose writes into ``state`` (params, history) are put back before the capture."""

    def __init__(self, fn, xs, state=()):
        self.fn, self.static, self.outs = fn, [x.detach().clone() for x in xs], None
        saved = [t.clone() for t in state]
        for _ in range(3):
            fn(*self.static)
        for t, v in zip(state, saved):
            t.copy_(v)

    def __call__(self, xs):
        for s, x in zip(self.static, xs):
            s.copy_(x)
        out = self.fn(*self.static)
        if self.outs is None:
            self.outs = tuple(o.clone() for o in out)
        else:
            for o, n in zip(self.outs, out):
                o.copy_(n)
        return self.outs


@pytest.mark.parametrize("net", ["logreg", "conv"])
def test_cuda_step_graph_logic_on_cpu_static_memory(monkeypatch, tmp_path, net):
    """CudaStepGraph's replay with outputs in static memory (rewritten by each replay, as a CUDA
    graph's are), run on the CPU: the solver's update, the lazy side tops and the next step must
    not read a value the following replay overwrote: the eager run's bits, step after step. From
    the iteration after the capture forward, backward and update are one graph (``whole``)."""
    from brewnet.solvers import cuda_graph, step_graph

    monkeypatch.setattr(cuda_graph, "CapturedGraph", StaticMemory)
    monkeypatch.setattr(step_graph, "StepGraph", cuda_graph.CudaStepGraph)
    if net == "logreg":
        def make():
            return make_solver(LOGREG, "Nesterov", logreg_feed(), device="cpu")
    else:
        src = random_digits_lmdb(tmp_path / "db", 40, 12, seed=1)

        def make():
            return make_solver(conv_net(src), device="cpu")
    eager, graph = run_both(monkeypatch, make, 25)
    assert type(graph._graph) is cuda_graph.CudaStepGraph and graph._graph.gm is not None
    assert isinstance(graph._graph.captured, StaticMemory)
    assert isinstance(graph._graph.whole, StaticMemory) and graph._graph.update.gm is not None
    assert_same(eager, graph)
    for a, b in zip(eager.net.learnable, graph.net.learnable):
        np.testing.assert_array_equal(host(a.grad), host(b.grad))


def test_a_net_on_cuda_gets_the_cuda_graph_and_other_devices_are_refused():
    """The dispatch and the device refusal need no GPU: a CUDA net's StepGraph is a
    CudaStepGraph; a device without CUDA graphs is refused with its name."""
    from types import SimpleNamespace

    from brewnet.solvers import cuda_graph
    from brewnet.solvers.step_graph import StepGraph

    def fake(device):
        return SimpleNamespace(device=torch.device(device), bottom_lists=[])
    assert type(StepGraph(fake("cuda:0"))) is cuda_graph.CudaStepGraph
    assert type(StepGraph(fake("cpu"))) is StepGraph
    assert cuda_graph.device_refusal(torch.device("cpu")) is None
    assert cuda_graph.device_refusal(torch.device("meta")) == "device meta: no CUDA graphs there"
    if not torch.cuda.is_available():
        assert cuda_graph.device_refusal(torch.device("cuda:0")) == \
            "device cuda:0: no CUDA graphs there"
    elif not cuda_graph.DEFAULT_ON_CUDA:          # until the GPU run has passed: when asked for
        assert "only when asked for" in cuda_graph.device_refusal(torch.device("cuda:0"), asked=False)


def test_auto_mode_waits_for_a_long_run(monkeypatch):
    from brewnet.solvers import step_graph

    monkeypatch.delenv("BREWNET_STEP_GRAPH", raising=False)
    monkeypatch.setattr(step_graph, "MIN_ITERS", 40)
    s = make_solver(LOGREG, feed=logreg_feed())
    s.step(20)                                  # short: not worth a trace
    assert getattr(s, "_graph", None) is None
    s.step(45)
    assert s._graph.gm is not None
    s = make_solver(LOGREG, feed=logreg_feed())
    for _ in range(39):                         # a loop of short calls (the notebook's solve())
        s.step(1)
    assert getattr(s, "_graph", None) is None
    s.step(2)
    assert s._graph.gm is not None


def test_a_bad_switch_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "off")
    s = make_solver(LOGREG, feed=logreg_feed())
    with pytest.raises(ValueError, match=r"BREWNET_STEP_GRAPH='off': expected one of auto, 0, 1"):
        s.step(1)


def test_auto_mode_leaves_kernel_bound_nets_eager(monkeypatch):
    from brewnet.solvers import step_graph

    monkeypatch.delenv("BREWNET_STEP_GRAPH", raising=False)
    monkeypatch.setattr(step_graph, "MIN_ITERS", 1)
    monkeypatch.setattr(step_graph, "MAX_EAGER_S", 0.0)     # every step counts as slow
    s = make_solver(LOGREG, feed=logreg_feed())
    s.step(5)
    assert s._graph.gm is None and s._graph.captures == 0
    monkeypatch.setattr(step_graph, "MAX_EAGER_S", 10.0)
    s.step(2)
    assert s._graph.gm is not None


# -- the recorder (brewnet/graph_record.py) ---------------------------------------------
def test_recorder_replays_a_function_and_reads_params_by_reference():
    from brewnet.graph_record import record

    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(5, 4)

    def f(x):
        y = torch.relu(x @ w.t())
        z = torch.zeros_like(y)
        z.add_(y)                                  # in place on a recorded tensor
        (g,) = torch.autograd.grad(z.sum(), [w])
        return z.detach(), g

    gm = record(f, [x])
    with torch.no_grad():
        w.mul_(2)                                  # the solver's in-place update
    x2 = torch.randn(5, 4)
    for got, want in zip(gm.forward(x2), f(x2)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("body, reason", [
    (lambda x, w: x * float(x.sum()), "returned float"),          # branched on a value
    (lambda x, w: w.add_(x), "writes into a tensor made before"),
    (lambda x, w: x + torch.from_numpy(np.exp(x.numpy())), r"numpy\(\) read values"),   # a copy
])
def test_recorder_refuses_what_a_replay_cannot_honour(body, reason):
    from brewnet.graph_record import RecordError, record

    w = torch.zeros(4)
    with pytest.raises(RecordError, match=reason):
        record(lambda x: (body(x, w),), [torch.randn(4)])


def test_first_backward_does_not_import_sympy():
    """torch.autograd.backward's seed check imports sympy (~0.9 s of a small net's first step);
    brewnet.backprop calls the engine directly when the seeds match."""
    import subprocess
    import sys
    code = f"""
import sys, numpy as np, brewnet
from brewnet.proto import caffe_pb2 as pb, parse_text
from brewnet.solvers import SOLVERS
p = parse_text('base_lr: 0.1 lr_policy: "fixed" max_iter: 10 display: 0 solver_mode: CPU',
               pb.SolverParameter())
p.net_param.CopyFrom(parse_text({LOGREG!r}, pb.NetParameter()))
s = SOLVERS["SGD"](p, train_feed=lambda i: {{"data": np.ones((10, 4), np.float32),
                                             "label": np.zeros(10, np.float32)}})
s.step(3)
s.net.forward_tensors(); s.net.backward_tensors()
print("sympy" in sys.modules, "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "BREWNET_STEP_GRAPH": "1"})
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_recorder_refuses_memory_of_the_run_it_did_not_see_made():
    from brewnet.graph_record import RecordError, record

    x = torch.randn(4)
    tail = x[2:]                 # made before the run: the graph would hold it as a constant
    with pytest.raises(RecordError, match="shares memory"):
        record(lambda x: (x[:2] + tail,), [x])



def test_recorder_refuses_an_output_no_recorded_op_made():
    """A step's outputs (loss, gradients) must come from recorded ops: one the recording did not
    see made (here a tensor made before the run) would be replayed as this run's value."""
    from brewnet.graph_record import RecordError, record

    made_before = torch.randn(3)
    record(lambda x: (x + 1, made_before), [torch.randn(3)])        # lean inference may
    with pytest.raises(RecordError, match="made by no recorded op"):
        record(lambda x: (x + 1, made_before), [torch.randn(3)], made=True)
