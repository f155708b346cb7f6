"""Many nets at once: one table, one run.

    python benchmarks/many_nets.py [--ks 1,2,4,8] [--steps 20] [--warmup 10] [--device cpu|cuda]
                                   [--nets ip,lenet] [--modes one-by-one,processes,together,fused]
                                   [--repeat R]

For the seed's single-InnerProduct net (MNIST, batch 100) and Caffe's LeNet (batch 64), K nets
that differ only in their random seed are trained each way:
  one-by-one  one process trains the K nets one after another (each alone);
  processes   K processes at once, each training one net (what users do today); they start
              timing together (a barrier file) after their warm-up;
  together    one process, ``brewnet.many.TrainTogether``: one data stream for all K, its
              worker threads as it chooses them (``together:N``: N worker threads);
  fused       ``brewnet.many.fused.FusedSolvers`` ("n/a" when it is not installed): HFTA's
              grouped convolutions and batched products (the default formulation);
              ``fused:exact``: each net's own kernels, bitwise equal to each net alone.
"step ms" is the wall time of one step of all K nets (after ``--warmup`` steps, over
``--steps``; with ``--repeat R`` the median of R measurements taken with the modes in turn);
"speed-up" is one-by-one's step time over the mode's; "CPU ms" the CPU time (user + system)
the mode's processes spent per step of all K nets, summed over processes (how much work a
mode does, where "step ms" is how long it takes on the cores it can use); "peak MiB" is the peak
resident memory of the mode's processes, summed over processes. The data is MNIST t10k from
``../shared`` converted to an LMDB once (in a temp folder); where the shared data is absent (a
GPU machine with only the checkout), 10000 random 28 x 28 digits stand in (the same shapes and
work; the losses mean nothing) and LeNet's prototxt is the vendored one (tests/data). Every mode
trains with torch's default threads, as a user's run would (``--threads N`` sets OMP_NUM_THREADS for every process
instead); the machine may be shared, so compare within one run. The workers inherit the
environment: ``BREWNET_STEP_GRAPH=1`` measures the step a long run gets (a solver replays its
recorded forward-backward once 5000 iterations are ahead, brewnet/execution/recorded_step.py; the
fused engine has its own step).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
T10K = SHARED / "caffe-models" / "trained" / "mnist_t10k" / "data" / "mnist"
LENET = Path("caffe-models") / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt"
LENET = SHARED / LENET if (SHARED / LENET).exists() else ROOT / "tests" / "data" / LENET

IP_NET = """name: "ip"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 100 backend: LMDB }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""
SOLVER = ('net: "{net}" base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" '
          'gamma: 0.0001 power: 0.75 max_iter: 100000 display: 0 snapshot: 0 random_seed: {seed} '
          'snapshot_prefix: "{prefix}"')


def prepare(work: Path) -> dict:
    """The LMDB and, per net, the train net file (TRAIN phase only: no test nets)."""
    from brewnet.cli import main
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import read_net, write_text

    lmdb = work / "mnist_t10k_lmdb"
    if not lmdb.exists() and not T10K.exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import random_digits_lmdb  # the tests' random digits, 28 x 28

        random_digits_lmdb(lmdb, 10000, 28, seed=0)
    elif not lmdb.exists():
        import logging
        logging.getLogger("brewnet").setLevel(logging.WARNING)
        assert main(["convert-mnist", str(T10K / "t10k-images-idx3-ubyte.gz"),
                     str(T10K / "t10k-labels-idx1-ubyte.gz"), str(lmdb)]) == 0
    (work / "ip.prototxt").write_text(IP_NET.format(lmdb=lmdb))
    lenet = read_net(str(LENET))
    keep = pb.NetParameter()
    keep.CopyFrom(lenet)
    del keep.layer[:]
    for l in lenet.layer:
        if any(r.phase == pb.TEST for r in l.include):
            continue
        if l.type == "Data":
            l.data_param.source, l.data_param.batch_size = str(lmdb), 64
        keep.layer.add().CopyFrom(l)
    write_text(work / "lenet.prototxt", keep)
    return {"ip": work / "ip.prototxt", "lenet": work / "lenet.prototxt"}


