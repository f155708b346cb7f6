"""The prepared GPU run: everything brewnet's CUDA paths should prove, in at most 8 minutes.

    bash benchmarks/gpu.sh            # from the repository root (this script does the work)
    python benchmarks/gpu.py [--budget 480] [--parts parity,steps,inference,many,serve]

Parts, each in its own process under a time limit (a part that runs out is reported as such and
the run goes on):
  parity     ``BREWNET_TEST_DEVICE=cuda python -m pytest`` over the device parity modules
             (tests/conftest.py DEVICE_MODULES): passed / failed / skipped counts, the failures;
  steps      a training step, eager against the CUDA step graph (brewnet/execution/cuda_graph.py:
             forward, backward and the recorded update, brewnet/execution/recorded_update.py, as one
             captured graph): LeNet (batch 64), CIFAR10-quick (100), CaffeNet-like (256: CaffeNet
             without its Dropout layers, which a graph refuses) on a fixed synthetic host batch
             copied in each step; and 8 LeNets fused (brewnet/execution/recorded_fused_step.py: the fused step
             of all 8, updates included, as one captured graph) on random digits; ms per step
             (median) and whether the graph's params equal the eager run's bits;
  inference  open_nsfw's forward at batch 1 and 64, the plain path against lean inference
             captured as a CUDA graph (brewnet/execution/lean.py): ms per forward and the largest
             difference;
  many       ``benchmarks/many_nets.py --device cuda`` for K = 1, 2, 4, 8 LeNets (one-by-one, K
             processes, together, fused), eager; then one-by-one, together and fused again with
             ``BREWNET_STEP_GRAPH=1`` (each net's or the fused step's CUDA graph);
  serve      ``benchmarks/serve.py`` (``brewnet serve --gpu 0``) under load, LeNet and open_nsfw.
Then one summary. Without a CUDA GPU it prints one line saying so and exits 0.
The shared data (``BREWNET_SHARED``, default ../shared) is used where it is present; a machine
with only the checkout gets the vendored prototxts (tests/data/caffe-models), random weights
where the trained ones are missing (timings are the same; the rows say so) and many_nets.py's
random digits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
MODELS = SHARED / "caffe-models" if (SHARED / "caffe-models").is_dir() else ROOT / "tests/data/caffe-models"
BUDGET_S = 480
# part: (seconds it may take at most, what it shows)
PARTS = {
    "parity": (190, "the device parity tests"),
    "steps": (80, "training step: eager vs CUDA graph"),
    "inference": (35, "open_nsfw inference: plain vs lean CUDA graph"),
    "many": (115, "K LeNets on one GPU (many_nets.py --device cuda)"),   # 16 + 12 processes
    "serve": (35, "brewnet serve --gpu 0 under load"),
}
FUSED = {"LeNet x8 fused": 8}      # steps rows: K LeNets (many_nets.py's) as one fused net
TRAIN = {   # name: (solver, train_val, input (C, H, W), batch, steps timed)
    "LeNet": ("bvlc/examples/mnist/lenet_solver.prototxt",
              "bvlc/examples/mnist/lenet_train_test.prototxt", (1, 28, 28), 64, 100),
    "CIFAR10-quick": ("bvlc/examples/cifar10/cifar10_quick_solver.prototxt",
                      "bvlc/examples/cifar10/cifar10_quick_train_test.prototxt", (3, 32, 32), 100, 100),
    "CaffeNet-like": ("bvlc/models/bvlc_reference_caffenet/solver.prototxt",
                      "bvlc/models/bvlc_reference_caffenet/train_val.prototxt", (3, 227, 227), 256, 10),
}
NSFW = "trained/open_nsfw/deploy.prototxt", "trained/open_nsfw/resnet_50_1by2_nsfw.caffemodel"


def no_gpu() -> str | None:
    """Why this machine cannot do the run (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


# -- parts run in a child process -----------------------------------------------------------
def part_steps(device: str, nets: list[str]) -> list[dict]:
    import numpy as np
    import torch

    import brewnet
    import train
    from brewnet.proto import caffe_pb2 as pb

    train.MODELS = MODELS          # its nets from here (the shared data or the vendored copies)
    rows = []
    for name in nets:
        if name in FUSED:
            rows.append(fused_steps(device, name, FUSED[name]))
            continue
        solver_file, net_file, shape, batch, n = TRAIN[name]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        y = rng.integers(0, 10, batch).astype(np.float32)
        runs = {}
        for mode in ("0", "1"):
            os.environ["BREWNET_STEP_GRAPH"] = mode
            brewnet.set_random_seed(1)
            s = train.brewnet_solver(solver_file, net_file, shape, batch, device=device)
            if name == "CaffeNet-like":
                s = without(s, [lp.name for lp in s.net.param.layer if lp.type == "Dropout"], pb)
            s.train_feed = lambda i: {"data": x, "label": y}
            s.step(3)                             # warm-up; the graph captures here
            runs[mode] = (median_step_ms(s.step, device, n), [p.detach().clone() for p in s.net.learnable],
                          graph_kind(s))
        (e_ms, e_p, _), (g_ms, g_p, kind) = runs["0"], runs["1"]
        rows.append({"net": name, "batch": batch, "eager_ms": e_ms, "graph_ms": g_ms, "graph": kind,
                     "bitwise": all(torch.equal(a, b) for a, b in zip(e_p, g_p))})
    return rows


def median_step_ms(step, device: str, n: int) -> float:
    """The median of ``n`` timed ``step(1)`` calls, in ms (the device synchronised around each)."""
    sync(device)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(1)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def graph_kind(s) -> str:
    """What the solver's step ran as: the CUDA graph with or without the update in it, the CPU's
    recorded graph, or why none."""
    graph = getattr(s, "_graph", None)
    if graph is None or graph.gm is None:
        return getattr(s, "_graph_refused", (None, "not captured"))[1] or "not captured"
    if type(graph).__name__ != "CudaStepGraph":
        return "recorded graph" + (" + update" if graph.update else "")
    return "CUDA graph: fwd+bwd" + ("+update" if graph.whole else " (update eager)")


def fused_steps(device: str, name: str, k: int, n: int = 50) -> dict:
    """K LeNets fused (many_nets.py's nets, seeds and data), eager against the fused step graph."""
    import tempfile

    import torch

    import brewnet
    import many_nets
    from brewnet.many.fused import FusedSolvers

    work = Path(tempfile.mkdtemp())
    net = many_nets.prepare(work)["lenet"]
    runs = {}
    for mode in ("0", "1"):
        os.environ["BREWNET_STEP_GRAPH"] = mode
        brewnet.set_random_seed(1)
        fs = FusedSolvers(many_nets.solver_params(net, k, work), device=device)
        fs.step(5)                                # warm-up; the graph is recorded here
        ms = median_step_ms(fs.step, device, n)
        g = getattr(fs, "_graph", None)
        kind = ("not recorded" if g is None or g.gm is None
                else "CUDA graph: fused fwd+bwd+update" if g.captured is not None else "recorded graph")
        runs[mode] = (ms, [p.detach().clone() for p in fs.fused.params], kind)
    (e_ms, e_p, _), (g_ms, g_p, kind) = runs["0"], runs["1"]
    return {"net": name, "batch": 64, "eager_ms": e_ms, "graph_ms": g_ms, "graph": kind,
            "bitwise": all(torch.equal(a, b) for a, b in zip(e_p, g_p))}


def without(solver, names, pb):
    """The same solver rebuilt with the layers ``names`` taken out (in-place layers only)."""
    import brewnet
    from brewnet.solvers import SGDSolver

    param = pb.SolverParameter()
    param.CopyFrom(solver.param)
    keep = [lp for lp in param.net_param.layer if lp.name not in names]
    del param.net_param.layer[:]
    param.net_param.layer.extend(keep)
    brewnet.set_random_seed(1)
    return SGDSolver(param, device=solver.device)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def part_inference(device: str, batches: list[int]) -> list[dict]:
    import numpy as np

    import brewnet
    from brewnet import lean

    weights = MODELS / NSFW[1]
    rows = []
    for batch in batches:
        x = np.random.default_rng(1).standard_normal((batch, 3, 224, 224)).astype(np.float32)
        res = {}
        for mode in ("0", "1"):
            os.environ["BREWNET_LEAN"] = mode
            brewnet.set_random_seed(1)
            net = brewnet.Net(str(MODELS / NSFW[0]), brewnet.TEST, device=device,
                              weights=str(weights) if weights.exists() else None)
            for _ in range(lean.AFTER + 3):       # past the count; the capture happens here
                out = net.forward(data=x)["prob"].copy()
            times = []
            for _ in range(30 if batch == 1 else 10):
                t0 = time.perf_counter()
                net.forward(data=x)
                sync(device)
                times.append(time.perf_counter() - t0)
            lf = getattr(net, "_lean", None)
            res[mode] = (statistics.median(times) * 1e3, out,
                         lf is not None and (getattr(lf, "captured", None) or lf.gm) is not None)
        (p_ms, p_out, _), (l_ms, l_out, captured) = res["0"], res["1"]
        name = "open_nsfw" + ("" if weights.exists() else " (random weights)")
        rows.append({"net": name, "batch": batch, "eager_ms": p_ms, "graph_ms": l_ms,
                     "graph": ("CUDA graph" if device.startswith("cuda") else "lean graph") if captured
                     else "not captured",
                     "max_diff": float(np.abs(p_out - l_out).max())})
    return rows


# -- the driver -----------------------------------------------------------------------------
def run(cmd: list[str], limit: float, env=None) -> tuple[int | None, str, float]:
    """(exit code or None when it ran out of time, its output, seconds). The command runs in a
    session of its own, so running out of time ends its children too (pytest's workers, the
    server serve.py starts)."""
    import signal

    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=max(limit, 1))
        return proc.returncode, text, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return None, text, time.monotonic() - t0


