"""Data parallel training (brewnet.parallel) on CPU workers over gloo, against one process.

Caffe 1.0's rule: worker r of N takes the records whose running index is r mod N; each runs the
prototxt's batch B; the diffs are summed and scaled by 1/N. So N workers x B at step k see the
records kNB .. kNB+NB-1 of the one process running batch NB on the same LMDB, in the same order
(no reordering is needed: the union of the shards of a step is that contiguous run), and the
mean-loss gradients agree up to float32 summation order. Tolerance: 2e-5 absolute on every
weight after 30 steps (|w| <= ~0.6; measured 6e-8 and 9e-8 for SGD with 2 and 3 workers,
2.2e-6 for Adam, against 0.04 from one process at batch B): the only difference is the order
in which the NB per-sample terms are added, re-rounded at every step.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import brewnet as caffe
from brewnet.cli import main
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum
from brewnet.parallel.launch import free_port, host_store
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_binary
from helpers import ON_DEVICE

RECORDS, B, TOL = 60, 4, 2e-5
REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           OMP_NUM_THREADS="1")

LENET = """name: "LeNet"
layer {{ name: "mnist" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 20 kernel_size: 5 stride: 1 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param {{ num_output: 50 kernel_size: 5 stride: 1 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param {{ num_output: 500 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""
# Under the device switch the solvers train on cuda:0. Several workers need several devices:
# NCCL (brewnet's backend on CUDA) refuses two ranks on one GPU, and a worker forked from this
# process cannot start CUDA again; there the group of one worker runs instead.
MODE = "solver_mode: GPU device_id: 0" if ON_DEVICE else "solver_mode: CPU"
MANY_WORKERS = ("several workers on one GPU: NCCL refuses two ranks on one device (the group of "
                "one worker on the device runs instead)")
RULES = {"SGD": 'type: "SGD" base_lr: 0.01 momentum: 0.9',
         "Adam": 'type: "Adam" base_lr: 0.001 momentum: 0.9 momentum2: 0.999'}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("par") / "train_lmdb"
    rng = np.random.default_rng(7)
    with open_writer(str(path)) as w:
        for i in range(RECORDS):
            img = rng.integers(0, 256, (1, 28, 28), dtype=np.uint8)
            w.put(f"{i:08d}", chw_to_datum(img, int(i % 10)).SerializeToString())
    return path


def solver(folder: Path, db: Path, name: str, batch: int, rule="SGD", max_iter=30, snapshot=0,
           display=10) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}_net.prototxt").write_text(LENET.format(db=db, batch=batch))
    snap = f"snapshot: {snapshot}" if snapshot else ""
    path = folder / f"{name}_solver.prototxt"
    path.write_text(f'net: "{name}_net.prototxt" {RULES[rule]} weight_decay: 0.0005 lr_policy: "fixed" '
                    f'display: {display} max_iter: {max_iter} {snap} snapshot_prefix: "{folder / name}" '
                    f'{MODE} random_seed: 1701\n')
    return path


def weights(path) -> dict:
    net = read_binary(str(path), pb.NetParameter())
    return {(l.name, i): np.array(b.data, np.float32).reshape(tuple(b.shape.dim))
            for l in net.layer for i, b in enumerate(l.blobs)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _worker(rank, n, port, argv, log):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    sys.stderr = open(log, "w", buffering=1)
    code = 1
    try:
        code = main(argv)
    finally:
        sys.stderr.flush()
        os._exit(code)


def workers(n, argv, logs: Path, ranks=None, during=None):
    """Run ``brewnet train argv`` as ranks ``ranks`` (default all) of ``n`` forked workers, the
    store hosted here as the launcher does; ``during(procs, store)`` runs while they train.
    Returns [(exit code, log text)] per started rank."""
    port = free_port()
    host_store("127.0.0.1", port, 60)
    ctx = mp.get_context("fork")
    logs.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_worker, args=(r, n, port, argv, logs / f"rank{r}.log"))
             for r in (range(n) if ranks is None else ranks)]
    for p in procs:
        p.start()
    if during:
        during(procs, dist.TCPStore("127.0.0.1", port, None, is_master=False,
                                    timeout=timedelta(seconds=30)))
    out = []
    for p, r in zip(procs, range(n) if ranks is None else ranks):
        p.join(180)
        if p.is_alive():
            p.kill()
        out.append((p.exitcode, (logs / f"rank{r}.log").read_text()))
    return out


def one_process(path: Path) -> dict:
    assert main(["train", "--solver", str(path)]) == 0
    return weights(Path(str(path).replace("_solver.prototxt", "_iter_30.caffemodel")))


def beat(store, rank) -> int:
    key = f"brewnet/attempt_0/brewnet/hb/{rank}"
    return int(store.get(key).decode().split()[1]) if store.check([key]) else -1


@pytest.mark.cpu_only(MANY_WORKERS)
@pytest.mark.parametrize("n,rule", [(2, "SGD"), (3, "SGD"), (2, "Adam")])
def test_workers_equal_one_process_on_the_combined_batch(db, tmp_path, n, rule):
    ref = one_process(solver(tmp_path, db, "one", n * B, rule, snapshot=30))
    par = solver(tmp_path, db, "par", B, rule, snapshot=30)
    results = workers(n, ["train", "--solver", str(par), "--timeout", "60"], tmp_path / "logs")
    assert [c for c, _ in results] == [0] * n, results
    got = weights(tmp_path / "par_iter_30.caffemodel")
    moved = max_diff(got, weights_at_start(tmp_path, db, rule))
    assert moved > 100 * TOL                    # it trained: the comparison can tell
    assert max_diff(got, ref) <= TOL
    # Rank 0 alone logs (the others warn only) and writes the snapshot, as one process does.
    assert "Iteration 10" in results[0][1] and "Iteration 10" not in results[1][1]
    names = sorted(p.name.replace("par_", "one_") for p in tmp_path.glob("par_iter_*"))
    assert names == sorted(p.name for p in tmp_path.glob("one_iter_*")) == [
        "one_iter_30.caffemodel", "one_iter_30.solverstate", "one_iter_30.solverstate.cursors.json"]
    a, b = (read_binary(str(tmp_path / f"{s}_iter_30.solverstate"), pb.SolverState()) for s in ("par", "one"))
    assert (a.iter, a.current_step, len(a.history)) == (b.iter, b.current_step, len(b.history))
    assert [tuple(h.shape.dim) for h in a.history] == [tuple(h.shape.dim) for h in b.history]
    assert Path(a.learned_net).name == "par_iter_30.caffemodel"


def weights_at_start(tmp_path, db, rule) -> dict:
    path = solver(tmp_path / "start", db, "s", B, rule, max_iter=0)
    s = caffe.get_solver(str(path))
    s.snapshot()
    return weights(tmp_path / "start" / "s_iter_0.caffemodel")


@pytest.mark.cpu_only(MANY_WORKERS)
def test_brewnet_train_workers_and_torchrun(db, tmp_path):
    ref = one_process(solver(tmp_path, db, "one", 2 * B, snapshot=30))
    par = solver(tmp_path, db, "par", B, snapshot=30)
    r = subprocess.run([sys.executable, "-m", "brewnet.cli", "train", "--solver", str(par), "--workers", "2"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Starting 2 workers" in r.stderr
    assert max_diff(weights(tmp_path / "par_iter_30.caffemodel"), ref) <= TOL
    run = solver(tmp_path, db, "run", B, snapshot=30)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "brewnet.cli", "train", "--solver", str(run)],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert max_diff(weights(tmp_path / "run_iter_30.caffemodel"), ref) <= TOL


def _kill_rank1_after(iteration=0, file=None):
    """Kill -9 rank 1 once its heartbeat reports ``iteration`` or once ``file`` exists."""
    def during(procs, store):
        deadline = time.monotonic() + 120
        while (beat(store, 1) < iteration or (file and not file.exists())) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(procs[1].pid, signal.SIGKILL)
        during.killed_at = time.monotonic()
    return during


@pytest.mark.cpu_only(MANY_WORKERS)
def test_a_killed_worker_stops_the_others_naming_it(db, tmp_path):
    path = solver(tmp_path, db, "k", B, max_iter=100000)
    timeout = 20
    kill = _kill_rank1_after(5)
    (c0, log0), (c1, _) = workers(2, ["train", "--solver", str(path), "--timeout", str(timeout)],
                                  tmp_path / "logs", during=kill)
    assert c1 == -signal.SIGKILL
    assert c0 != 0
    assert "lost rank 1" in log0 and "Traceback" not in log0, log0[-2000:]
    assert time.monotonic() - kill.killed_at < timeout


@pytest.mark.cpu_only(MANY_WORKERS)
def test_resume_auto_after_a_kill_ends_bitwise_as_the_uninterrupted_run(db, tmp_path):
    args = dict(max_iter=120, snapshot=10, display=0)
    whole = solver(tmp_path / "whole", db, "w", B, **args)
    assert [c for c, _ in workers(2, ["train", "--solver", str(whole)], tmp_path / "l1")] == [0, 0]
    cut = solver(tmp_path / "cut", db, "w", B, **args)
    argv = ["train", "--solver", str(cut), "--resume", "auto", "--timeout", "20"]
    (c0, _), _ = workers(2, argv, tmp_path / "l2",
                         during=_kill_rank1_after(file=tmp_path / "cut" / "w_iter_20.solverstate"))
    assert c0 != 0
    done = sorted(int(p.name.split("_")[2].split(".")[0]) for p in (tmp_path / "cut").glob("w_iter_*.solverstate"))
    assert done and 20 <= done[-1] < 120         # killed between snapshots, before the end
    results = workers(2, argv, tmp_path / "l3")
    assert [c for c, _ in results] == [0, 0]
    assert f"resuming from {tmp_path / 'cut' / f'w_iter_{done[-1]}.solverstate'}" in results[0][1]
    a, b = weights(tmp_path / "whole" / "w_iter_120.caffemodel"), weights(tmp_path / "cut" / "w_iter_120.caffemodel")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    sa, sb = (read_binary(str(tmp_path / d / "w_iter_120.solverstate"), pb.SolverState()) for d in ("whole", "cut"))
    assert [list(h.data) for h in sa.history] == [list(h.data) for h in sb.history]


def test_one_process_resumes_bitwise_from_the_data_cursors(db, tmp_path):
    whole = solver(tmp_path, db, "w", 2 * B, max_iter=20, snapshot=10, display=0)
    assert main(["train", "--solver", str(whole)]) == 0
    for name, drop in (("r", False), ("c", True)):      # c: as Caffe, from the first record
        state = tmp_path / "w_iter_10.solverstate.cursors.json"
        if drop:
            state.unlink()
        assert main(["train", "--solver", str(solver(tmp_path, db, name, 2 * B, max_iter=20, snapshot=10,
                                                       display=0)),
                     "--snapshot", str(tmp_path / "w_iter_10.solverstate")]) == 0
    a, r, c = (weights(tmp_path / f"{s}_iter_20.caffemodel") for s in "wrc")
    assert all(np.array_equal(a[k], r[k]) for k in a)
    assert max_diff(a, c) > 1e-4


TRAIN_PY = """
# Caffe 1.0's python/train.py flow, unchanged but for the import and CPU workers.
import sys
from multiprocessing import Process
import brewnet as caffe

def solve(proto, gpus, uid, rank, out):
    caffe.set_mode_gpu()                 # no CUDA here: warns and stays on the CPU
    caffe.set_device(gpus[rank])
    caffe.set_solver_count(len(gpus))
    caffe.set_solver_rank(rank)
    caffe.set_multiprocess(True)
    solver = caffe.SGDSolver(proto)
    nccl = caffe.NCCL(solver, uid)
    nccl.bcast()
    solver.add_callback(nccl)
    if solver.param.layer_wise_reduce:
        solver.net.after_backward(nccl)
    solver.step(solver.param.max_iter)
    if rank == 0:
        solver.net.save(out)

if __name__ == "__main__":
    gpus = [0, 1]
    uid = caffe.NCCL.new_uid()
    caffe.init_log()
    caffe.log("Using devices %s" % str(gpus))
    procs = []
    for rank in range(len(gpus)):
        p = Process(target=solve, args=(sys.argv[1], gpus, uid, rank, sys.argv[2]))
        p.daemon = True
        p.start()
        procs.append(p)
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
"""


@pytest.mark.cpu_only(MANY_WORKERS)
def test_pycaffe_train_py_flow(db, tmp_path):
    ref = one_process(solver(tmp_path, db, "one", 2 * B, snapshot=30))
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN_PY))
    out = tmp_path / "final.caffemodel"
    r = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(solver(tmp_path, db, "py", B)), str(out)],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Using devices [0, 1]" in r.stderr
    assert max_diff(weights(out), ref) <= TOL


def test_a_group_of_one_worker_equals_one_process(db, tmp_path):
    """One worker of a data-parallel group (torchrun, its collectives on NCCL on cuda:0 under
    the device switch, gloo on the CPU) trains as one process does: the all-reduce over one
    rank and the 1/N scale change nothing."""
    ref = one_process(solver(tmp_path, db, "one", B, snapshot=30))
    run = solver(tmp_path, db, "run", B, snapshot=30)
    gpu = ["--gpu", "0"] if ON_DEVICE else []
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "1", "-m", "brewnet.cli", "train", "--solver", str(run),
                        *gpu], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("(nccl)" if ON_DEVICE else "(gloo)") in r.stderr
    assert max_diff(weights(tmp_path / "run_iter_30.caffemodel"), ref) <= TOL


def test_has_nccl_only_with_cuda_and_nccl(monkeypatch):
    assert caffe.has_nccl() == (torch.cuda.is_available() and dist.is_nccl_available())
    for cuda, nccl in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=cuda: c)
        monkeypatch.setattr(dist, "is_nccl_available", lambda n=nccl: n)
        assert caffe.has_nccl() == (cuda and nccl)