def solver_params(net: Path, k: int, work: Path):
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import parse_text

    return [parse_text(SOLVER.format(net=net, seed=100 + i, prefix=work / f"s{i}"), pb.SolverParameter())
            for i in range(k)]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(a) -> dict:
    """One cell's measurement in this process; prints a JSON line."""
    import logging

    import torch

    from brewnet.solvers import get_solver

    logging.getLogger("brewnet").setLevel(logging.WARNING)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = solver_params(Path(a.net), a.k, Path(a.work))
    if a.mode == "one-by-one":
        total = cpu = 0.0
        for p in params:
            s = get_solver(p, device=device)
            s.step(a.warmup)
            sync()
            t0, c0 = time.perf_counter(), cpu_s()
            s.step(a.steps)
            sync()
            total += time.perf_counter() - t0
            cpu += cpu_s() - c0
            del s
        wall = total
    else:
        if a.mode == "processes":
            runner = get_solver(params[0], device=device)
        elif a.mode.startswith("together"):
            from brewnet.many import TrainTogether
            n = a.mode.partition(":")[2]
            runner = TrainTogether(params, device=device, threads=int(n) if n else None)
        else:
            from brewnet.many.fused import FusedSolvers
            runner = FusedSolvers(params, device=device, exact=a.mode == "fused:exact")
        runner.step(a.warmup)
        sync()
        if a.barrier:
            Path(a.barrier + f".ready{a.index}").touch()
            while not os.path.exists(a.barrier):
                time.sleep(0.005)
        t0, c0 = time.perf_counter(), cpu_s()
        runner.step(a.steps)
        sync()
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    cuda_peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return {"wall": wall, "cpu": cpu, "peak": peak_mib(), "cuda_peak": cuda_peak}


def spawn(a, mode, net, k, index=0, barrier=""):
    cmd = [sys.executable, __file__, "--worker", mode, "--net", str(net), "--k", str(k),
           "--work", a.work, "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--device", a.device, "--index", str(index), "--barrier", barrier]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if getattr(a, "threads", 0):
        env["OMP_NUM_THREADS"] = str(a.threads)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def result(proc) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def cell(a, mode, net, k) -> dict | None:
    if mode.startswith("fused"):
        try:
            import brewnet.many.fused  # noqa: F401
        except ImportError:
            return None
    if mode != "processes":
        r = result(spawn(a, mode, net, 1 if mode == "processes" else k))
        return {"step_ms": 1000 * r["wall"] / a.steps, "cpu_ms": 1000 * r["cpu"] / a.steps,
                "peak": r["peak"] + r["cuda_peak"]}
    barrier = os.path.join(a.work, f"barrier_{net.stem}_{k}")
    procs = [spawn(a, mode, net, 1, i, barrier) for i in range(k)]
    while sum(os.path.exists(barrier + f".ready{i}") for i in range(k)) < k:
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a worker failed")
        time.sleep(0.01)
    Path(barrier).touch()
    rs = [result(p) for p in procs]
    return {"step_ms": 1000 * max(r["wall"] for r in rs) / a.steps,
            "cpu_ms": 1000 * sum(r["cpu"] for r in rs) / a.steps,
            "peak": sum(r["peak"] + r["cuda_peak"] for r in rs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--nets", default="ip,lenet")
    ap.add_argument("--modes", default="one-by-one,processes,together,fused")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)   # past the data layers' timing window (batches 2-9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each cell R times, the modes in turn; the median is shown")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS for every process (default: torch's default)")
    ap.add_argument("--work", default="")
    ap.add_argument("--worker", default="")
    ap.add_argument("--net", default="")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--barrier", default="")
    a = ap.parse_args()
    if a.worker:
        a.mode = a.worker
        print(json.dumps(worker(a)))
        return
    if not T10K.exists():
        print(f"many_nets: no MNIST t10k at {T10K}: random digits of its shapes instead")
    with tempfile.TemporaryDirectory() as tmp:
        a.work = a.work or tmp
        nets = prepare(Path(a.work))
        modes = a.modes.split(",")
        threads = a.threads or "default"
        print(f"many_nets: {a.steps} timed steps after {a.warmup}, device {a.device}, "
              f"{os.cpu_count()} CPUs, torch threads {threads} per process "
              f"(shared machine: compare within this table; load average {os.getloadavg()[0]:.2f})")
        print(f"{'net':6} {'K':>2} {'mode':11} {'step ms':>9} {'speed-up':>9} {'CPU ms':>8} "
              f"{'peak MiB':>9}")
        for name in a.nets.split(","):
            for k in (int(x) for x in a.ks.split(",")):
                base = None
                runs: dict[str, list] = {m: [] for m in modes}
                for _ in range(a.repeat):       # the modes in turn, so load changes hit all
                    for mode in modes:
                        runs[mode].append(cell(a, mode, nets[name], k))
                for mode in modes:
                    r = None if None in runs[mode] else {
                        "step_ms": statistics.median(x["step_ms"] for x in runs[mode]),
                        "cpu_ms": statistics.median(x["cpu_ms"] for x in runs[mode]),
                        "peak": max(x["peak"] for x in runs[mode])}
                    if r is None:
                        print(f"{name:6} {k:2d} {mode:11} {'n/a':>9} {'n/a':>9} {'n/a':>8} {'n/a':>9}",
                              flush=True)
                        continue
                    if mode == "one-by-one":
                        base = r["step_ms"]
                    up = f"{base / r['step_ms']:.2f}x" if base else "-"
                    print(f"{name:6} {k:2d} {mode:11} {r['step_ms']:9.1f} {up:>9} {r['cpu_ms']:8.1f} "
                          f"{r['peak']:9.0f}", flush=True)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
