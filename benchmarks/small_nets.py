"""Small nets, fast and steady: per-step time of tiny training nets, alone and beside a busy
neighbour, in a pycaffe script and through the CLI (issue 14).

    python benchmarks/small_nets.py [--nets logreg,ip,lenet] [--conditions idle,spin,brewnet]
                                    [--paths pycaffe,cli,torch] [--calls N] [--compile-probe]
                                    [--wait-policy-probe]

Workloads (files written to a temporary folder):
- logreg: Caffe's brewing-logreg net (HDF5Data batch 10 -> InnerProduct 2 -> Accuracy,
  SoftmaxWithLoss) and its solver (SGD, step policy), 10,000 iterations, on a seeded numpy
  stand-in for the notebook's sklearn make_classification data (10,000 x 4, two informative
  features in two clusters per class; 7,500 rows for training).
- ip: one InnerProduct (784 -> 10) with SoftmaxWithLoss on MNIST t10k as an LMDB (made with
  brewnet's convert_mnist from ../shared's idx files), batch 100.
- lenet: Caffe's lenet_train_test TRAIN net on the same LMDB, batch 64.
Path ``torch`` is the floor: the same step written in bare PyTorch (``torch_step``: the batch
sliced from tensors already in memory, ``F.cross_entropy``, ``torch.autograd.grad``, the SGD
update with weight decay as four ``_foreach`` ops; the better of 1 and 2 threads), so the goals
can be read against what PyTorch itself does on this machine in the same run.
Path ``torch1st`` is the pycaffe script that imports torch before brewnet (libgomp's wait
policy is then fixed before brewnet can make it passive; see brewnet/execution/threads.py).
Conditions: idle; one spinning neighbour (``python -c 'while 1: pass'``); a second brewnet
process training the same net through the CLI. Paths: a fresh pycaffe script process
(``caffe.get_solver(...).step(n)``, timed around the call) and ``brewnet train`` (the rate from
its own display lines, so start-up is not counted). The machine is shared: the load average
is printed beside each row.
Column cpu(idle): the timed call's CPU time (script paths), which a busy machine inflates less
than the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
MNIST = SHARED / "caffe-models/trained/mnist_t10k/data/mnist"
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
# name: (timed steps in a script, CLI max_iter, CLI display, unit, goal, real Caffe (issue 14))
WORK = {"logreg": (10000, 10000, 1000, "s/10k it", 0.3, "pycaffe 0.027 s"),   # goal: issue 39
        "ip": (2000, 4000, 500, "us/step", 100.0, ""),
        "lenet": (100, 400, 50, "ms/step", 7.0, "CPU ~22 ms/step")}
SCALE = {"s/10k it": 1e4, "us/step": 1e6, "ms/step": 1e3}
CPU_TIMES: list = []     # the script paths' CPU seconds per step (the machine is shared)


def logreg_data(folder: Path) -> None:
    import h5py

    rng = np.random.default_rng(0)
    n = 10000
    y = rng.integers(0, 2, n)
    centres = rng.choice([-1.0, 1.0], size=(2, 2, 2))          # class, cluster, informative dim
    cluster = rng.integers(0, 2, n)
    x = rng.standard_normal((n, 4))
    x[:, :2] += 2 * centres[y, cluster]
    with h5py.File(folder / "train.h5", "w") as f:
        f["data"] = x[:7500].astype(np.float32)
        f["label"] = y[:7500].astype(np.float32)
    (folder / "train.txt").write_text(str(folder / "train.h5") + "\n")


def write_workloads(folder: Path) -> None:
    logreg_data(folder)
    (folder / "logreg.prototxt").write_text(f"""name: "LogReg"
