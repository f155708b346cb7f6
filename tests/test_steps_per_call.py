"""Several iterations per call (brewnet/execution/steps_per_call.py): the bits of single steps
(loss, params, history, diffs, blobs, the smoothed loss and the log lines), its refusals, its
fallbacks, and that ``solver.step`` uses it at default settings."""
from __future__ import annotations

import logging
import re
from typing import List

import numpy as np
import pytest
import torch

from brewnet.execution import loop_passes, steps_per_call
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import parse_text
from brewnet.solvers import SOLVERS, LossNotFiniteError
from helpers import MODELS, random_digits_lmdb
from test_step_graph import conv_net, state

SWITCHES = ("BREWNET_STEP_GRAPH", "BREWNET_STEPS_PER_CALL", "BREWNET_THREADS")


@pytest.fixture(autouse=True)
def defaults(monkeypatch):
    for var in SWITCHES:
        monkeypatch.delenv(var, raising=False)


def logreg_h5(folder, rows: int = 300, bad_label_row: int | None = None,
              huge_row: int | None = None) -> str:
    import h5py

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    y = (x[:, 0] + 0.3 * rng.standard_normal(rows) > 0).astype(np.float32)
    if bad_label_row is not None:
        y[bad_label_row] = 5
    if huge_row is not None:
        x[huge_row] = 3e38          # finite (HDF5Data refuses NaN), but the loss overflows
    with h5py.File(folder / "train.h5", "w") as f:
        f["data"], f["label"] = x, y
    (folder / "train.txt").write_text(str(folder / "train.h5") + "\n")
    return f"""name: "LogReg"
layer {{ name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param {{ source: "{folder}/train.txt" batch_size: 10 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
"""


def make(net: str, solver_type: str = "SGD", extra: str = "", lr: str = "0.01"):
    param = parse_text(f"""type: "{solver_type}" base_lr: {lr} momentum: 0.9 weight_decay: 5e-4
        lr_policy: "step" gamma: 0.5 stepsize: 250 max_iter: 900 display: 0 random_seed: 3
        average_loss: 7 snapshot_after_train: false""", pb.SolverParameter())
    param.MergeFrom(parse_text(extra, pb.SolverParameter()))    # its fields override these
    if solver_type == "Adam":
        param.momentum2 = 0.999
    param.net_param.CopyFrom(parse_text(net, pb.NetParameter()))
    return SOLVERS[solver_type](param)


def full_state(s) -> list:
    return state(s) + [t.grad.numpy().copy() for t in s.net.learnable] + [
        np.float32(s.smoothed_loss), np.float32(s.loss), s.iter, s.current_step]


def loops_ran(s) -> bool:
    r = getattr(s, "_steps_runner", None)
    return r is not None and r.checked and r.guard.off is None


def both(monkeypatch, build, calls, run=lambda s, n: s.step(n)):
    """(single steps, default) solvers after the same ``calls``; the default must use the loop."""
    monkeypatch.setenv("BREWNET_STEPS_PER_CALL", "0")
    single = build()
    for n in calls:
        run(single, n)
    monkeypatch.delenv("BREWNET_STEPS_PER_CALL")
    several = build()
    for n in calls:
        run(several, n)
    assert getattr(single, "_steps_runner", None) is None or not single._steps_runner.checked
    return single, several