def parity_counts(text: str) -> dict:
    """pytest's counts from its last line, or from the progress marks (a run cut off)."""
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if last:
        return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last[-1])}
    dots = "".join(ln.split(" [")[0] for ln in text.splitlines() if re.fullmatch(r"[.FEsxX]+( +\[ *\d+%\])?", ln))
    return {"passed": dots.count("."), "failed": dots.count("F"), "skipped": dots.count("s"),
            "errors": dots.count("E")}


def parity(limit: float) -> tuple[str, list[str]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import DEVICE_MODULES

    files = [f"tests/{m}" for m in DEVICE_MODULES if (ROOT / "tests" / m).exists()]
    xdist = ["-n", "8"] if subprocess.run([sys.executable, "-c", "import xdist"]).returncode == 0 else []
    rc, text, s = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *xdist, *files],
                      limit, {"BREWNET_TEST_DEVICE": "cuda"})
    counts = parity_counts(text)
    failures = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    head = ", ".join(f"{v} {k}" for k, v in counts.items()) + f" in {s:.0f} s"
    if rc is None:
        head += f" (cut off at {limit:.0f} s)"
    elif rc not in (0, 1):
        failures.append(text.strip().splitlines()[-1] if text.strip() else f"pytest exit {rc}")
    return head, failures[:30] or (text.strip().splitlines()[-15:] if rc not in (0, 1, None) else [])


