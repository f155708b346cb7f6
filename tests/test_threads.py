"""Torch's thread choice (brewnet/threads.py): tiny nets on one thread, measured choice for the
rest, and the user's override winning."""
import numpy as np
import pytest
import torch

import brewnet
from brewnet import threads
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text


@pytest.fixture(autouse=True)
def _passive(monkeypatch):
    """These tests are of the size rule and the timing; whether this test process loaded torch
    before brewnet (one thread for training) is tested in a fresh process below."""
    monkeypatch.setattr(threads, "SPINNING", False)


def parse_net_text(text):
    return parse_text(text, pb.NetParameter())


LOGREG = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 10 dim: 4 } shape { dim: 10 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
BIG = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 64 dim: 256 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 512 weight_filler { type: "xavier" } } }
"""


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch):
    """Each test starts as a fresh process: no override, brewnet has set nothing yet."""
    n = torch.get_num_threads()
    monkeypatch.delenv("BREWNET_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_initial", n)
    monkeypatch.setattr(threads, "_ours", [])
    monkeypatch.setattr(threads, "_ceiling", [])
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    yield
    torch.set_num_threads(n)


def solver(net_text: str):
    p = pb.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy="fixed", max_iter=10,
                           solver_mode=pb.SolverParameter.CPU, random_seed=1)
    p.net_param.CopyFrom(parse_net_text(net_text))
    s = brewnet.SGDSolver(p)
    s.net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((10, 4))
    s.net.blobs["label"].data[...] = np.arange(10) % 2
    return s


def test_tiny_net_gets_one_thread_in_a_pycaffe_solver():
    torch.set_num_threads(2)
    threads._initial = 2
    s = solver(LOGREG)
    assert s.threads.tiny
    s.step(2)
    assert torch.get_num_threads() == 1


def test_largest_op_decides_tiny():
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    assert threads.largest_op_flops(net) == 2 * 64 * 256 * 512
    assert not threads.Tuner(net).tiny


def test_brewnet_threads_env_wins(monkeypatch):
    monkeypatch.setenv("BREWNET_THREADS", "2")
    s = solver(LOGREG)
    s.step(2)
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("BREWNET_THREADS", "zero")
    with pytest.raises(ValueError, match="BREWNET_THREADS"):
        threads.user_threads()


def test_user_set_num_threads_wins():
    s = solver(LOGREG)
    s.step(1)
    assert torch.get_num_threads() == 1         # brewnet's choice ...
    torch.set_num_threads(2)                    # ... until the user makes one
    s.step(3)
    assert torch.get_num_threads() == 2
    assert threads.user_threads() == 2


class FakeClock:
    """Calls take ``cost[threads]`` seconds."""

    def __init__(self, cost):
        self.now, self.cost = 0.0, cost

    def __call__(self):
        self.now += self.cost[torch.get_num_threads()] / 2   # read twice per call
        return self.now


@pytest.mark.parametrize("cost,expect", [({1: 1.0, 2: 3.0}, 1),     # a neighbour holds a core
                                         ({1: 1.0, 2: 0.6}, 2)])    # idle: threads pay
def test_measured_choice(monkeypatch, cost, expect):
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    tuner = threads.Tuner(net)
    monkeypatch.setattr(tuner, "clock", FakeClock(cost))
    for _ in range(threads.WARMUP + 2 * threads.BLOCK + 1):
        with tuner:
            pass
    assert tuner.choice == expect and torch.get_num_threads() == expect


def test_a_restart_times_the_new_path_afresh(monkeypatch):
    """One thread chosen on calls of one path (the per-layer forwards) is not kept for another
    (lean inference's graph, after its trace): the tuner starts over and finds two faster."""
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    tuner = threads.Tuner(net)
    monkeypatch.setattr(tuner, "clock", FakeClock({1: 1.0, 2: 3.0}))
    for _ in range(threads.WARMUP + 2 * threads.BLOCK + 1):
        with tuner:
            pass
    assert tuner.choice == 1
    monkeypatch.setattr(tuner, "clock", FakeClock({1: 1.0, 2: 0.6}))
    with tuner:
        tuner.restart()
    for _ in range(threads.WARMUP + 2 * threads.BLOCK + 1):
        with tuner:
            pass
    assert tuner.choice == 2 and torch.get_num_threads() == 2


def test_pycaffe_forward_restarts_the_timing_at_the_graphs_trace(monkeypatch):
    """At the defaults, the call that traces lean inference's graph restarts the tuner's timing
    (and only that call): the choice made on per-layer calls is not carried over."""
    from brewnet.execution import lean

    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    restarts = []
    real = threads.Tuner.restart
    monkeypatch.setattr(threads.Tuner, "restart", lambda self: restarts.append(1) or real(self))
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    for _ in range(lean.AFTER + 5):
        net.forward()
    assert net._lean.gm is not None and restarts == [1]


def test_slowdown_triggers_a_new_choice(monkeypatch):
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    tuner = threads.Tuner(net)
    clock = FakeClock({1: 1.0, 2: 0.6})
    monkeypatch.setattr(tuner, "clock", clock)
    for _ in range(threads.WARMUP + 2 * threads.BLOCK + 1):
        with tuner:
            pass
    assert tuner.choice == 2
    clock.cost = {1: 1.0, 2: 5.0}                # the neighbour arrives
    for _ in range(4 * threads.BLOCK):
        with tuner:
            pass
    assert tuner.choice == 1


@pytest.mark.parametrize("env,expect", [("", 2), ("adaptive", 1)])
def test_training_keeps_its_thread_count_unless_adaptive(monkeypatch, env, expect):
    """A Solver's count does not follow timings (the numbers would depend on the load)."""
    monkeypatch.setenv("BREWNET_THREADS", env)
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    tuner = threads.Tuner(net, timed=threads.timed_training())
    monkeypatch.setattr(tuner, "clock", FakeClock({1: 1.0, 2: 3.0}))   # one thread is faster
    for _ in range(threads.WARMUP + 2 * threads.BLOCK + 1):
        with tuner:
            pass
    assert tuner.choice == expect


def test_pycaffe_forward_plans_threads():
    torch.set_num_threads(2)
    threads._initial = 2
    net = brewnet.Net(parse_net_text(LOGREG), brewnet.TEST)
    net.forward()
    assert torch.get_num_threads() == 1


SPIN_SCRIPT = """
import logging, sys{first}
import brewnet
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text
from brewnet.solvers import SOLVERS
import torch
logging.basicConfig(stream=sys.stdout, level=logging.WARNING)
p = parse_text('''type: "SGD" base_lr: 0.01 lr_policy: "fixed" max_iter: 10 display: 0 solver_mode: CPU
net_param {{ layer {{ name: "d" type: "Input" top: "data" top: "label"
  input_param {{ shape {{ dim: 8 dim: 1 dim: 28 dim: 28 }} shape {{ dim: 8 }} }} }}
layer {{ name: "c" type: "Convolution" bottom: "data" top: "c"
  convolution_param {{ num_output: 20 kernel_size: 5 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "c" top: "ip" inner_product_param {{ num_output: 10 }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }} }}''',
               pb.SolverParameter())
s = SOLVERS["SGD"](p)
s.step(2)
print("threads", torch.get_num_threads())
"""


@pytest.mark.skipif(threads.usable_cores() < 2, reason="needs 2 cores to tell 1 thread from many")
@pytest.mark.parametrize("first, policy, expect", [("", None, "cores"),
                                                   ("\nimport torch", None, "one"),
                                                   ("\nimport torch", "PASSIVE", "cores")])
def test_training_after_torch_was_imported_first_uses_one_thread(first, policy, expect):
    """libgomp fixes its wait policy when torch loads it: imported before brewnet (without
    OMP_WAIT_POLICY) its threads spin, so training keeps to one thread and says why."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "BREWNET_THREADS")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", SPIN_SCRIPT.format(first=first)], env=env,
                         capture_output=True, text=True, check=True).stdout
    n = int(out.split("threads")[-1])
    if expect == "one":
        assert n == 1 and "torch was imported before brewnet" in out
    else:
        assert n == threads.usable_cores() and "imported before brewnet" not in out


@pytest.mark.parametrize("policy, want", [(None, ("PASSIVE", "10000")), ("PASSIVE", ("PASSIVE", None)),
                                          ("", ("", None))])
def test_brewnet_first_makes_idle_threads_spin_briefly_then_sleep(policy, want):
    """``import brewnet`` before torch: libgomp's threads spin for GOMP_SPINCOUNT=10000 (the gaps
    between one forward's ops) and then sleep (OMP_WAIT_POLICY=PASSIVE); a user's wait policy,
    even empty, is left as it is (docs/internals.md, *threads.py*)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", "import os, brewnet; print(repr((os.environ.get("
                          "'OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(want)


def test_a_trial_on_a_much_slower_count_stops_after_one_call(monkeypatch):
    """Re-checks on a count that stalls (a busy neighbour: 30x slower) cost one call each, not a
    block of them (steady latency)."""
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    tuner = threads.Tuner(net)
    monkeypatch.setattr(tuner, "clock", FakeClock({1: 1.0, 2: 30.0}))
    monkeypatch.setattr(threads, "RECHECK_S", 0.0)            # re-check at every chance
    ran = []
    for _ in range(threads.WARMUP + threads.BLOCK + 60):
        with tuner:
            ran.append(torch.get_num_threads())
    assert tuner.choice == 1
    after = ran[ran.index(1):]
    assert after.count(2) >= 5                                 # it did keep re-checking ...
    assert all(not (a == b == 2) for a, b in zip(after, after[1:]))   # ... one call at a time


def test_re_checks_that_keep_stopping_early_back_off(monkeypatch):
    """On a loaded machine the other count keeps losing: re-checks come ever more rarely (up to
    MAX_WAIT_S apart), not every RECHECK_S."""
    net = brewnet.Net(parse_net_text(BIG), brewnet.TEST)
    tuner = threads.Tuner(net)
    monkeypatch.setattr(tuner, "clock", FakeClock({1: 1.0, 2: 30.0}))
    monkeypatch.setattr(threads, "RECHECK_S", 2.0)
    monkeypatch.setattr(threads, "MAX_WAIT_S", 16.0)
    now = [0.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: now[0])
    ran = []
    for _ in range(threads.WARMUP + threads.BLOCK + 400):
        now[0] += 1.0                                          # a call a second
        with tuner:
            ran.append(torch.get_num_threads())
    after = ran[ran.index(1):]
    trials = [i for i, n in enumerate(after) if n == 2]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert tuner.choice == 1 and len(trials) >= 5
    assert gaps == sorted(gaps) and 16 <= gaps[-1] <= 18      # doubling, then capped
