"""Solvers against the real Caffe (golden/solvers: each update rule and lr policy, 10 steps),
plus the solver loop's Caffe behaviours, bad input, and a real LeNet run on MNIST."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

import brewnet
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text, read_net, read_solver
from brewnet.solvers import LR_POLICIES, SOLVERS, LossNotFiniteError, SGDSolver, SolverError, get_solver
from helpers import GOLDEN_SOLVERS, MODELS, host, need, swap_data_layers, tol

SOLVER_DIR = GOLDEN_SOLVERS
CASES = sorted(p.stem for p in SOLVER_DIR.glob("*.npz") if p.stem != "batches")


def golden_solver(case: str, extra: str = "", net: str | None = None, **kw):
    """The case's solver with the golden net (or ``net``) inline, fed batch t at iteration t,
    at the golden initial weights. A net whose first layer is MemoryData (the generator's
    ``feed: memory`` runs, e.g. iter_size > 1) gets all batches through set_input_arrays, as
    the generator did; Input nets get batch t before the t-th forward."""
    z = np.load(SOLVER_DIR / f"{case}.npz")
    b = np.load(SOLVER_DIR / "batches.npz")
    param = parse_text(str(z["solver_prototxt"]), pb.SolverParameter())
    param.MergeFrom(parse_text(extra, pb.SolverParameter()))     # extra fields override
    param.net_param.CopyFrom(parse_text(net or str(z["net_prototxt"]), pb.NetParameter()))
    n = len(b["data"])
    memory = any(l.type == "MemoryData" for l in param.net_param.layer)
    default = None if memory else (lambda i: {"data": b["data"][i % n], "label": b["label"][i % n]})
    feed = kw.pop("train_feed", default)
    solver = SOLVERS[param.type](param, train_feed=feed, **kw)
    if memory:
        data = np.ascontiguousarray(b["data"].reshape((-1,) + b["data"].shape[2:]))
        label = np.ascontiguousarray(b["label"].reshape(-1))
        next(l for l in solver.net.layer_list if l.type == "MemoryData").set_input_arrays(data, label)
    with torch.no_grad():
        for layer in solver.net.layer_list:
            for i, t in enumerate(layer.blobs):
                t.copy_(torch.from_numpy(z[f"init/{layer.name}/{i}"]))
    return solver, z


def run_golden_steps(solver, steps: int):
    """(lrs, losses) of ``steps`` single steps, the rate read before each as the generator did."""
    lrs, losses = [], []
    for _ in range(steps):
        lrs.append(solver.lr)
        solver.step(1)
        losses.append(solver.loss)
    return lrs, losses


def check_golden_state(solver, z, params: str, history: str, label: str):
    """The solver's params and history against the case's ``<params>/<layer>/<i>`` and
    ``<history>/<j>`` arrays (rtol 1e-4, atol 1e-5; a device's: helpers.tol)."""
    meta = json.loads(str(z["meta"]))
    for layer in solver.net.layer_list:
        for i, t in enumerate(layer.blobs):
            np.testing.assert_allclose(host(t), z[f"{params}/{layer.name}/{i}"],
                                       **tol("trajectory", 1e-4, 1e-5), err_msg=f"{label} {layer.name}/{i}")
    hist = [k for k in z.files if k.startswith(history + "/")]
    assert len(hist) == len(solver.history)
    for j, h in enumerate(solver.history):
        np.testing.assert_allclose(host(h), z[f"{history}/{j}"], **tol("trajectory", 1e-4, 1e-5),
                                   err_msg=f"{label} {history} {j} ({meta['history_map'][j]})")


def rel_err(a, b, atol=1e-5):
    return float(np.max(np.abs(a - b) / (np.abs(b) + atol / 1e-4)))


def test_every_indexed_run_is_there():
    # CASES comes from the files: a run missing from the set must fail, not be skipped.
    runs = json.loads((SOLVER_DIR / "index.json").read_text())["runs"]
    assert sorted(f"{c}.npz" for c in CASES) == sorted(r["file"] for r in runs) != []


@pytest.mark.parametrize("case", CASES)
def test_golden(case, tmp_path):
    solver, z = golden_solver(case)
    meta = json.loads(str(z["meta"]))
    lrs, losses = run_golden_steps(solver, meta["steps"])
    # lrs: float32 values, exactly; losses (the mean over iter_size passes): rtol 1e-5.
    np.testing.assert_array_equal(np.float32(lrs), np.float32(z["lrs"]))
    np.testing.assert_allclose(losses, z["losses"], **tol("trajectory", 1e-5, 0))
    check_golden_state(solver, z, "final", "history", case)
    assert solver.iter == meta["solverstate_iter"]
    assert solver.current_step == meta["solverstate_current_step"]
    if "resumed_losses" in z.files:
        # The generator's restore_at runs: k steps, snapshot, a fresh solver restores, runs on.
        check_resumed(case, z, meta["steps"] - len(z["resumed_losses"]), tmp_path, "resumed_")


def check_resumed(case, z, k: int, tmp_path, prefix: str) -> None:
    """Run ``case`` k steps, snapshot, restore into a fresh solver and run to the end; compare
    with the case's ``<prefix>lrs/losses/final/history``."""
    meta = json.loads(str(z["meta"]))
    part, _ = golden_solver(case, f'snapshot_prefix: "{tmp_path / "part"}"')
    run_golden_steps(part, k)
    path = part.snapshot()
    resumed, _ = golden_solver(case)
    resumed.restore(path)
    assert resumed.iter == k
    lrs, losses = run_golden_steps(resumed, meta["steps"] - k)
    lrs_key, losses_key = (f"{prefix}lrs", f"{prefix}losses") if prefix else ("lrs", "losses")
    np.testing.assert_array_equal(np.float32(lrs), np.float32(z[lrs_key][-len(lrs):]))
    np.testing.assert_allclose(losses, z[losses_key][-len(losses):], **tol("trajectory", 1e-5, 0))
    check_golden_state(resumed, z, f"{prefix}final", f"{prefix}history", case + " resumed")
    assert resumed.current_step == meta["solverstate_current_step"]


def test_golden_harness_restore_path(tmp_path):
    # The restore_at path of test_golden, checked on a visible case: resuming at 4 ends at
    # Caffe's uninterrupted numbers (multistep: current_step must come back too).
    z = np.load(SOLVER_DIR / "policy_multistep.npz")
    check_resumed("policy_multistep", z, 4, tmp_path, "")


def test_golden_harness_memory_feed():
    # The generator's feed "memory" runs: a MemoryData layer over all batches (batch t at
    # iteration t) gives the Input-fed case's numbers.
    z = np.load(SOLVER_DIR / "type_nesterov.npz")
    meta = json.loads(str(z["meta"]))
    shape = meta["net_shape"]
    mem = ('layer { name: "data" type: "MemoryData" top: "data" top: "label"\n'
           '  memory_data_param { batch_size: %d channels: %d height: %d width: %d } }'
           % ((shape["batch"],) + tuple(shape["shape"])))
    text = str(z["net_prototxt"])
    start = text.index('layer { name: "data"')
    end = text.index("layer {", start + 1)
    solver, _ = golden_solver("type_nesterov", net=text[:start] + mem + "\n" + text[end:])
    assert solver.train_feed is None
    _, losses = run_golden_steps(solver, meta["steps"])
    np.testing.assert_allclose(losses, z["losses"], **tol("trajectory", 1e-5, 0))
    check_golden_state(solver, z, "final", "history", "memory feed")


# -- lr policies ----------------------------------------------------------------------------
def _policy_param(text: str) -> "pb.SolverParameter":
    return parse_text(text, pb.SolverParameter())


@pytest.mark.parametrize("text, iters, expect", [
    ('lr_policy: "fixed" base_lr: 0.1', [0, 1000], [0.1, 0.1]),
    ('lr_policy: "step" base_lr: 1 gamma: 0.1 stepsize: 10', [0, 9, 10, 25], [1, 1, 0.1, 0.01]),
    ('lr_policy: "exp" base_lr: 2 gamma: 0.5', [0, 1, 3], [2, 1, 0.25]),
    ('lr_policy: "inv" base_lr: 0.01 gamma: 0.0001 power: 0.75', [0, 10000],
     [0.01, 0.01 * 2 ** -0.75]),
    ('lr_policy: "poly" base_lr: 1 power: 2 max_iter: 100', [0, 50, 100], [1, 0.25, 0]),
    ('lr_policy: "sigmoid" base_lr: 1 gamma: 1 stepsize: 10', [10, 10 + 100], [0.5, 1.0]),
    ('lr_policy: "sigmoid" base_lr: 1 gamma: 100 stepsize: 10', [0], [0.0]),   # expf overflow
    # expf(88.71) is still finite (< FLT_MAX): the rate is a subnormal float, not 0
    ('lr_policy: "sigmoid" base_lr: 1 gamma: 0.8871 stepsize: 100', [0], [2.976712e-39]),
    # past max_iter powf gives NaN (negative base, fractional power), as Caffe's rate
    ('lr_policy: "poly" base_lr: 1 power: 1.5 max_iter: 10', [10, 12], [0, float("nan")]),
])
def test_lr_policy_formulas(text, iters, expect):
    p = _policy_param(text)
    fn = LR_POLICIES[p.lr_policy]
    got = [float(fn(p, it, 0)[0]) for it in iters]
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-45)