def assert_same(a, b):
    for x, y in zip(full_state(a), full_state(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("solver_type", ["SGD", "Adam", "Nesterov"])
def test_logreg_several_per_call_equal_single_steps_bitwise(monkeypatch, tmp_path, solver_type):
    net = logreg_h5(tmp_path)      # 30 batches a pass: the loop's reads wrap the file
    single, several = both(monkeypatch, lambda: make(net, solver_type), [600, 37, 451])
    assert loops_ran(several)
    assert_same(single, several)


def test_lenet_like_net_on_lmdb_equals_single_steps_bitwise(monkeypatch, tmp_path):
    src = random_digits_lmdb(tmp_path / "db", 40, 12, seed=1)
    single, several = both(monkeypatch, lambda: make(conv_net(src)), [520, 30])
    assert loops_ran(several) and several._steps_runner.batch     # its one-hot made before
    assert "aten::scatter_" not in loop_kinds(several)
    assert_same(single, several)


def test_caffes_lenet_runs_several_per_call_equal_single_steps_bitwise(monkeypatch, tmp_path):
    """Caffe's own LeNet (the README's main job), at batch 16: its ip1 (400,000 weights) runs
    oneDNN's inner product and conv2's input gradient convolution_backward, two ops whose
    arguments torch.jit.trace cannot record (loop_passes.traceable); the loop refused them with
    a warning in every long run of the main job."""
    src = random_digits_lmdb(tmp_path / "db", 40, 28, seed=2)
    text = (MODELS / "bvlc/examples/mnist/lenet_train_test.prototxt").read_text()
    text = re.sub(r'source: "[^"]*"', f'source: "{src}"', text).replace("batch_size: 64", "batch_size: 16")
    single, several = both(monkeypatch, lambda: make(text), [520, 30])
    assert loops_ran(several)
    kinds = set(loop_kinds(several))
    assert {"mkldnn::_linear_pointwise", "aten::convolution_backward"} <= kinds, sorted(kinds)
    assert_same(single, several)


def test_displays_tests_snapshots_and_log_lines_are_unchanged(monkeypatch, tmp_path, caplog):
    net = logreg_h5(tmp_path)
    extra = (f'display: 45 test_interval: 70 test_iter: 3 snapshot: 110 '
             f'snapshot_prefix: "{tmp_path}/PREFIX" test_initialization: false')

    def build():
        s = make(net, extra=extra.replace("PREFIX", f"s{len(caplog.records)}"))
        s.test_nets = []          # the test runs at its iterations: counted below
        s.tested = []
        s.test_all = lambda: s.tested.append(s.iter)
        return s

    def lines():
        out = [re.sub(r"\(.*iters\), ", "", r.getMessage()) for r in caplog.records
               if re.search(r"loss = |lr = |net output|Snapshotting to", r.getMessage())]
        caplog.clear()
        return [re.sub(r"s\d+_iter", "iter", m) for m in out]

    with caplog.at_level(logging.INFO, logger="brewnet"):
        monkeypatch.setenv("BREWNET_STEPS_PER_CALL", "0")
        single = build()
        single.step(700)
        single_lines = lines()
        monkeypatch.delenv("BREWNET_STEPS_PER_CALL")
        several = build()
        several.step(700)
        several_lines = lines()
    assert loops_ran(several)
    assert single_lines == several_lines and len(single_lines) > 30
    assert single.tested == several.tested == list(range(70, 700, 70))
    assert_same(single, several)


def test_span_ends_before_each_observable_point(tmp_path):
    s = make(logreg_h5(tmp_path), extra="display: 100 test_interval: 60 snapshot: 45 snapshot_prefix: 'x'")
    s.iter = 10
    assert steps_per_call.span(s, 10_000, 8) == 35            # the snapshot after iteration 44
    s.param.snapshot = 0
    assert steps_per_call.span(s, 10_000, 8) == 50            # the test at 60
    s.param.test_interval = 0
    assert steps_per_call.span(s, 10_000, 8) == 90            # the display at 100
    assert steps_per_call.span(s, 30, 8) == 20                # the end of the call
    s.param.display = 0
    assert steps_per_call.span(s, 10_000, steps_per_call.MAX_STAGED // 7) == 7   # memory


@pytest.mark.parametrize("what", ["callback", "layer hook", "dropout layer", "clipping"])
def test_refused_where_something_runs_between_iterations(monkeypatch, tmp_path, what):
    net = logreg_h5(tmp_path)
    calls = []
    if what == "dropout layer":
        net = net.replace('layer { name: "accuracy"', 'layer { name: "drop" type: "Dropout" '
                          'bottom: "ip1" top: "ip1" }\nlayer { name: "accuracy"', 1)
        assert "Dropout" in net

    def build():
        s = make(net, extra="clip_gradients: 100" if what == "clipping" else "")
        if what == "callback":
            s.add_callback(on_start=lambda: calls.append(s.iter))
        if what == "layer hook":
            s.net.add_hook("before_forward", lambda i: calls.append(i))
        return s
    single, several = both(monkeypatch, build, [600])
    assert not loops_ran(several)
    assert_same(single, several)
    if what == "callback":
        assert calls == list(range(600)) * 2


@pytest.mark.parametrize("threads", ["1", "2"])
def test_thread_count_keeps_the_bits(monkeypatch, tmp_path, threads):
    src = random_digits_lmdb(tmp_path / "db", 40, 12, seed=1)
    monkeypatch.setenv("BREWNET_STEPS_PER_CALL", "0")
    monkeypatch.setenv("BREWNET_THREADS", "1")
    single = make(conv_net(src))
    single.step(530)
    monkeypatch.delenv("BREWNET_STEPS_PER_CALL")
    monkeypatch.setenv("BREWNET_THREADS", threads)
    several = make(conv_net(src))
    several.step(530)
    assert loops_ran(several)
    assert_same(single, several)
    torch.set_num_threads(1)


def test_a_bad_label_inside_the_loop_raises_at_its_iteration(monkeypatch, tmp_path):
    net = logreg_h5(tmp_path, rows=10_000, bad_label_row=10 * 700 + 3)
    got = []
    for switch in ("0", "auto"):
        monkeypatch.setenv("BREWNET_STEPS_PER_CALL", switch)
        s = make(net)
        with pytest.raises(Exception, match="label 5 at position 3 is out of range") as e:
            s.step(900)
        got.append((s.iter, str(e.value), state(s) + [t.grad is None for t in s.net.learnable]))
    assert got[0][:2] == got[1][:2] and got[0][0] == 700
    for x, y in zip(got[0][2], got[1][2]):
        np.testing.assert_array_equal(x, y)


def test_a_nonfinite_loss_inside_the_loop_raises_at_its_iteration(monkeypatch, tmp_path):
    net = logreg_h5(tmp_path, rows=10_000, huge_row=10 * 700 + 3)
    got = []
    for switch in ("0", "auto"):
        monkeypatch.setenv("BREWNET_STEPS_PER_CALL", switch)
        s = make(net)
        with pytest.raises(LossNotFiniteError) as e:
            s.step(900)
        got.append((s.iter, str(e.value), loops_ran(s)))
    assert got[0][:2] == got[1][:2] and got[0][0] == 700 and got[1][2]


def test_a_loop_that_differs_keeps_single_steps_with_the_batches_read(monkeypatch, tmp_path, caplog):
    net = logreg_h5(tmp_path)
    monkeypatch.setenv("BREWNET_STEPS_PER_CALL", "0")
    single = make(net)
    single.step(700)
    single.step(700)
    monkeypatch.delenv("BREWNET_STEPS_PER_CALL")
    monkeypatch.setattr(steps_per_call, "same_bits", lambda a, b: False)
    several = make(net)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        several.step(700)       # the loop with the batches' ops batched differs: single steps
        assert several._steps_runner.guard.off is None and not several._steps_runner.batch
        several.step(700)       # the loop without them differs too: off
    assert several._steps_runner.guard.off is not None
    assert "differ from single steps" in caplog.text
    assert_same(single, several)


def test_solve_uses_it_and_the_many_runners_do_not(monkeypatch, tmp_path):
    net = logreg_h5(tmp_path)
    single, several = both(monkeypatch, lambda: make(net), [None], run=lambda s, n: s.solve())
    assert loops_ran(several) and several.iter == 900
    assert_same(single, several)
    s = make(net)
    for _ in s._stepping(600):       # brewnet.many's generator: one iteration per yield
        pass
    assert not loops_ran(s)


@pytest.mark.parametrize("shuffle", [False, True])
def test_hdf5_take_batches_reads_what_forward_would(tmp_path, shuffle):
    from brewnet.net import Net
    net = logreg_h5(tmp_path, rows=95).replace("batch_size: 10", f"batch_size: 10 shuffle: {str(shuffle).lower()}")
    seqs = []
    for take in (False, True):
        torch.manual_seed(0)
        np.random.seed(0)
        layer = Net(parse_text(net, pb.NetParameter()), pb.TRAIN).layer_list[0]
        rows = []
        while len(rows) < 40:
            got = layer.take_batches(7) if take else None
            tops = got[0] if got is not None else [t.unsqueeze(0) for t in layer.forward([])]
            rows += [torch.cat([a, b[:, None]], 1) for a, b in zip(*tops)]
        seqs.append(torch.stack(rows[:40]))
    assert torch.equal(seqs[0], seqs[1])


def test_brewnet_train_uses_it_and_logs_the_same_losses(monkeypatch, tmp_path, caplog):
    from brewnet import cli

    (tmp_path / "net.prototxt").write_text(logreg_h5(tmp_path))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path}/net.prototxt" base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" '
        'max_iter: 1200 display: 300 solver_mode: CPU random_seed: 1 snapshot_after_train: false')
    got = []
    for switch in ("0", "auto"):
        monkeypatch.setenv("BREWNET_STEPS_PER_CALL", switch)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="brewnet"):
            assert cli.main(["train", "--solver", str(tmp_path / "solver.prototxt")]) == 0
        got.append(([re.sub(r"\(.*iters\), ", "", r.getMessage()) for r in caplog.records
                     if "loss = " in r.getMessage()], "TorchScript loop" in caplog.text))
    assert got[0][0] == got[1][0] and len(got[0][0]) == 9     # 5 displays, 4 output lines
    assert got[1][1] and not got[0][1]      # the thread re-planning callback removed itself