def test_bad_input(db, tmp_path, capsys, monkeypatch):
    path = str(solver(tmp_path, db, "bad", B))

    def fails(*flags):
        assert main(["train", "--solver", path, *flags]) == 1
        return capsys.readouterr().err

    assert "give 1 or more" in fails("--workers", "0")
    assert "not both" in fails("--resume", "auto", "--snapshot", "x.solverstate")
    if not torch.cuda.is_available():
        assert "CUDA is not available" in fails("--gpu", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "no CUDA device 5; this machine has 2" in fails("--gpu", "5")
    assert "for GPUs give their ids with --gpu" in fails("--gpu", "0,1", "--workers", "2")


@pytest.mark.cpu_only(MANY_WORKERS)
def test_a_rendezvous_that_never_completes_stops_in_bounded_time(db, tmp_path):
    path = solver(tmp_path, db, "rv", B)
    t0 = time.monotonic()
    [(code, log)] = workers(2, ["train", "--solver", str(path), "--timeout", "3"], tmp_path / "logs", ranks=[0])
    assert code == 1
    assert "did not complete within 3 s: 1 of 2 workers joined (ranks [0])" in log, log[-2000:]
    assert "Traceback" not in log
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("kind", ["Data", "HDF5Data"])
def test_a_shard_takes_the_running_indices_of_its_rank(tmp_path, kind):
    # Caffe 1.0: the running index keeps counting across epochs, so with 10 records and 3
    # workers rank 1 takes records 1, 4, 7, then 0 (index 10), 3, ...
    import h5py

    from brewnet.net import Net

    if kind == "Data":
        with open_writer(str(tmp_path / "db")) as w:
            for i in range(10):
                w.put(f"{i:08d}", chw_to_datum(np.zeros((1, 2, 2), np.uint8), i).SerializeToString())
        layer = f'type: "Data" data_param {{ source: "{tmp_path / "db"}" batch_size: 4 backend: LMDB }}'
    else:
        with h5py.File(tmp_path / "d.h5", "w") as f:
            f["data"], f["label"] = np.zeros((10, 1, 2, 2), np.float32), np.arange(10, dtype=np.float32)
        (tmp_path / "list.txt").write_text(str(tmp_path / "d.h5"))
        layer = f'type: "HDF5Data" hdf5_data_param {{ source: "{tmp_path / "list.txt"}" batch_size: 4 }}'
    (tmp_path / "n.prototxt").write_text(f'layer {{ name: "d" top: "data" top: "label" {layer} }}')
    got = {}
    for phase in (pb.TRAIN, pb.TEST):
        net = Net(str(tmp_path / "n.prototxt"), phase)
        net.layer_list[0].shard(1, 3)
        got[phase] = [int(x) for _ in range(3) for x in (net.forward_tensors(), net.blobs["label"].tensor)[1]]
    assert got[pb.TRAIN] == [1, 4, 7, 0, 3, 6, 9, 2, 5, 8, 1, 4]
    assert got[pb.TEST] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]      # Caffe tests on rank 0 unsharded


@pytest.mark.cpu_only(MANY_WORKERS)
def test_a_hung_worker_stops_the_others_within_the_timeout(db, tmp_path):
    # SIGSTOP freezes rank 1 (its heartbeat thread too): rank 0's allreduce times out after
    # --timeout and the stale heartbeat names rank 1.
    path = solver(tmp_path, db, "h", B, max_iter=100000)
    timeout, took = 5, {}

    def during(procs, store):
        while beat(store, 1) < 3:
            time.sleep(0.02)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        procs[0].join(120)
        took["s"] = time.monotonic() - t0
        os.kill(procs[1].pid, signal.SIGKILL)

    (c0, log0), _ = workers(2, ["train", "--solver", str(path), "--timeout", str(timeout)],
                            tmp_path / "logs", during=during)
    assert c0 != 0 and "lost rank 1" in log0, log0[-2000:]
    assert took["s"] < timeout + 15