def child(part: str, limit: float, a) -> tuple[str, list[str]]:
    rc, text, s = run([sys.executable, __file__, "--child", part, "--device", a.device, "--nets", a.nets,
                       "--batches", a.batches], limit)
    rows = [json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("ROWS ")]
    if rc != 0 or not rows:
        why = "cut off" if rc is None else f"exit {rc}"
        return f"failed ({why} after {s:.0f} s)", text.strip().splitlines()[-12:]
    lines = [f"{'net':16} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}  graph / check"]
    for r in rows[-1]:
        check = f"bitwise {r['bitwise']}" if "bitwise" in r else f"max diff {r['max_diff']:.2g}"
        lines.append(f"{r['net']:16} {r['batch']:5d} {r['eager_ms']:9.2f} {r['graph_ms']:9.2f} "
                     f"{r['eager_ms'] / r['graph_ms']:7.2f}x  {r['graph']}; {check}")
    return f"done in {s:.0f} s", lines


def tool(part: str, limit: float) -> tuple[str, list[str]]:
    py = sys.executable
    if part == "many":
        many = [py, "benchmarks/many_nets.py", "--device", "cuda", "--ks", "1,2,4,8", "--nets", "lenet",
                "--steps", "10", "--warmup", "5"]
        cmds = [(many, {}), ([*many, "--modes", "one-by-one,together,fused"],
                             {"BREWNET_STEP_GRAPH": "1"})]
    else:
        cmds = []
        for preset in ("lenet", "open_nsfw"):
            args, env = serve_model(preset)
            cmds.append(([py, "benchmarks/serve.py", preset, *args, "--gpu", "0", "--requests", "200",
                          "--concurrency", "1,32", "--body", "npy"], env))
    lines, t0, status = [], time.monotonic(), "done"
    for cmd, env in cmds:
        rc, text, s = run(cmd, limit - (time.monotonic() - t0), env)
        if env.get("BREWNET_STEP_GRAPH"):
            lines.append(f"with BREWNET_STEP_GRAPH={env['BREWNET_STEP_GRAPH']} (CUDA graphs):")
        lines += [ln for ln in text.splitlines() if ln.strip()][-14:]
        if rc != 0:
            status = "cut off" if rc is None else f"failed (exit {rc})"
            break
    return f"{status} in {time.monotonic() - t0:.0f} s", lines