@pytest.mark.parametrize("policy", ['lr_policy: "fixed"', 'lr_policy: "inv" gamma: 0.001 power: 0.75',
                                    'lr_policy: "multistep" gamma: 0.5 stepvalue: 300 stepvalue: 301',
                                    'lr_policy: "poly" power: 2'])
def test_lr_policies_equal_single_steps_bitwise(monkeypatch, tmp_path, policy):
    net = logreg_h5(tmp_path)
    single, several = both(monkeypatch, lambda: make(net, extra=policy), [600, 250])
    assert loops_ran(several)
    assert_same(single, several)


def test_a_read_that_fails_inside_the_loop_raises_at_its_iteration(monkeypatch, tmp_path):
    from brewnet.data.hdf5 import HDF5Data
    net = logreg_h5(tmp_path)
    forward, got, calls = HDF5Data.forward, [], []

    def failing(self, bottoms):
        calls.append(1)
        if len(calls) == 1000:
            raise OSError("disk gone")
        return forward(self, bottoms)
    monkeypatch.setattr(HDF5Data, "forward", failing)
    monkeypatch.setattr(HDF5Data, "take_batches", lambda self, most: None)    # a read a batch
    for switch in ("0", "auto"):
        monkeypatch.setenv("BREWNET_STEPS_PER_CALL", switch)
        calls.clear()
        s = make(net)
        s.step(600)
        with pytest.raises(OSError, match="disk gone"):
            s.step(900)
        got.append((s.iter, state(s), loops_ran(s)))
    assert got[0][0] == got[1][0] == 999 and got[1][2] and not got[0][2]
    for x, y in zip(got[0][1], got[1][1]):
        np.testing.assert_array_equal(x, y)