layer {{ name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param {{ source: "{folder}/train.txt" batch_size: 10 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }}
""")
    from brewnet.data.convert import convert_mnist

    db = folder / "mnist_t10k_lmdb"
    convert_mnist(MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz", str(db),
                  progress=False)
    data = f"""layer {{ name: "mnist" type: "Data" top: "data" top: "label"
        transform_param {{ scale: 0.00390625 }}
        data_param {{ source: "{db}" batch_size: BATCH backend: LMDB }} }}
"""
    (folder / "ip.prototxt").write_text('name: "IP"\n' + data.replace("BATCH", "100") + """
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
""")
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import read_net, write_text

    lenet = read_net(str(ROOT / "examples/mnist/lenet_train_test.prototxt"))
    keep = [lp for lp in lenet.layer if not any(r.phase == pb.TEST for r in lp.include)]
    del lenet.layer[:]
    lenet.layer.extend(keep)
    lenet.layer[0].ClearField("include")
    lenet.layer[0].data_param.source = str(db)
    lenet.layer[0].data_param.batch_size = 64
    write_text(str(folder / "lenet.prototxt"), lenet)
    for name, (_, max_iter, display, *_rest) in WORK.items():
        policy = ('lr_policy: "step" gamma: 0.1 stepsize: 5000' if name == "logreg"
                  else 'lr_policy: "inv" gamma: 0.0001 power: 0.75')
        for kind, iters, disp in (("script", 10 ** 8, 0), ("cli", max_iter, display),
                                  ("forever", 10 ** 8, 1000)):
            (folder / f"{name}_{kind}_solver.prototxt").write_text(
                f'net: "{folder}/{name}.prototxt"\nbase_lr: 0.01 momentum: 0.9 weight_decay: 5e-4 '
                f'{policy}\nmax_iter: {iters} display: {disp} snapshot: 0 '
                'snapshot_after_train: false solver_mode: CPU random_seed: 1\n')


def worker(folder: Path, name: str) -> None:
    """A user's pycaffe script: build the solver, warm up, time ``solver.step(n)`` (the best
    of ``--calls`` successive calls, wall and CPU time each)."""
    sys.path.insert(0, str(ROOT))
    if os.environ.get("SMALL_NETS_TORCH_FIRST"):
        import torch  # noqa: F401  (the torch-first path: a script that imports torch first)
    import brewnet as caffe  # noqa: I001  (first, as in a user's script: OpenMP's wait policy)
    import torch

    solver = caffe.get_solver(str(folder / f"{name}_script_solver.prototxt"))
    steps = WORK[name][0]
    solver.step(max(20, steps // 20))
    dt = cpu = float("inf")
    for _ in range(int(os.environ.get("SMALL_NETS_CALLS", "1"))):
        t, c = time.perf_counter(), time.process_time()
        solver.step(steps)
        dt, cpu = min(dt, time.perf_counter() - t), min(cpu, time.process_time() - c)
    print(json.dumps({"per_step_s": dt / steps, "cpu_per_step_s": cpu / steps,
                      "threads": torch.get_num_threads()}))


def torch_step(name: str):
    """The net's training step in bare PyTorch, on random data held in memory: no data layer,
    no Caffe semantics beyond the update rule. One call is one iteration."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if name == "logreg":
        model, shape, classes, batch = nn.Linear(4, 2), (4,), 2, 10
    elif name == "ip":
        model, shape, classes, batch = nn.Linear(784, 10), (784,), 10, 100
    else:
        model = nn.Sequential(nn.Conv2d(1, 20, 5), nn.MaxPool2d(2), nn.Conv2d(20, 50, 5),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 500), nn.ReLU(),
                              nn.Linear(500, 10))
        shape, classes, batch = (1, 28, 28), 10, 64
    n = 100 * batch
    data, labels = torch.rand(n, *shape), torch.randint(0, classes, (n,))
    params = list(model.parameters())
    hist = [torch.zeros_like(p) for p in params]
    it = [0]

    def step():
        i = it[0] = (it[0] + batch) % n
        loss = F.cross_entropy(model(data[i:i + batch]), labels[i:i + batch])
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(grads, params, alpha=5e-4)
            torch._foreach_mul_(hist, 0.9)
            torch._foreach_add_(hist, grads, alpha=0.01)
            torch._foreach_sub_(params, hist)
        return loss
    return step


