"""The step graph (brewnet/execution/recorded_step.py) against the eager step.

    python benchmarks/step_graph.py [--nets logreg,ip,lenet] [--rounds 3] [--update]

For each of small_nets.py's workloads (brewing-logreg batch 10 from HDF5; the single
InnerProduct on MNIST LMDB batch 100; LeNet batch 64), a pycaffe script process per mode
(``BREWNET_STEP_GRAPH=0`` eager, ``=1`` the recorded graph)
warms up, then times ``solver.step(n)`` three times; the modes' processes alternate for
``--rounds`` rounds and the median over rounds of each process's fastest call is printed, as
CPU and wall time per step (in one process side by side, the two solvers slowed each other
unevenly). "first s" is the warm-up call, which holds the capture (trace and check). Every
process trains the same number of iterations from the same seed: "bitwise" says whether its
final params equal the eager process's. ``--update`` adds a third mode, "graph+upd": the step
graph with the solver's recorded update (brewnet/execution/recorded_update.py) replayed on the CPU
too (``graph_update.ON_CPU``), the CPU measurement behind keeping the eager update there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import small_nets  # noqa: E402

STEPS = {"logreg": 1000, "ip": 200, "lenet": 10}
WARM = 250          # the warm-up call (it holds the capture)
LABEL = {"0": "eager", "1": "graph", "1u": "graph+upd"}


def worker(folder: str, name: str) -> None:
    import numpy as np

    import brewnet as caffe
    from brewnet.solvers import graph_update

    graph_update.ON_CPU = os.environ.get("STEP_GRAPH_UPDATE") == "1"
    s = caffe.get_solver(str(Path(folder) / f"{name}_script_solver.prototxt"))
    tic = time.perf_counter()
    s.step(WARM)
    first = time.perf_counter() - tic
    n, cpu, wall = STEPS[name], [], []
    for _ in range(3):
        c, w = time.process_time(), time.perf_counter()
        s.step(n)
        cpu.append((time.process_time() - c) / n)
        wall.append((time.perf_counter() - w) / n)
    mode = os.environ["BREWNET_STEP_GRAPH"] + ("u" if graph_update.ON_CPU else "")
    np.savez(Path(folder) / f"{name}_{mode}.npz", *[p.detach().numpy() for p in s.net.learnable])
    used = getattr(s, "_graph", None) is not None and s._graph.gm is not None
    if graph_update.ON_CPU:
        used = used and bool(s._graph.update) and s._graph.update.gm is not None
    print(json.dumps({"cpu": min(cpu), "wall": min(wall), "first": first, "used": used}))


def run(folder: Path, name: str, mode: str) -> dict:
    env = dict(small_nets.ENV, BREWNET_STEP_GRAPH=mode[0], STEP_GRAPH_UPDATE="1" if mode == "1u" else "0")
    out = subprocess.run([sys.executable, __file__, "--worker", name, "--folder", str(folder)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default="logreg,ip,lenet")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--update", action="store_true", help="add the recorded update on the CPU")
    ap.add_argument("--worker")
    ap.add_argument("--folder")
    a = ap.parse_args()
    if a.worker:
        return worker(a.folder, a.worker)
    import numpy as np

    modes = ["0", "1", "1u"] if a.update else ["0", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small_nets.write_workloads(folder)
        print(f"step graph vs eager: {len(modes)} modes alternating over {a.rounds} rounds, a "
              f"process each; load at start {small_nets.load()}")
        print(f"{'net':<8}{'mode':<10}{'CPU us/step':>12}{'wall us/step':>13}{'CPU vs eager':>13}"
              f"{'first s':>9}  bitwise")
        for name in a.nets.split(","):
            rows = {m: [] for m in modes}
            for _ in range(a.rounds):
                for m in modes:
                    rows[m].append(run(folder, name, m))
            base = np.load(folder / f"{name}_0.npz")
            eager_cpu = statistics.median(r["cpu"] for r in rows["0"])
            for m in modes:
                got = np.load(folder / f"{name}_{m}.npz")
                same = all(np.array_equal(base[k], got[k]) for k in base.files)
                cpu = statistics.median(r["cpu"] for r in rows[m])
                wall = statistics.median(r["wall"] for r in rows[m])
                first = statistics.median(r["first"] for r in rows[m])
                label = LABEL[m] + ("" if m == "0" or all(r["used"] for r in rows[m]) else "(off)")
                print(f"{name:<8}{label:<10}{cpu * 1e6:>12.0f}{wall * 1e6:>13.0f}"
                      f"{eager_cpu / cpu:>12.2f}x{first:>9.2f}  {same}", flush=True)
        print(f"load at end {small_nets.load()}")


if __name__ == "__main__":
    main()