def test_a_bad_steps_per_call_switch_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("BREWNET_STEPS_PER_CALL", "yes")
    s = make(logreg_h5(tmp_path))
    with pytest.raises(ValueError, match=r"BREWNET_STEPS_PER_CALL='yes': expected one of auto, 0"):
        s.step(600)


@pytest.mark.parametrize("window", [1, 3, 7])
def test_smoothed_loss_at_once_equals_one_update_per_iteration(window):
    """steps_per_call.smooth against the solver's own update, iteration by iteration, from an
    empty, a part-filled and a full window, at offsets that wrap the ring."""
    from brewnet.solvers.base import Solver

    rng = np.random.default_rng(window)

    class S:
        _update_smoothed_loss = Solver._update_smoothed_loss

    for filled, offset, k in [(0, 0, 50), (2, 2, 40), (window, 5, 33), (window, 11, 1)]:
        losses = (rng.standard_normal(k) * 10.0 ** rng.integers(-3, 6, k)).astype(np.float32)
        a, b = S(), S()
        for s in (a, b):
            s.param = pb.SolverParameter(average_loss=window)
            s.iter, s.smoothed_loss = 100 + offset, np.float32(0)
            s._losses = []
            for j in range(min(filled, window)):
                s._update_smoothed_loss(np.float32(rng.standard_normal() if s is a else 0), 100)
        b._losses, b.smoothed_loss = list(a._losses), a.smoothed_loss
        for j, v in enumerate(losses):
            a.iter = 100 + offset + j
            a._update_smoothed_loss(v, 100)
        a.iter = b.iter
        steps_per_call.smooth(b, losses, 100)
        assert b.iter == 100 + offset
        assert np.float32(a.smoothed_loss).tobytes() == np.float32(b.smoothed_loss).tobytes()
        np.testing.assert_array_equal(np.array(a._losses, np.float32), np.array(b._losses, np.float32))