def test_multistep_advances_one_step_per_call():
    # Caffe moves current_step by at most one per call, so a restored iter past two stepvalues
    # needs two calls to catch up (a Caffe quirk kept on purpose).
    p = _policy_param('lr_policy: "multistep" base_lr: 1 gamma: 0.5 stepvalue: 2 stepvalue: 4')
    fn = LR_POLICIES["multistep"]
    rate, step = fn(p, 5, 0)
    assert (rate, step) == (0.5, 1)
    rate, step = fn(p, 5, step)
    assert (rate, step) == (0.25, 2)


def test_lr_read_is_caffes_get_learning_rate(caplog):
    # pycaffe's solver.lr calls GetLearningRate, which advances a multistep's current_step;
    # with two stepvalues due at iteration 2, read-then-step takes both steps there.
    s, _ = golden_solver("policy_multistep", "stepvalue: 2 stepvalue: 2 display: 1")
    del s.param.stepvalue[:3]           # the case's own 2, 5, 7 go; the two 2s stay
    assert list(s.param.stepvalue) == [2, 2]
    with caplog.at_level(logging.INFO, logger="brewnet"):
        lrs, _ = run_golden_steps(s, 4)
    assert np.float32(lrs).tolist() == np.float32([0.05, 0.05, 0.025, 0.0125]).tolist()
    assert "Iteration 2, lr = 0.0125" in _logged(caplog)     # the update at 2 used both steps
    assert s.current_step == 2