def torch_worker(name: str) -> None:
    import torch

    best = float("inf")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        step, steps = torch_step(name), WORK[name][0]
        for _ in range(max(20, steps // 20)):
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t) / steps)
    print(json.dumps({"per_step_s": best}))


def run_script(folder: Path, name: str, torch_first: bool = False, bare: bool = False) -> float:
    """The timed call's wall time per step (its CPU time per step is kept in CPU_TIMES)."""
    env = dict(ENV, SMALL_NETS_TORCH_FIRST="1") if torch_first else ENV
    args = ["--torch-worker", name] if bare else ["--worker", name, "--folder", str(folder)]
    out = subprocess.run([sys.executable, __file__, *args],
                         capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    CPU_TIMES.append(got.get("cpu_per_step_s", float("nan")))
    return got["per_step_s"]


def run_cli(folder: Path, name: str) -> float:
    out = subprocess.run([sys.executable, "-m", "brewnet.cli", "train", "--solver",
                          str(folder / f"{name}_cli_solver.prototxt")],
                         capture_output=True, text=True, env=ENV, check=True)
    rates = [float(r) for r in re.findall(r"Iteration \d+ \(([\d.e+-]+) iter/s", out.stderr)]
    rates = rates[1:] or rates                  # the first line comes before any iteration
    return 1.0 / statistics.median(rates)


class Neighbour:
    """A process sharing the cores: a spinning loop, or another brewnet training run."""

    def __init__(self, kind: str, folder: Path, name: str):
        self.proc = None
        if kind == "spin":
            self.proc = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
            time.sleep(0.5)
        elif kind == "brewnet":
            self.log = open(folder / "neighbour.log", "w+")
            self.proc = subprocess.Popen([sys.executable, "-m", "brewnet.cli", "train", "--solver",
                                          str(folder / f"{name}_forever_solver.prototxt")],
                                         stderr=self.log, stdout=subprocess.DEVNULL, env=ENV)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and "Starting Optimization" not in \
                    (folder / "neighbour.log").read_text():
                time.sleep(0.5)
            time.sleep(2)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def compile_probe() -> None:
    """What capturing a whole tiny step as one graph buys at best: the logreg step in plain torch
    (forward, backward, SGD update), eager vs torch.compile, one thread."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    w, b = torch.randn(2, 4), torch.zeros(2)
    hw, hb = torch.zeros_like(w), torch.zeros_like(b)
    grad = torch.func.grad_and_value(lambda w, b: F.cross_entropy(F.linear(x, w, b), y), argnums=(0, 1))

    def step(w, b, hw, hb):
        (gw, gb), loss = grad(w, b)
        hw.mul_(0.9).add_(gw + 5e-4 * w, alpha=0.01)
        hb.mul_(0.9).add_(gb + 5e-4 * b, alpha=0.01)
        w.sub_(hw)
        b.sub_(hb)
        return loss

    for label, fn in (("eager", step), ("torch.compile", torch.compile(step, fullgraph=True))):
        t = time.perf_counter()
        fn(w, b, hw, hb)
        first = time.perf_counter() - t
        for _ in range(200):
            fn(w, b, hw, hb)
        t = time.perf_counter()
        for _ in range(3000):
            fn(w, b, hw, hb)
        print(f"compile probe: {label:<14} first call {first:7.2f} s, then "
              f"{(time.perf_counter() - t) / 3000 * 1e6:7.1f} us/step", flush=True)


def wait_policy_probe(folder: Path) -> None:
    """LeNet's step with torch's threads fixed (BREWNET_THREADS): one thread, and two threads
    under libgomp's default wait (OMP_WAIT_POLICY set but empty), under PASSIVE alone and with a
    short spin before sleeping (GOMP_SPINCOUNT; ``import brewnet`` sets PASSIVE with 10000),
    idle and beside a spinning neighbour."""
    for cond in ("idle", "spin"):
        row = []
        for threads, policy, spin in (("1", "PASSIVE", ""), ("2", "", ""), ("2", "PASSIVE", ""),
                                      ("2", "PASSIVE", "2000"), ("2", "PASSIVE", "5000"), ("2", "PASSIVE", "10000")):
            n = Neighbour(cond, folder, "lenet")
            try:
                env = dict(ENV, BREWNET_THREADS=threads, OMP_WAIT_POLICY=policy, GOMP_SPINCOUNT=spin)
                if not spin:
                    del env["GOMP_SPINCOUNT"]
                out = subprocess.run([sys.executable, __file__, "--worker", "lenet", "--folder",
                                      str(folder)], capture_output=True, text=True, env=env, check=True)
                ms = json.loads(out.stdout.strip().splitlines()[-1])["per_step_s"] * 1e3
                row.append(f"{threads} thread(s) {policy or 'default'}{' spin ' + spin if spin else ''}: "
                           f"{ms:.1f} ms")
            finally:
                n.close()
        print(f"wait-policy probe, LeNet step, {cond} (load {load()}): " + "; ".join(row), flush=True)


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(WORK))
    ap.add_argument("--conditions", default="idle,spin,brewnet")
    ap.add_argument("--paths", default="pycaffe,cli,torch")
    ap.add_argument("--calls", type=int, default=1, help="timed step(n) calls a script makes (best)")
    ap.add_argument("--compile-probe", action="store_true")
    ap.add_argument("--wait-policy-probe", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--torch-worker", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ENV["SMALL_NETS_CALLS"] = str(args.calls)
    if args.worker:
        return worker(Path(args.folder), args.worker)
    if args.torch_worker:
        return torch_worker(args.torch_worker)
    if not (MNIST / "t10k-images-idx3-ubyte.gz").exists():
        sys.exit(f"needs MNIST's idx files in {MNIST}")
    sys.path.insert(0, str(ROOT))
    folder = Path(tempfile.mkdtemp(prefix="small_nets_"))
    write_workloads(folder)
    conditions = args.conditions.split(",")
    print(f"cores={os.cpu_count()} load(1 min)={load()}; times: median rate (CLI) or one timed "
          "step(n) call (script)", flush=True)
    if args.nets == "none":
        args.nets = ""
    head = "".join(f"{c:>12}" for c in conditions)
    print(f"{'net':<7} {'path':<8} {'unit':<9}{head} {'worst/idle':>10} {'goal':>6} {'cpu(idle)':>9}"
          "  load  real Caffe")
    for name in filter(None, args.nets.split(",")):
        steps, _, _, unit, goal, caffe = WORK[name]
        for path in args.paths.split(","):
            got, loads, cpu = {}, [], "-"
            for cond in conditions:
                CPU_TIMES.clear()
                n = Neighbour(cond, folder, name)
                try:
                    loads.append(load())
                    if path == "cli":
                        got[cond] = run_cli(folder, name)
                    else:
                        got[cond] = run_script(folder, name, torch_first=path == "torch1st",
                                               bare=path == "torch")
                        if cond == "idle" and CPU_TIMES:
                            cpu = f"{CPU_TIMES[-1] * SCALE[unit]:.4g}"
                finally:
                    n.close()
            vals = "".join(f"{got[c] * SCALE[unit]:>12.4g}" for c in conditions)
            worst = max(got.values()) / got["idle"] if "idle" in got else float("nan")
            print(f"{name:<7} {path:<8} {unit:<9}{vals} {worst:>10.2f} {goal:>6g} {cpu:>9}  "
                  f"{'/'.join(loads)}  {caffe}", flush=True)
    if args.wait_policy_probe:
        wait_policy_probe(folder)
    if args.compile_probe:
        compile_probe()


if __name__ == "__main__":
    main()