def test_the_loop_runs_no_invariant_node_per_iteration_and_leaves_normal_tensors(tmp_path):
    """The scripted loop's body is inlined and its invariant nodes hoisted (hoist); what the
    loop leaves (diffs, tops) are normal tensors: the next eager update writes them in place."""
    s = make(logreg_h5(tmp_path))
    s.step(300)             # the step graph is recorded during this call: the loop runs next
    s.step(300)
    assert loops_ran(s)
    graph = s._steps_runner.loop.forward.graph
    loop = next(n for n in graph.nodes() if n.kind() == "prim::Loop")
    kinds = [n.kind() for n in list(loop.blocks())[0].nodes()]
    assert "prim::CallMethod" not in kinds and "prim::Constant" not in kinds
    assert "aten::addmm" in kinds and "aten::t" in kinds      # t of the product's gradient
    assert kinds.count("aten::t") == 1        # the weight's transpose moved before the loop
    # one select a data top, the one-hot, the rate (of the rates' K rows, taken before the
    # loop); the label's view, cast to long, view and one-hot run once on the K batches before
    # the loop; the label top selected after it (_last_only); the loss appended as itself
    assert "prim::Loop" not in kinds and kinds.count("aten::select") == 3
    assert "aten::__getitem__" not in kinds
    assert [n.kind() for n in graph.nodes()].count("aten::_set_item") == 1
    assert "aten::to" not in kinds and kinds.count("aten::view") == 1     # the bias diff's view
    assert "prim::ListConstruct" in kinds and all(      # the outputs' list; int lists moved out
        str(n.output().type()) == "List[Tensor]" for n in list(loop.blocks())[0].nodes()
        if n.kind() == "prim::ListConstruct")
    assert not any(t.grad.is_inference() for t in s.net.learnable)
    assert not any(b.tensor.is_inference() for b in s.net.blobs.values())
    s._store_steps()
    s.step(5)                                 # single steps (fewer than MIN_K) after the loop


class _Mixed(torch.nn.Module):
    """A loop with a list written inside it, loop-variant views and an invariant view."""

    def forward(self, w: torch.Tensor, n: int) -> List[torch.Tensor]:
        seen: List[torch.Tensor] = [w]
        outs: List[torch.Tensor] = []
        for _ in range(n):
            (a,) = seen                        # unpacks a list written in the loop: stays
            outs.append(a.t() * 1.5)           # a view of a loop-variant value: stays
            seen[0] = a + w.t().sum()          # w.t(): invariant view, moves; sum: stays
            w.add_(1.0)
        return outs


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch.jit's own notice
def test_hoist_moves_only_what_is_the_same_at_every_iteration():
    m = torch.jit.script(_Mixed())
    assert loop_passes.hoist(m.forward.graph) >= 1
    loop = next(n for n in m.forward.graph.nodes() if n.kind() == "prim::Loop")
    kinds = [n.kind() for n in list(loop.blocks())[0].nodes()]
    assert kinds.count("aten::t") == 1 and "prim::ListUnpack" in kinds and "aten::sum" in kinds
    w = torch.arange(6.0).reshape(2, 3)
    want = _Mixed().forward(w.clone(), 4)
    with torch.jit.optimized_execution(False):
        got = m(w.clone(), 4)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