def test_unknown_policy_and_type_list_known_ones(tmp_path):
    with pytest.raises(ValueError, match="Unknown lr_policy 'cosine'.*multistep.*sigmoid"):
        golden_solver("type_sgd", 'lr_policy: "cosine"')
    z = np.load(SOLVER_DIR / "type_sgd.npz")
    (tmp_path / "net.prototxt").write_text(str(z["net_prototxt"]))
    (tmp_path / "s.prototxt").write_text('net: "net.prototxt" type: "Lion" base_lr: 0.1')
    with pytest.raises(SolverError, match="Unknown solver type 'Lion'. Known: AdaDelta, AdaGrad, "
                                          "Adam, Nesterov, RMSProp, SGD"):
        get_solver(tmp_path / "s.prototxt")


def test_missing_net_file_names_the_path(tmp_path):
    (tmp_path / "s.prototxt").write_text('net: "nowhere/train_val.prototxt" base_lr: 0.1 lr_policy: "fixed"')
    with pytest.raises(FileNotFoundError, match="nowhere/train_val.prototxt"):
        SGDSolver(tmp_path / "s.prototxt")
    with pytest.raises(FileNotFoundError, match="solver file not found"):
        SGDSolver(tmp_path / "missing_solver.prototxt")


def test_bad_solver_params():
    with pytest.raises(SolverError, match="Momentum cannot be used with AdaGrad"):
        golden_solver("type_adagrad", "momentum: 0.9")
    with pytest.raises(SolverError, match="rms_decay"):
        golden_solver("type_rmsprop", "rms_decay: 1.0")
    with pytest.raises(SolverError, match="exactly one train net"):
        SGDSolver(parse_text('base_lr: 0.1 lr_policy: "fixed"', pb.SolverParameter()))
    with pytest.raises(SolverError, match="regularization type 'L3'"):
        golden_solver("type_sgd", 'regularization_type: "L3"')
    with pytest.raises(SolverError, match="snapshot_prefix is not"):
        golden_solver("type_sgd", "snapshot: 5")


