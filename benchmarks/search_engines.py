"""How ``brewnet search`` should train the K trials it asks at once: one table, one run.

    python benchmarks/search_engines.py [--k 4] [--iters 300] [--repeat 2] [--widths 500,500,500,500]

K LeNet trials (Caffe's LeNet and solver, batch 64, base_lr 0.005..0.04, momentum 0.9; ip1's
widths from ``--widths``: alike widths are what the search may fuse), trained each way:
  alone       one after another, each its own solver (what the search is measured against);
  together    ``Search(fuse=False)``: one ``TrainTogether`` group, worker threads;
  fused       ``Search(fuse=True)``: ``FusedSolvers`` in the exact form (each net's own kernels);
  wide        ``Search(fuse=True, exact=False)``: the wide form (grouped convolutions, batched
              products).
Each trial tests every ``--iters``/3 iterations on 1,000 images (no pruner). "wall s" and "CPU s"
are the median over ``--repeat`` rounds, the modes in turn within a round (the machine may be
shared: compare within one table); "vs alone" is alone's wall time over the mode's; "same bits"
says whether every trial's final caffemodel is byte-identical to its alone run. The data is
MNIST t10k from ``../shared`` (an LMDB in a temp folder), else random digits of its shapes.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
SOLVER = ('net: "{net}" test_iter: 10 test_interval: {ti} base_lr: 0.01 momentum: 0.9 '
          'weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75 display: 0 '
          'max_iter: {iters} snapshot: 0 solver_mode: CPU random_seed: 1701')
MODES = {"together": dict(fuse=False), "fused": dict(fuse=True), "wide": dict(fuse=True, exact=False)}


def lenet(work: Path) -> Path:
    """LeNet with its TRAIN and TEST data on the t10k LMDB (or random digits)."""
    from brewnet.proto.io import read_net, write_text
    from many_nets import LENET, prepare

    prepare(work)                                    # the LMDB
    net = read_net(str(LENET))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = str(work / "mnist_t10k_lmdb")
    write_text(work / "lenet.prototxt", net)
    return work / "lenet.prototxt"


def trials(k: int, widths: list[int]) -> list[dict]:
    lrs = [0.005 * (8 ** (i / max(k - 1, 1))) for i in range(k)]
    return [{"base_lr": lrs[i], "ip1.num_output": widths[i % len(widths)]} for i in range(k)]


def run_search(solver: Path, space: Path, values, out: Path, **kw) -> list[Path]:
    import shutil

    from brewnet.many.search import Search

    shutil.rmtree(out, ignore_errors=True)
    s = Search(str(solver), str(space), len(values), str(out), group=len(values), pruner="none",
               sampler="random", seed=1, **kw)
    for v in values:
        s.study.enqueue_trial(v)
    study = s.run()
    return [next((out / "trials" / str(t.number)).glob("*.caffemodel")) for t in study.trials]


def run_alone(solver: Path, space: Path, values, out: Path) -> list[Path]:
    from brewnet.many.space import Space
    from brewnet.solvers import get_solver

    sp = Space.load(str(space), str(solver))
    files = []
    for i, v in enumerate(values):
        p = sp.apply(v)
        p.snapshot_after_train, p.snapshot_prefix = True, str(out / f"t{i}" / "lenet")
        (out / f"t{i}").mkdir(parents=True, exist_ok=True)
        get_solver(p).solve()
        files.append(next((out / f"t{i}").glob("*.caffemodel")))
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--widths", default="500", help="ip1 widths, cycled over the K trials")
    ap.add_argument("--modes", default="alone,together,fused,wide")
    a = ap.parse_args()
    import torch

    import brewnet  # noqa: F401  (before torch: it sets OpenMP's wait policy, see brewnet/execution/threads.py)

    logging.getLogger("brewnet").setLevel(logging.WARNING)

    work = Path(tempfile.mkdtemp(prefix="search_engines_"))
    net = lenet(work)
    solver = work / "solver.prototxt"
    solver.write_text(SOLVER.format(net=net, ti=max(a.iters // 3, 1), iters=a.iters))
    space = work / "space.yaml"
    space.write_text("base_lr: {log_uniform: [0.001, 0.1]}\nip1.num_output: {int: [10, 1000]}\n")
    values = trials(a.k, [int(w) for w in a.widths.split(",")])
    modes = a.modes.split(",")
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    files: dict[str, list[Path]] = {}
    for r in range(a.repeat):
        for m in modes:
            out = work / f"{m}{r}"
            t0, c0 = time.perf_counter(), time.process_time()
            files[m] = (run_alone(solver, space, values, out) if m == "alone"
                        else run_search(solver, space, values, out, **MODES[m]))
            times[m].append((time.perf_counter() - t0, time.process_time() - c0))
    base = statistics.median(w for w, _ in times["alone"]) if "alone" in times else None
    print(f"search_engines: {a.k} LeNet trials, ip1 widths {a.widths}, {a.iters} iterations, "
          f"median of {a.repeat}; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':10} {'wall s':>8} {'CPU s':>8} {'vs alone':>9}  same bits")
    for m in modes:
        wall = statistics.median(w for w, _ in times[m])
        cpu = statistics.median(c for _, c in times[m])
        same = ("-" if m == "alone" or "alone" not in files else
                "yes" if all(x.read_bytes() == y.read_bytes() for x, y in zip(files[m], files["alone"]))
                else "no")
        ratio = f"{base / wall:.2f}x" if base else "-"
        print(f"{m:10} {wall:8.1f} {cpu:8.1f} {ratio:>9}  {same}")


if __name__ == "__main__":
    main()