class _Data(torch.nn.Module):
    """_Loop's way of taking a batch, then a view and cast (moves), a cast of a batch written
    in place (stays), a view with -1 in its size (stays)."""

    def forward(self, xs: List[torch.Tensor], n: int) -> List[torch.Tensor]:
        outs: List[torch.Tensor] = []
        for k in range(n):
            a, b, c = [x[k] for x in xs]
            outs.append(a.view(2, 3).to(torch.int64) * 2)
            b.mul_(2.0)
            outs.append(b.to(torch.int64))
            outs.append(c.view(-1, 2))
        return outs


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch.jit's own notice
def test_casts_and_views_of_a_batch_run_once_on_all_batches():
    m = torch.jit.script(_Data())
    loop_passes.hoist(m.forward.graph)
    loop = next(n for n in m.forward.graph.nodes() if n.kind() == "prim::Loop")
    kinds = [n.kind() for n in list(loop.blocks())[0].nodes()]
    assert kinds.count("aten::to") == 1 and kinds.count("aten::view") == 1
    assert "aten::reshape" not in kinds and "prim::Loop" not in kinds
    xs = [torch.arange(30.0).reshape(5, 6) * 0.7, torch.arange(20.0).reshape(5, 4) / 3,
          torch.arange(20.0).reshape(5, 4)]
    want = _Data().forward([x.clone() for x in xs], 5)
    with torch.jit.optimized_execution(False):
        got = m([x.clone() for x in xs], 5)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("solver_type,extra,lr", [("AdaGrad", "momentum: 0", "0.01"),
                                                  ("RMSProp", "momentum: 0 rms_decay: 0.98", "0.01"),
                                                  ("AdaDelta", "momentum: 0.95", "1.0")])
def test_other_rules_equal_single_steps_bitwise(monkeypatch, tmp_path, solver_type, extra, lr):
    net = logreg_h5(tmp_path)
    single, several = both(monkeypatch, lambda: make(net, solver_type, extra, lr), [600, 37, 451])
    assert loops_ran(several)
    assert_same(single, several)


def loop_kinds(s) -> list:
    graph = s._steps_runner.loop.forward.graph
    loop = next(n for n in graph.nodes() if n.kind() == "prim::Loop")
    return [n.kind() for n in list(loop.blocks())[0].nodes()]


@pytest.mark.parametrize("solver_type,extra,ignore", [("SGD", "", None), ("SGD", "", 1),
                                                      ("AdaGrad", "momentum: 0", None),
                                                      ("Adam", "", 1)])
def test_one_hot_labels_made_for_all_batches_equal_single_steps_bitwise(
        monkeypatch, tmp_path, solver_type, extra, ignore):
    """SoftmaxWithLoss's one-hot labels (zeros_like + scatter_; with ignore_label also its
    mask's ne/where and valid count) are made for the K batches before the loop (loop_passes._batch_data_ops),
    the loss's traced float64 divisor is a float32 constant (loop_passes._float_scalars):
    the loop keeps that form (a difference would rebuild it without) and the bits of single
    steps."""
    net = logreg_h5(tmp_path)
    if ignore is not None:
        net = net.replace('top: "loss" }', f'top: "loss" loss_param {{ ignore_label: {ignore} }} }}')
    single, several = both(monkeypatch, lambda: make(net, solver_type, extra), [600, 37, 451])
    assert loops_ran(several) and several._steps_runner.batch
    kinds = loop_kinds(several)
    assert "aten::scatter_" not in kinds and "aten::zeros_like" not in kinds
    assert "aten::addmm" in kinds and "aten::_log_softmax" in kinds
    if ignore is not None:
        assert "aten::where" not in kinds and "aten::ne" not in kinds
        # the valid count (sum of the mask, clamp_min) and the gradient's scale by it too
        assert kinds.count("aten::sum") == 2 and kinds.count("aten::clamp_min") == 1
        assert kinds.count("aten::div") == 1
    else:        # the loss's / batch by a float32 constant (loop_passes._float_scalars)
        divs = [n for n in several._steps_runner.loop.forward.graph.findAllNodes("aten::div")]
        assert [n.inputsAt(1).node().t("value").dtype for n in divs] == [torch.float32]
    assert_same(single, several)