def serve_model(preset: str) -> tuple[list[str], dict]:
    """(serve.py's extra arguments, its environment): its preset from the shared data, or, where
    that is absent, the vendored prototxt with random weights and a random picture for its
    request body, in a temporary folder (a serving run's timings depend on neither)."""
    import tempfile

    import numpy as np
    from PIL import Image

    import brewnet

    proto = {"lenet": "trained/lenet_mnist_ethereon/examples/mnist/lenet.prototxt",
             "open_nsfw": NSFW[0]}[preset]
    shared = SHARED / "caffe-models"
    if (shared / proto).exists() and (shared / "images" / "coffee.png").exists():
        return [], {}
    tmp = Path(tempfile.mkdtemp())
    weights = tmp / f"{preset}_random.caffemodel"
    brewnet.set_random_seed(1)
    brewnet.Net(str(MODELS / proto), brewnet.TEST, device="cpu").save(str(weights))
    (tmp / "caffe-models" / "images").mkdir(parents=True)
    pixels = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp / "caffe-models" / "images" / "coffee.png")
    print(f"serve {preset}: random weights and picture (no shared data here)")
    return ["--model", str(MODELS / proto), "--weights", str(weights)], {"BREWNET_SHARED": str(tmp)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0", help="steps and inference (cpu: check this script)")
    ap.add_argument("--nets", default=",".join([*TRAIN, *FUSED]), help="the step table's nets")
    ap.add_argument("--batches", default="1,64", help="open_nsfw's inference batches")
    a = ap.parse_args()
    if a.child:
        import logging

        import brewnet  # noqa: F401  (before torch: brewnet sets torch's thread policy on import)
        logging.getLogger("brewnet").setLevel(logging.WARNING)
        rows = (part_steps(a.device, a.nets.split(",")) if a.child == "steps"
                else part_inference(a.device, [int(b) for b in a.batches.split(",")]))
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    why = no_gpu() if a.device.startswith("cuda") else None
    if why:
        print(f"gpu.sh: no CUDA GPU on this machine ({why}); nothing run")
        return 0
    import torch

    start, summary = time.monotonic(), []
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"gpu.sh: {where}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"budget {a.budget:.0f} s", flush=True)
    for part in a.parts.split(","):
        left = a.budget - (time.monotonic() - start) - 5
        limit = min(PARTS[part][0], left)
        if limit < 10:
            summary.append((part, "not run (out of time)", []))
            continue
        print(f"\n== {part}: {PARTS[part][1]} (at most {limit:.0f} s)", flush=True)
        fn = parity if part == "parity" else child if part in ("steps", "inference") else tool
        head, lines = fn(limit) if fn is parity else fn(part, limit, a) if fn is child else fn(part, limit)
        print(head, *lines, sep="\n", flush=True)
        summary.append((part, head, lines))
    print(f"\n== summary ({time.monotonic() - start:.0f} s)")
    for part, head, lines in summary:
        print(f"{part:10} {head}")
        if part != "parity":
            print(*(f"{'':10} {ln}" for ln in lines), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
