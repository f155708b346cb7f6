"""Data-parallel scaling: iterations/s and images/s of 1, 2, ... workers (brewnet.parallel).

    python benchmarks/scaling.py [--workers 1,2] [--nets LeNet,CIFAR10-quick,CaffeNet] [--steps N]
    python benchmarks/scaling.py --gpu all [--nets CaffeNet,GoogLeNet]

Weak scaling, as Caffe's multi-GPU training: every worker runs the net's benchmark batch (the
effective batch grows with the workers), with the real train prototxts (data layers swapped for
Input layers holding one fixed random batch, as benchmarks/train.py does), the gradient
allreduce in buckets overlapped with the backward pass. CPU workers (gloo) split the machine's
cores between them; ``--gpu`` runs one worker per device (NCCL). Each count runs in fresh
processes: warm-up steps, then ``--steps`` timed steps on rank 0 (medians of per-step times).
Efficiency = images/s of N workers / (N x images/s of one).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train import NETS, brewnet_solver  # noqa: E402

NETS = dict(NETS, GoogLeNet=("bvlc/models/bvlc_googlenet/solver.prototxt",
                             "bvlc/models/bvlc_googlenet/train_val.prototxt", (3, 224, 224), 32, "-"))
STEPS = {"LeNet": 40, "CIFAR10-quick": 20, "CaffeNet": 6, "GoogLeNet": 10}


def worker(rank, n, port, name, steps, gpus, threads, batch_override, out):
    import torch

    from brewnet.parallel import Replicas, World, join, leave

    torch.set_num_threads(threads)
    device = torch.device("cuda", gpus[rank]) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    solver_file, net_file, shape, batch, _ = NETS[name]
    batch = batch_override or batch
    solver = brewnet_solver(solver_file, net_file, shape, batch, device=device)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        solver.net.blobs["data"].tensor.copy_(torch.rand((batch, *shape), generator=g))
        solver.net.blobs["label"].tensor.copy_(torch.randint(0, 10, (batch,), generator=g).float())
    watch = None
    if n > 1:
        watch = join(World(rank, n, rank, "127.0.0.1", port, False), device, 120)
        replicas = Replicas(solver, rank, n, watch, overlap=True)
        replicas.sync_from_root()
        solver.add_callback(replicas.on_start, replicas.on_gradients)
    sync = torch.cuda.synchronize if gpus else (lambda: None)
    solver.step(2)                                   # warm-up: allocator, buckets, gloo pairs
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        solver.step(1)
        sync()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put((statistics.median(times), batch))
    leave(watch)


def run(name, n, steps, gpus, threads, batch=0):
    from brewnet.parallel.launch import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, n, port, name, steps, gpus[:n] if gpus else None,
                                              threads, batch, out)) for r in range(n)]
    for p in procs:
        p.start()
    step_s, batch = out.get(timeout=1800)
    for p in procs:
        p.join()
    return step_s, batch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="CPU worker counts, e.g. 1,2")
    ap.add_argument("--gpu", default="", help="'all' or ids: one worker per device, 1..N of them")
    ap.add_argument("--nets", default="LeNet,CIFAR10-quick,CaffeNet")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default: per net)")
    ap.add_argument("--batch", type=int, default=0, help="batch per worker (default: per net)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per CPU worker (default: the cores split between them)")
    args = ap.parse_args()
    import torch

    from brewnet.data.prefetch import usable_cores
    from brewnet.tools.common import parse_gpus

    gpus = parse_gpus(args.gpu)
    counts = list(range(1, len(gpus) + 1)) if gpus else [int(c) for c in args.workers.split(",")]
    cores = usable_cores()
    split = f"{args.threads} torch thread(s) per worker" if args.threads else \
        "torch threads split between the workers"
    where = (f"{len(gpus)} x {torch.cuda.get_device_name(gpus[0])}" if gpus
             else f"CPU, {cores} cores, {split}")
    print(f"# weak scaling, {where}; torch {torch.__version__}")
    print(f"{'net':14s} {'workers':>7s} {'batch/worker':>12s} {'ms/step':>9s} {'iter/s':>8s} "
          f"{'images/s':>9s} {'speed-up':>8s} {'efficiency':>10s}")
    for name in args.nets.split(","):
        base = None
        for n in counts:
            threads = 1 if gpus else (args.threads or max(1, cores // n))
            step_s, batch = run(name, n, args.steps or STEPS[name], gpus, threads, args.batch)
            ips = n * batch / step_s
            base = base or ips
            print(f"{name:14s} {n:7d} {batch:12d} {1e3 * step_s:9.1f} {1 / step_s:8.2f} {ips:9.1f} "
                  f"{ips / base:8.2f} {ips / base / n:10.2f}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("BREWNET_KEEP_MEMORY", "1")
    main()