def test_a_batched_loop_that_differs_is_rebuilt_without_and_stays_on(monkeypatch, tmp_path, caplog):
    net = logreg_h5(tmp_path)
    wrong = loop_passes._scatter

    def scatter_twos(graph, loop, n, *rest):        # one-hot of 2.0: other losses and gradients
        b = wrong(graph, loop, n, *rest)
        if b is not None:
            two = loop_passes._constant(graph, loop, 2.0)
            two.node().moveBefore(b)
            b.replaceInput(3, two)
        return b

    monkeypatch.setattr(loop_passes, "_scatter", scatter_twos)
    with caplog.at_level(logging.INFO, logger="brewnet"):
        single, several = both(monkeypatch, lambda: make(net), [600, 37, 451])
    assert "batched differs from single steps: tried without them" in caplog.text
    assert loops_ran(several) and not several._steps_runner.batch
    assert "aten::scatter_" in loop_kinds(several)
    assert_same(single, several)


class _OneHot(torch.nn.Module):
    """A loss's one-hot labels; ``read`` reads the zeros before the scatter_ (it stays), ``write``
    writes the index in place before a view of it is read (what reads the view stays)."""

    def __init__(self, read=False, write=False):
        super().__init__()
        self.read, self.write = read, write

    def forward(self, xs: List[torch.Tensor]) -> torch.Tensor:
        x, lab = xs
        zeros = torch.zeros_like(x * 1.0)
        before = zeros.sum() if self.read else 0.0
        idx = lab.view(4, 1).to(torch.int64)
        view = idx.view(4, 1)              # read after the write below, which it sees
        if self.write:
            idx.add_(1)
        hot = zeros.scatter_(1, view, 1.0)
        return (hot * x).sum(1) + (view != 1) * 0.5 + before


class _OneHotLoop(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, xs: List[torch.Tensor], n: int) -> List[torch.Tensor]:
        outs: List[torch.Tensor] = []
        for k in range(n):
            outs.append(self.body([x[k] for x in xs]))
        return outs


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # torch.jit's own notice
@pytest.mark.parametrize("read,write", [(False, False), (True, False), (False, True)])
def test_one_hot_runs_once_on_all_batches_unless_read_or_written_in_the_loop(read, write):
    xs = [torch.arange(60.0).reshape(5, 4, 3) / 7, torch.tensor([0.0, 1, 1, 0] * 5).reshape(5, 4)]
    body = _OneHot(read, write)
    with torch.no_grad():
        m = torch.jit.script(_OneHotLoop(torch.jit.trace(body, ([x[0] for x in xs],))))
    loop_passes.hoist(m.forward.graph)
    loop = next(n for n in m.forward.graph.nodes() if n.kind() == "prim::Loop")
    kinds = [n.kind() for n in list(loop.blocks())[0].nodes()]
    assert "aten::zeros_like" not in kinds and "aten::to" not in kinds    # fresh memory each
    assert ("aten::scatter_" in kinds) == (read or write) and ("aten::ne" in kinds) == write
    assert ("aten::view" in kinds) == write
    want = [body([x[k].clone() for x in xs]) for k in range(5)]
    with torch.jit.optimized_execution(False):
        got = m([x.clone() for x in xs], 5)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