# -- update details against numpy references ------------------------------------------------
def _numpy_step(solver, case_grads, rule):
    """Params after one update from given gradients, by a numpy re-implementation."""
    return [rule(host(t).astype(np.float64), g) for t, g in zip(solver.net.learnable, case_grads)]


def _grads_after_forward_backward(solver):
    solver.net.clear_param_diffs()
    solver._feed(solver.net, solver.train_feed, 0)
    solver.net.forward_tensors()
    solver.net.backward_tensors(blob_diffs=False)
    return [host(t.grad).astype(np.float64).copy() for t in solver.net.learnable]


def test_l1_decay_decay_mult_and_clip():
    s, _ = golden_solver("type_sgd", 'regularization_type: "L1" clip_gradients: 0.5 momentum: 0')
    s.net.decay_mults[1] = 0.0       # as a decay_mult: 0 on conv1's bias
    w0 = [host(t).astype(np.float64).copy() for t in s.net.learnable]
    g = _grads_after_forward_backward(s)
    norm = math.sqrt(sum((x ** 2).sum() for x in g))
    assert norm > 0.5
    g = [x * 0.5 / norm for x in g]
    s.step(1)
    for i, (w, gi, t) in enumerate(zip(w0, g, s.net.learnable)):
        decay = 0.0005 * s.net.decay_mults[i]
        expect = w - 0.05 * s.net.lr_mults[i] * (gi + decay * np.sign(w))
        np.testing.assert_allclose(host(t), expect, rtol=1e-5, atol=1e-7)


