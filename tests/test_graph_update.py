"""The solver's update as a recorded graph of tensor ops (brewnet/solvers/graph_update.py): its
per-iteration numbers (the rate, Adam's correction, the clipping scale) are tensors, so a graph
captured once (a CUDA graph) stays right as they change. Against the eager update, bit for bit:
every solver type, changing rates (inv, step), L1/L2 weight decay, clip_gradients,
lr_mult/decay_mult (a frozen param too), iter_size 2. ``test_the_loop_with_the_recorded_update``
drives both backends: the CPU's recorded update and the CUDA step graph's logic (forward,
backward and update as one captured graph; on the CPU with a static-memory stand-in, on a GPU
for real)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import parse_text
from brewnet.solvers import SOLVERS, cuda_graph, graph_update, step_graph
from helpers import DEVICE, host
from test_step_graph import StaticMemory

NET = """name: "two"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 10 dim: 4 } shape { dim: 10 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 6 weight_filler { type: "xavier" }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        param { lr_mult: 0.5 decay_mult: 2 } param { lr_mult: 0 }
        inner_product_param { num_output: 3 weight_filler { type: "xavier" }
                              bias_filler { type: "constant" value: 0.2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
RULES = {     # each type's own fields
    "SGD": "momentum: 0.9", "Nesterov": "momentum: 0.9", "AdaGrad": "delta: 1e-8",
    "RMSProp": "rms_decay: 0.98 delta: 1e-8", "AdaDelta": "momentum: 0.95 delta: 1e-6",
    "Adam": "momentum: 0.9 momentum2: 0.999 delta: 1e-8",
}
CASES = {
    "inv-L2": 'lr_policy: "inv" gamma: 0.1 power: 0.75 weight_decay: 5e-3',
    "step-L1-clip": 'lr_policy: "step" stepsize: 3 gamma: 0.5 weight_decay: 5e-3 '
                    'regularization_type: "L1" clip_gradients: 0.05',
    "iter_size-2": 'lr_policy: "exp" gamma: 0.9 weight_decay: 1e-3 iter_size: 2',
}


def feed():
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((40, 10, 4)).astype(np.float32)
    ys = rng.integers(0, 3, (40, 10)).astype(np.float32)
    return lambda i: {"data": xs[i % 40], "label": ys[i % 40]}


def make(kind: str, case: str, device=DEVICE):
    param = parse_text(f'type: "{kind}" base_lr: 0.05 max_iter: 1000 display: 0 random_seed: 3 '
                       f'{RULES[kind]} {CASES[case]}', pb.SolverParameter())
    param.net_param.CopyFrom(parse_text(NET, pb.NetParameter()))
    return SOLVERS[kind](param, train_feed=feed(), device=device)


def state(s) -> list[np.ndarray]:
    return ([host(t).copy() for t in s.net.learnable] + [host(h).copy() for h in s.history]
            + [host(t.grad).copy() for t in s.net.learnable])


def train(kind: str, case: str, recorded: bool, steps: int = 7):
    """``steps`` iterations of the solver loop's parts, eager forward-backward, the update eager
    or recorded (the first recorded one is the checked recording, the rest replays)."""
    s, rates = make(kind, case), []
    upd = graph_update.UpdateGraph(s)
    for _ in range(steps):
        for t in s.net.learnable:
            t.grad = None
        s._forward_backward()
        rates.append(s.lr)
        if not recorded:
            s.apply_update(store_step=True)
        elif upd.gm is None:
            assert upd.record(graph_update.grads_of(s))
        else:
            assert upd.usable()
            upd.run(graph_update.grads_of(s), upd.host_scalars())
        s.iter += 1
    return s, rates, upd


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", RULES)
def test_recorded_update_equals_the_eager_update_bitwise(monkeypatch, kind, case):
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    eager, rates, _ = train(kind, case, recorded=False)
    graph, _, upd = train(kind, case, recorded=True)
    assert len(set(rates)) > 2                    # the rate changed while the graph replayed
    for a, b in zip(state(eager), state(graph)):
        np.testing.assert_array_equal(a, b)
    assert eager.current_step == graph.current_step
    assert upd.clipping == (case == "step-L1-clip")


def test_frozen_params_and_clipping_are_in_the_graph(monkeypatch, caplog):
    """SGD leaves a frozen param (lr_mult 0, zero history) and its history alone; the clipping
    norm comes back from the graph for Caffe's log line."""
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    s, _, upd = train("SGD", "step-L1-clip", recorded=True, steps=3)
    assert s.net.lr_mults[3] == 0 and upd.skip == {3} and len(upd.lr_mults) == 3
    np.testing.assert_array_equal(host(s.net.learnable[3]), np.full(3, 0.2, np.float32))
    assert not s.history[3].any()
    for t in s.net.learnable:
        t.grad = None
    s._forward_backward()
    out = upd.run(graph_update.grads_of(s), upd.host_scalars())
    with caplog.at_level(logging.INFO, logger="brewnet"):
        upd.log_clipping(out)
    assert "Gradient clipping: scaling down gradients (L2 norm" in caplog.text


def test_scaled_add_with_a_0d_rate_gives_the_alpha_forms_bits():
    """The one op of the rules that takes the rate another way: vector lanes and the tail."""
    for n in (7, 64, 1000, 4099):
        g = torch.Generator().manual_seed(n)
        h, d = torch.randn(n, generator=g), torch.randn(n, generator=g) * 3
        for rate in (0.0123457, 1 / 3, 1e-7):
            rate = float(np.float32(rate))
            a, b = [h.clone()], [h.clone()]
            graph_update.scaled_add_(a, [d], rate)
            graph_update.scaled_add_(b, [d], torch.tensor(rate))
            assert torch.equal(a[0], b[0])


def test_a_recorded_update_that_differs_keeps_the_eager_one(monkeypatch, caplog):
    """The check at recording: an update one rounding off (the rate applied as g * rate, then
    added: two roundings) is refused with a warning, and that iteration's update is the eager
    one's bits."""
    def twice_rounded(hs, gs, rate):
        if isinstance(rate, torch.Tensor):
            torch._foreach_add_(hs, torch._foreach_mul(gs, rate))
        else:
            torch._foreach_add_(hs, gs, alpha=rate)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    eager, _, _ = train("SGD", "inv-L2", recorded=False, steps=3)
    s, _, _ = train("SGD", "inv-L2", recorded=False, steps=2)    # a history to add to
    monkeypatch.setattr(graph_update, "scaled_add_", twice_rounded)
    import brewnet.solvers.sgd as sgd
    monkeypatch.setattr(sgd, "scaled_add_", twice_rounded)
    for t in s.net.learnable:
        t.grad = None
    s._forward_backward()
    upd = graph_update.UpdateGraph(s)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        assert not upd.record(graph_update.grads_of(s))
    assert "the recorded update differs from the eager one" in caplog.text
    assert upd.gm is None and upd.tries == 3
    for a, b in zip(state(eager), state(s)):
        np.testing.assert_array_equal(a, b)


BACKENDS = ["cpu", "cuda-logic",
            pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs a CUDA device"))]


def use_backend(monkeypatch, backend: str) -> str:
    """The device for ``backend``: the CPU's recorded update (graph_update.ON_CPU), the CUDA
    step graph's logic on the CPU (StaticMemory for the CUDA graphs), or a GPU."""
    if backend == "cpu":
        monkeypatch.setattr(graph_update, "ON_CPU", True)
        return "cpu"
    if backend == "cuda-logic":
        monkeypatch.setattr(cuda_graph, "CapturedGraph", StaticMemory)
        monkeypatch.setattr(step_graph, "StepGraph", cuda_graph.CudaStepGraph)
        return "cpu"
    return "cuda:0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdaDelta"])
def test_the_loop_with_the_recorded_update(monkeypatch, caplog, backend, kind):
    """solver.step with the step graph and the recorded update against the eager loop: params,
    history, diffs, losses and the log lines (lr, clipping) alike."""
    device = use_backend(monkeypatch, backend)
    runs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("BREWNET_STEP_GRAPH", mode)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="brewnet"):
            s = make(kind, "step-L1-clip", device=device)
            s.param.display = 2
            s.losses = []
            s.add_callback(on_start=lambda s=s: s.losses.append(s.loss))
            s.step(9)
        lines = [r.getMessage() for r in caplog.records
                 if "lr = " in r.getMessage() or "clipping" in r.getMessage()]
        runs[mode] = (s, lines)
    (eager, e_lines), (graph, g_lines) = runs["0"], runs["1"]
    g = graph._graph
    assert g.gm is not None and g.update and g.update.gm is not None
    if backend != "cpu":
        assert g.whole is not None and g.whole is not False
    for a, b in zip(state(eager), state(graph)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(eager.losses, graph.losses)
    assert e_lines == g_lines and len(e_lines) > 9


@pytest.mark.parametrize("why", ["callback", "own rule", "per-param"])
def test_refused_updates_stay_eager(monkeypatch, why):
    monkeypatch.setattr(graph_update, "ON_CPU", True)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    s = make("SGD", "inv-L2", device="cpu")
    if why == "callback":
        s.add_callback(on_gradients=lambda: None)
    elif why == "own rule":
        class Mine(SOLVERS["SGD"]):
            def compute_updates(self, idx, params, grads, local_rate):
                super().compute_updates(idx, params, grads, local_rate)
        s.__class__ = Mine
    else:
        s.foreach = False
    s.step(4)
    assert s._graph.gm is not None and s._graph.update is False


def test_restore_records_the_update_again(monkeypatch, tmp_path):
    """A restored solver state (history of a frozen param no longer known to be zero) does not
    fit the recorded update: it is recorded again, and the run stays the eager run's bits."""
    monkeypatch.setattr(graph_update, "ON_CPU", True)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    first = make("SGD", "inv-L2", device="cpu")
    first.param.snapshot_prefix = str(tmp_path / "s")
    first.step(3)
    path = first.snapshot()
    runs = []
    for mode in ("0", "1"):
        monkeypatch.setenv("BREWNET_STEP_GRAPH", mode)
        s = make("SGD", "inv-L2", device="cpu")
        s.step(3)
        s.restore(path)
        s.step(4)
        runs.append(s)
    assert runs[1]._graph.update.tries == 2
    for a, b in zip(state(runs[0]), state(runs[1])):
        np.testing.assert_array_equal(a, b)
