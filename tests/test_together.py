"""Train together (``brewnet.many.TrainTogether``, ``brewnet train --solver A --solver B``):
K solvers of different types and lr policies over one LMDB write exactly the snapshots each
writes alone, reading every record once per batch; the log tells the solvers apart."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brewnet.analysis.logparse import parse_lines
from brewnet.cli import main
from brewnet.data import db
from brewnet.many import TrainTogether
from brewnet.solvers import get_solver
from helpers import ON_DEVICE, random_digits_lmdb

NET = """name: "small"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{lmdb}" batch_size: {batch} backend: LMDB prefetch: {prefetch} }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{lmdb}" batch_size: 10 backend: LMDB prefetch: {prefetch} }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool" type: "Pooling" bottom: "conv" top: "pool"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool" top: "ip1"
  inner_product_param {{ num_output: 16 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param {{ dropout_ratio: 0.3 }} }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""

QUIET = NET.replace('layer {{ name: "drop" type: "Dropout" bottom: "ip1" top: "ip1" '
                    'dropout_param {{ dropout_ratio: 0.3 }} }}\n', "")   # draws no random numbers

SOLVERS = {   # SGD/step, Adam/fixed, Nesterov/inv: own seeds, schedules and snapshots
    "sgd": 'type: "SGD" base_lr: 0.05 lr_policy: "step" gamma: 0.5 stepsize: 4 momentum: 0.9 '
           'weight_decay: 0.0005 max_iter: 12 snapshot: 5 display: 3 random_seed: 11',
    "adam": 'type: "Adam" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 momentum2: 0.999 '
            'delta: 1e-8 max_iter: 10 snapshot: 4 display: 2 random_seed: 12',
    "nesterov": 'type: "Nesterov" base_lr: 0.02 lr_policy: "inv" gamma: 0.1 power: 0.75 '
                'momentum: 0.8 weight_decay: 0.001 max_iter: 14 snapshot: 7 display: 7 '
                'random_seed: 13',
}


# the solvers' device: the CPU, or cuda:0 under the device switch (the same runs compared bit for
# bit there: together against alone on one GPU, tests/conftest.py's deterministic kernels)
MODE = "solver_mode: GPU device_id: 0" if ON_DEVICE else "solver_mode: CPU"


@pytest.fixture
def setup(tmp_path):
    lmdb = random_digits_lmdb(tmp_path / "digits_lmdb", 50, 10, seed=4)

    def write(batch=8, prefetch=0, net_text=NET, tag="", **extra):
        net = tmp_path / f"net_{batch}_{prefetch}{tag}.prototxt"
        net.write_text(net_text.format(lmdb=lmdb, batch=batch, prefetch=prefetch))
        files = []
        for name, text in SOLVERS.items():
            text += f' net: "{net}" test_iter: 2 test_interval: {extra.get(name, 5)} ' \
                    f'snapshot_prefix: "{tmp_path / (name + tag)}" {MODE}'
            f = tmp_path / f"{name}_solver_{batch}_{prefetch}{tag}.prototxt"
            f.write_text(text)
            files.append(str(f))
        return files
    return tmp_path, write


@pytest.fixture
def record_reads(monkeypatch):
    count = {"n": 0}
    orig = db.Cursor.next

    def counted(self):
        count["n"] += 1
        return orig(self)
    monkeypatch.setattr(db.Cursor, "next", counted)
    return count


def snapshots(folder, take=True):
    """{name: bytes} of the snapshot files in ``folder``, removed when ``take``."""
    out = {}
    for p in sorted(folder.glob("*_iter_*")):
        out[p.name] = p.read_bytes()
        if take:
            p.unlink()
    return out


def solve_alone(files, record_reads) -> list[int]:
    """Each solver trained alone; the records each read."""
    reads = []
    for f in files:
        before = record_reads["n"]
        get_solver(f).solve()
        reads.append(record_reads["n"] - before)
    return reads


def test_three_solvers_write_the_files_they_write_alone(setup, record_reads):
    folder, write = setup
    files = write()
    reads_alone = solve_alone(files, record_reads)
    alone = snapshots(folder)
    # iters 5, 10, 12 (after training); 4, 8, 10; 7, 14: .caffemodel, .solverstate and the data
    # cursors beside it (brewnet.data.cursors), each as alone
    assert len(alone) == 3 * (3 + 3 + 2)
    before = record_reads["n"]
    t = TrainTogether(files)
    t.solve()
    together = snapshots(folder)
    assert together.keys() == alone.keys()
    for name in alone:
        assert together[name] == alone[name], name
    # One stream for the three train nets and one for the three test nets: every record read
    # once per batch, as many as the longest solver alone reads (14 iterations + the tests).
    assert len(t.streams) == 2
    assert record_reads["n"] - before == max(reads_alone)
    assert [s.iter for s in t.solvers] == [12, 10, 14]
    a, b = (np.frombuffer(alone[n], np.uint8) for n in ("sgd_iter_10.caffemodel", "adam_iter_10.caffemodel"))
    assert a.size != b.size or (a != b).any()


def test_prefetching_streams_and_a_test_schedule_of_its_own(setup, caplog):
    folder, write = setup
    files = write(prefetch=3, nesterov=7)      # nesterov tests on another schedule
    for f in files:
        get_solver(f).solve()
    alone = snapshots(folder)
    caplog.set_level("INFO", logger="brewnet")
    t = TrainTogether(files)
    t.solve()
    assert snapshots(folder) == alone
    assert len(t.streams) == 3
    text = caplog.text
    assert "Training 3 solvers together on 3 data stream(s)" in text
    assert ("[s2] test#0 'data' reads its own data stream: test_interval (5 vs 7) differs from "
            "[s0] test#0 'data'") in text


def test_streams_by_data_definition(setup, caplog):
    folder, write = setup
    small, big = write(batch=8), write(batch=16)
    caplog.set_level("INFO", logger="brewnet")
    t = TrainTogether([small[0], big[1], small[2]])
    assert [len(st.consumers) for st in t.streams] == [2, 3, 1]     # train (8), test, train (16)
    assert "data_param.batch_size (8 vs 16)" in caplog.text


def test_same_snapshot_prefix_is_refused(setup):
    _, write = setup
    files = write()
    with pytest.raises(ValueError, match="both snapshot to prefix"):
        TrainTogether([files[0], files[0]])


def test_cli_log_prefixes_parse_per_solver(setup, capsys):
    folder, write = setup
    files = write()
    argv = ["train"] + [x for f in files for x in ("--solver", f)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Training 3 solvers together on 2 data stream(s)" in err
    lines = err.splitlines()
    for k, (iters, display) in enumerate([(12, 3), (10, 2), (14, 7)]):
        mine = [l for l in lines if f"] [s{k}] " in l]
        train, test = parse_lines(mine)
        assert [r["NumIters"] for r in train] == list(range(0, iters, display))
        assert [r["NumIters"] for r in test] == list(range(0, iters + 1, 5))
    log = folder / "train.log"
    log.write_text(err)
    assert main(["parse-log", str(log), str(folder), "--prefix", "[s1]"]) == 0
    rows = (folder / "train.log.train").read_text().splitlines()
    assert len(rows) == 1 + 5                     # header + iterations 0, 2, ..., 8
    assert snapshots(folder, take=False).keys() >= {"adam_iter_10.solverstate", "sgd_iter_12.caffemodel"}


def test_cli_bad_input(setup, capsys):
    _, write = setup
    files = write()
    assert main(["train", "--solver", files[0], "--solver", files[1], "--snapshot", "x.solverstate"]) == 1
    assert "one solver" in capsys.readouterr().err
    assert main(["train", "--solver", files[0], "--solver", files[0]]) == 1
    err = capsys.readouterr().err
    assert "both snapshot to prefix" in err and "Traceback" not in err


def test_fuse_errors_are_one_clean_line(setup, capsys, monkeypatch):
    """--fuse hands the solvers to brewnet.many.fused (a stand-in here, refusing as the real one
    refuses nets of different architectures); its error is the command's one-line error."""
    import sys
    import types

    _, write = setup
    files = write()
    fake = types.ModuleType("brewnet.many.fused")

    class FuseError(ValueError):
        pass

    def refuse(params, device=None, **options):       # exact=, dtype=
        assert len(params) == 2 and all(p.net.endswith(".prototxt") for p in params)
        raise FuseError("layer 'conv' differs: num_output 4 vs 8")
    fake.FuseError, fake.FusedSolvers = FuseError, refuse
    monkeypatch.setitem(sys.modules, "brewnet.many.fused", fake)
    assert main(["train", "--fuse", "--solver", files[0], "--solver", files[1]]) == 1
    err = capsys.readouterr().err
    assert "brewnet train: layer 'conv' differs: num_output 4 vs 8" in err and "Traceback" not in err


def test_step_calls_keep_every_net_on_its_own_batches(setup):
    _, write = setup
    files = write()
    alone = []
    for f in files:
        s = get_solver(f)
        s.step(3)
        s.step(4)
        alone.append([b.detach().clone() for b in s.net.learnable])
    t = TrainTogether(files)
    t.step(3)
    t.step(4)
    for s, ref in zip(t.solvers, alone):
        assert all(torch.equal(a.detach(), b) for a, b in zip(s.net.learnable, ref))


def mixed(write):
    """SGD and Adam over the net without Dropout, Nesterov over the one with it."""
    quiet = write(net_text=QUIET, tag="q")
    return [quiet[0], quiet[1], write()[2]]


def test_worker_threads_write_the_files_they_write_alone(setup, record_reads, caplog):
    folder, write = setup
    files = mixed(write)
    reads_alone = solve_alone(files, record_reads)
    alone = snapshots(folder)
    caplog.set_level("INFO", logger="brewnet")
    threads = torch.get_num_threads()
    before = record_reads["n"]
    t = TrainTogether(files, threads=2)
    # the Dropout solver (2) draws from torch's one random stream: it steps on the first
    # thread only, beside a quiet one, while the other quiet one steps on the second
    assert t.drawing == {2} and t.groups == [[1, 2], [0]]
    assert "Stepping the solvers on 2 worker threads: [s1] [s2]; [s0]" in caplog.text
    t.solve()
    together = snapshots(folder)
    assert together.keys() == alone.keys() and len(alone) == 3 * (3 + 3 + 2)
    for name in alone:
        assert together[name] == alone[name], name
    assert record_reads["n"] - before == max(reads_alone)
    assert torch.get_num_threads() == threads and all(s.threads.pinned is None for s in t.solvers)


def test_a_dropped_solver_leaves_no_worker_idle(setup, record_reads, monkeypatch):
    """The live solvers are dealt to the workers again each round: after solver 0 leaves, 1 and
    2 (planned on one worker) step on a worker each, with the cores shared between them, and
    once only 2 is left it has every core; their files are still those they write alone."""
    from brewnet import threads as _threads

    folder, write = setup
    files = mixed(write)
    solve_alone(files[1:], record_reads)
    alone = snapshots(folder)
    t = TrainTogether(files, threads=2)
    assert t.groups == [[1, 2], [0]]
    rounds, real = [], t._round
    monkeypatch.setattr(t, "_round", lambda ks, runs, per: rounds.append((tuple(ks), per))
                        or real(ks, runs, per))
    gen = t.solving()
    next(gen)
    t.drop(0)
    for _ in gen:
        pass
    cores = _threads.user_threads() or _threads.ceiling()     # what the run shares out
    half = max(1, cores // 2)
    assert sorted(rounds[:2]) == [((0,), half), ((1, 2), half)]     # (the workers' order varies)
    rest = rounds[2:]
    assert ((1,), half) in rest and ((2,), half) in rest and rest[-1] == ((2,), cores)
    assert set(rest) <= {((1,), half), ((2,), half), ((2,), cores)}
    together = {k: v for k, v in snapshots(folder).items() if not k.startswith("sgdq")}
    assert together.keys() == alone.keys()
    for name in alone:
        assert together[name] == alone[name], name


def test_threaded_steps_equal_sequential_ones(setup):
    _, write = setup
    files = mixed(write)
    runs = []
    for n in (1, 3):
        t = TrainTogether(files, threads=n)
        assert len(t.groups) == n
        t.step(4)
        t.step(3)
        runs.append([[b.detach().clone() for b in s.net.learnable] for s in t.solvers])
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_an_error_in_a_worker_thread_names_its_solver(setup, error):
    _, write = setup
    t = TrainTogether(write(net_text=QUIET, tag="q"), threads=2)
    bad = t.solvers[1]
    step = bad._forward_backward

    def fail():
        if bad.iter == 3:
            raise error("boom")
        return step()
    bad._forward_backward = fail
    with pytest.raises(error, match="boom") as e:
        t.solve()
    named = str(e.value) + " ".join(getattr(e.value, "__notes__", []))
    assert "solver 1 ([s1])" in named
    assert bad.iter == 3 and all(s.threads.pinned is None for s in t.solvers)


def test_log_prefix_is_per_thread(caplog):
    import logging
    import threading

    from brewnet.solvers.logprefix import log_prefix

    caplog.set_level("INFO", logger="brewnet")
    log = logging.getLogger("brewnet")
    both = threading.Barrier(2)

    def speak(prefix):
        with log_prefix(prefix):
            both.wait()               # both prefixes set at once
            for i in range(20):
                log.info("%s line %d", prefix.strip(), i)
            both.wait()
    workers = [threading.Thread(target=speak, args=(p,)) for p in ("[s0] ", "[s1] ")]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    log.info("no prefix here")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 41 and lines[-1] == "no prefix here"
    for line in lines[:-1]:
        own = line.split(" line ")[0].split()[-1]
        assert line.startswith(own + " "), line


def test_cli_worker_threads_keep_log_prefixes(setup, capsys):
    folder, write = setup
    files = mixed(write)
    argv = ["train", "--together-threads", "2"] + [x for f in files for x in ("--solver", f)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Stepping the solvers on 2 worker threads" in err
    lines = err.splitlines()
    for k, (iters, display) in enumerate([(12, 3), (10, 2), (14, 7)]):
        train, test = parse_lines([l for l in lines if f"] [s{k}] " in l])
        assert [r["NumIters"] for r in train] == list(range(0, iters, display))
        assert [r["NumIters"] for r in test] == list(range(0, iters + 1, 5))
    log = folder / "train.log"
    log.write_text(err)
    assert main(["parse-log", str(log), str(folder), "--prefix", "[s1]"]) == 0
    assert len((folder / "train.log.train").read_text().splitlines()) == 1 + 5
    assert main(["train", "--together-threads", "0", "--solver", files[0], "--solver", files[1]]) == 1
    assert "threads must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.cpu_only("the worker-thread count follows the CPU's cores; solvers on CUDA step "
                     "on one thread unless asked (the threaded tests above ask)")
def test_worker_count_by_net_size(setup, monkeypatch):
    from brewnet.many.together import plan_groups, worker_count
    from brewnet.threads import usable_cores

    monkeypatch.delenv("BREWNET_TOGETHER_THREADS", raising=False)
    _, write = setup
    t = TrainTogether(write(net_text=QUIET, tag="q"))
    assert worker_count(t.solvers) == 1 and len(t.groups) == 1     # tiny nets: one thread
    for s in t.solvers:
        s.threads.tiny = False
    assert worker_count(t.solvers) == min(3, usable_cores())     # one per core
    monkeypatch.setenv("BREWNET_TOGETHER_THREADS", "2")
    assert worker_count(t.solvers) == 2 and worker_count(t.solvers, 5) == 3
    assert plan_groups(range(3), {0, 2}, 2) == [[0, 2], [1]]
    assert plan_groups(range(3), {0, 1, 2}, 3) == [[0, 1, 2]]


def test_stop_request_reaches_every_worker_thread(setup):
    folder, write = setup
    t = TrainTogether(write(net_text=QUIET, tag="q"), threads=2)
    first = t.solvers[0]
    first.add_callback(on_gradients=lambda: first.iter == 2 and t.request_action("stop"))
    t.solve()
    files = snapshots(folder)
    for s in t.solvers:      # each stops at its next check: this round or the next
        assert 3 <= s.iter <= 4 < s.param.max_iter
        assert f"{s.param.snapshot_prefix.rsplit('/', 1)[-1]}_iter_{s.iter}.caffemodel" in files