def test_iter_size_equals_full_batch():
    # Caffe's TestLeastSquaresUpdateWithEverythingAccum: iter_size 2 over half batches is the
    # full-batch step (the losses are means, so the accumulated diff is divided by iter_size).
    b = np.load(SOLVER_DIR / "batches.npz")
    full, _ = golden_solver("type_sgd", "", train_feed=lambda i: {"data": b["data"][i], "label": b["label"][i]})
    half = lambda i: {"data": b["data"][i // 2][(i % 2) * 4:(i % 2) * 4 + 4],
                      "label": b["label"][i // 2][(i % 2) * 4:(i % 2) * 4 + 4]}
    acc, _ = golden_solver("type_sgd", "iter_size: 2", train_feed=half)
    full.step(3)
    acc.step(3)
    for a, f in zip(acc.net.learnable, full.net.learnable):
        np.testing.assert_allclose(host(a), host(f), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc.loss, full.loss, rtol=1e-5)


def test_lr_mult_zero_freezes_param():
    s, _ = golden_solver("type_adam")
    s.net.lr_mults[0] = 0.0
    before = s.net.learnable[0].detach().clone()
    s.step(3)
    assert torch.equal(s.net.learnable[0].detach(), before)
    # Adam's history still moves (weight decay enters the diff), as in Caffe.
    assert s.history[0].abs().sum() > 0


@pytest.mark.parametrize("kind", ["sgd", "nesterov"])
def test_lr_mult_zero_with_history_keeps_decaying(kind):
    # Caffe runs ComputeUpdateValue for lr_mult 0 too: a history left from earlier training
    # (or a restored state) decays by momentum and still moves the param.
    s, _ = golden_solver(f"type_{kind}")
    s.step(2)
    h0 = s.history[0].clone().double()
    w0 = s.net.learnable[0].detach().clone().double()
    assert h0.abs().sum() > 0
    s.net.lr_mults[0] = 0.0
    s.step(1)
    h1 = 0.9 * h0
    step = h1 if kind == "sgd" else 1.9 * h1 - 0.9 * h0
    torch.testing.assert_close(s.history[0].double(), h1, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(s.net.learnable[0].detach().double(), w0 - step, rtol=1e-6, atol=1e-8)


def test_apply_update_pycaffe():
    # pycaffe test_solver.py::test_apply_update: weights 0, diff 1, base_lr 0.01 'inv' -> -0.01.
    s, _ = golden_solver("type_sgd", 'lr_policy: "inv" gamma: 0.0001 power: 0.75 base_lr: 0.01 '
                                     'weight_decay: 0 momentum: 0')
    for t, m in zip(s.net.learnable, s.net.lr_mults):
        with torch.no_grad():
            t.zero_()
        t.grad = torch.ones_like(t)
    s.apply_update()
    for t, m in zip(s.net.learnable, s.net.lr_mults):
        np.testing.assert_allclose(host(t), -0.01 * m, atol=1e-7)
        np.testing.assert_allclose(host(t.grad), 0.01 * m, atol=1e-9)   # diff holds the step
    assert s.iter == 0


# -- the loop -------------------------------------------------------------------------------
def _logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "brewnet"]


def test_display_average_loss_and_log_lines(caplog):
    s, z = golden_solver("policy_step", "display: 2 average_loss: 3")
    with caplog.at_level(logging.INFO, logger="brewnet"):
        s.step(6)
    lines = _logged(caplog)
    losses = z["losses"]
    # smoothed over the last 3 losses (running mean until the window fills)
    it4 = [l for l in lines if l.startswith("Iteration 4 (")]
    assert it4 and it4[0].endswith("loss = %g" % np.float32(np.mean(losses[2:5])))
    assert "Iteration 2, lr = 0.05" in lines and "Iteration 4, lr = 0.025" in lines
    out = [l for l in lines if "Train net output" in l]
    assert out[0] == "    Train net output #0: loss = %g (* 1 = %g loss)" % (losses[0], losses[0])
    assert len(out) == 3


def test_test_nets_share_weights_and_average(caplog):
    z = np.load(SOLVER_DIR / "type_sgd.npz")
    b = np.load(SOLVER_DIR / "batches.npz")
    net = str(z["net_prototxt"]).replace(
        'layer { name: "loss"',
        'layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" '
        'include { phase: TEST } }\nlayer { name: "loss"')
    extra = "test_iter: 3 test_iter: 2 test_interval: 4 test_initialization: false display: 0"
    feed = lambda i: {"data": b["data"][i % 10], "label": b["label"][i % 10]}
    s, _ = golden_solver("type_sgd", extra + " test_compute_loss: true", net=net, test_feeds=[feed, feed])
    assert len(s.test_nets) == 2
    for tn in s.test_nets:
        assert tn.layer_by_name["conv1"].blobs[0] is s.net.layer_by_name["conv1"].blobs[0]
    with caplog.at_level(logging.INFO, logger="brewnet"):
        s.step(4)                                    # no test at 0 (test_initialization false)
        assert not any("Testing net" in l for l in _logged(caplog))
        s.step(1)                                    # tests at iter 4 before the update
    lines = _logged(caplog)
    assert "Iteration 4, Testing net (#0)" in lines and "Iteration 4, Testing net (#1)" in lines
    # Reference: the test net's outputs averaged over its batches, at the weights after 4 updates.
    ref = brewnet.Net(parse_text(net, pb.NetParameter()), brewnet.TEST)
    s2, _ = golden_solver("type_sgd")
    s2.step(4)
    for layer in ref.layer_list:
        if layer.name not in s2.net.layer_by_name:
            continue
        for t, src in zip(layer.blobs, s2.net.layer_by_name[layer.name].blobs):
            with torch.no_grad():
                t.copy_(src)
    accs, losses = [], []
    for i in range(3):
        out = ref.forward(data=b["data"][i], label=b["label"][i])
        # float(): forward's arrays are views of the blobs (the next forward overwrites them).
        accs.append(float(out["accuracy"])), losses.append(float(out["loss"]))
    assert s.test_scores[0]["accuracy"] == pytest.approx(np.mean(accs), abs=1e-6)
    assert s.test_scores[0]["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert any(l.startswith("    Test net output #0: accuracy = ") for l in lines)
    assert any(l.startswith("    Test net output #1: loss = ") and "(* 1 = " in l for l in lines)
    assert any(l.startswith("Test loss: ") for l in lines)
    # test forwards continue through the data rather than restarting at batch 0
    assert s._test_counts == [3, 2]


def test_solve_runs_to_max_iter_and_snapshots(tmp_path, caplog):
    prefix = tmp_path / "snaps" / "model"
    prefix.parent.mkdir()
    s, _ = golden_solver("type_sgd", f'snapshot: 4 snapshot_prefix: "{prefix}" display: 5')
    with caplog.at_level(logging.INFO, logger="brewnet"):
        s.solve()
    assert s.iter == 10
    names = sorted(p.name for p in prefix.parent.iterdir())
    assert names == [f"model_iter_{i}.{e}" for i in (10, 4, 8) for e in ("caffemodel", "solverstate")]
    lines = _logged(caplog)
    assert f"Snapshotting to binary proto file {prefix}_iter_4.caffemodel" in lines
    assert f"Snapshotting solver state to binary proto file {prefix}_iter_4.solverstate" in lines
    assert lines[-1] == "Optimization Done."
    assert any(l.startswith("Iteration 10, loss = ") for l in lines)   # the extra display pass


def test_snapshot_prefix_defaults_to_solver_file(tmp_path):
    z = np.load(SOLVER_DIR / "type_sgd.npz")
    (tmp_path / "net.prototxt").write_text(str(z["net_prototxt"]))
    (tmp_path / "my_solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed"')
    s = SGDSolver(tmp_path / "my_solver.prototxt")
    assert s.param.snapshot_prefix == str(tmp_path / "my_solver")
    (tmp_path / "d").mkdir()
    (tmp_path / "s2.prototxt").write_text(f'net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" '
                                          f'snapshot_prefix: "{tmp_path / "d"}"')
    assert SGDSolver(tmp_path / "s2.prototxt").param.snapshot_prefix == str(tmp_path / "d" / "s2")


def test_nan_loss_names_iteration_and_layer():
    s, _ = golden_solver("type_sgd", "base_lr: 1e30")
    with pytest.raises(LossNotFiniteError, match=r"Iteration 1: loss is (nan|inf); first non-finite "
                                                 r"top: '\w+' of layer '\w+' \(type \w+\)"):
        s.step(5)
    s, _ = golden_solver("type_sgd")
    with torch.no_grad():
        s.net.layer_by_name["conv2"].blobs[0].mul_(1e38)
    with pytest.raises(LossNotFiniteError, match=r"Iteration 0: .*top: 'conv2' of layer 'conv2'"):
        s.step(1)
    s, _ = golden_solver("type_sgd")
    with torch.no_grad():
        s.net.layer_by_name["ip1"].blobs[1][3] = float("inf")
    with pytest.raises(LossNotFiniteError, match=r"Iteration 0: .*parameter 1 of layer 'ip1'"):
        s.step(1)


def test_signal_requests_stop_and_snapshot(tmp_path):
    prefix = tmp_path / "m"
    s, _ = golden_solver("type_sgd", f'snapshot_prefix: "{prefix}"')
    s.add_callback(on_start=lambda: s.iter == 3 and s.request_action("snapshot"))
    s.add_callback(on_gradients=lambda: s.iter == 6 and s.request_action("stop"))
    s.solve()
    assert s.iter == 7
    assert (tmp_path / "m_iter_4.solverstate").exists()    # requested during iteration 3
    assert (tmp_path / "m_iter_7.caffemodel").exists()     # snapshot_after_train on early stop


def test_sigint_handler_effects(tmp_path):
    import os
    import signal
    prefix = tmp_path / "m"
    s, _ = golden_solver("type_sgd", f'snapshot_prefix: "{prefix}" snapshot_after_train: false')
    s.add_callback(on_start=lambda: s.iter == 2 and os.kill(os.getpid(), signal.SIGINT))
    before = signal.getsignal(signal.SIGINT)
    s.solve(sigint_effect="stop")
    assert s.iter == 3 and signal.getsignal(signal.SIGINT) is before
    s2, _ = golden_solver("type_sgd", f'snapshot_prefix: "{prefix}" snapshot_after_train: false')
    s2.add_callback(on_start=lambda: s2.iter == 2 and os.kill(os.getpid(), signal.SIGHUP))
    s2.solve(sighup_effect="snapshot")
    assert s2.iter == 10 and (tmp_path / "m_iter_3.solverstate").exists()
    with pytest.raises(ValueError, match="sigint_effect must be one of stop, snapshot, none"):
        s2.solve(sigint_effect="pause")


def test_pycaffe_test_solver_py(tmp_path, monkeypatch):
    # pycaffe's test_solver.py: a relative snapshot_prefix "model"; snapshot() at iter 0 writes
    # model_iter_0.caffemodel and model_iter_0.solverstate; solve() runs to max_iter; the nets
    # outlive the solver.
    import brewnet as caffe
    z = np.load(SOLVER_DIR / "type_sgd.npz")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(str(z["net_prototxt"]))
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 lr_policy: "inv" gamma: 0.0001 power: 0.75 momentum: 0.9 '
        'max_iter: 20 snapshot_after_train: false snapshot_prefix: "model" solver_mode: CPU')
    s = caffe.SGDSolver("solver.prototxt")
    s.snapshot()
    assert sorted(p.name for p in tmp_path.glob("model_*")) == ["model_iter_0.caffemodel",
                                                                "model_iter_0.solverstate"]
    s.net.blobs["data"].data[...] = np.load(SOLVER_DIR / "batches.npz")["data"][0]
    s.solve()
    assert s.iter == 20
    net = s.net
    del s
    assert np.isfinite(net.forward()["loss"])


def test_pycaffe_surface(tmp_path):
    z = np.load(SOLVER_DIR / "type_adam.npz")
    (tmp_path / "net.prototxt").write_text(str(z["net_prototxt"]))
    (tmp_path / "solver.prototxt").write_text(str(z["solver_prototxt"]) + 'net: "net.prototxt"\n')
    s = get_solver(str(tmp_path / "solver.prototxt"))
    assert isinstance(s, brewnet.solvers.AdamSolver) and isinstance(s, SGDSolver)
    assert s.param.max_iter == 10 and s.iter == 0 and s.test_nets == []
    assert s.lr == pytest.approx(0.005)
    s.net.blobs["data"].data[...] = np.load(SOLVER_DIR / "batches.npz")["data"][0]
    s.step(2)
    assert s.iter == 2


# -- a real run -----------------------------------------------------------------------------
def test_lenet_mnist_loss_falls():
    """lenet_solver.prototxt (SGD 0.01, momentum 0.9, inv policy) on real MNIST images for 300
    iterations (~7 s): the mean loss per 10 iterations falls from ~1.8 to ~0.1."""
    from brewnet.data.idx import read_idx

    bvlc = MODELS / "bvlc" / "examples" / "mnist"
    t10k = need(MODELS / "trained" / "mnist_t10k")
    imgs = next(p for p in t10k.rglob("t10k-images*"))
    labels = next(p for p in t10k.rglob("t10k-labels*"))
    x = read_idx(imgs).astype(np.float32)[:, None] * np.float32(0.00390625)
    y = read_idx(labels).astype(np.float32)
    param = read_solver(bvlc / "lenet_solver.prototxt")
    net = swap_data_layers(read_net(bvlc / "lenet_train_test.prototxt"),
                           [[(64, 1, 28, 28), (64,)], [(100, 1, 28, 28), (100,)]])
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    param.ClearField("solver_mode")      # the session's device (the CPU, or the device switch's)
    param.max_iter, param.test_iter[0], param.test_interval, param.snapshot = 300, 10, 300, 0
    param.snapshot_after_train = False
    param.random_seed = 1701
    param.average_loss = 10          # smoothed_loss after step(10) = mean of those 10 losses
    train = lambda i: {"data": x[(i * 64) % 8960:(i * 64) % 8960 + 64],
                       "label": y[(i * 64) % 8960:(i * 64) % 8960 + 64]}
    test = lambda i: {"data": x[9000 + (i % 10) * 100:][:100], "label": y[9000 + (i % 10) * 100:][:100]}
    s = SGDSolver(param, train_feed=train, test_feeds=[test])
    curve = []
    for _ in range(30):
        s.step(10)
        curve.append(float(s.smoothed_loss))
    s.solve()       # already at max_iter: runs the final display/test pass only
    print("loss every 10 iterations:", " ".join(f"{l:.3f}" for l in curve))
    print("test:", s.test_scores[0])
    assert curve[0] > 1.0 and max(curve[-5:]) < 0.3 and np.mean(curve[-5:]) < 0.2
    assert s.test_scores[0]["accuracy"] > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_momentum_as_a_0d_tensor_gives_the_scalar_forms_bits(dtype):
    from brewnet.solvers.sgd import _scalar
    for m in (0.9, 0.99, 1 / 3):
        h = [(torch.randn(300, generator=torch.Generator().manual_seed(k)) * 10).to(dtype)
             for k in range(2)]
        ref = [x.clone() for x in h]
        torch._foreach_mul_(h, _scalar(m, h))
        torch._foreach_mul_(ref, m)
        assert all(torch.equal(a, b) for a, b in zip(h, ref))
