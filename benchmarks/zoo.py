"""Inference over a corpus of published deploy nets: brewnet against the runtimes its users have.

    python benchmarks/zoo.py [--nets a,b] [--batches 1,16] [--reps 9] [--budget 4] [--compiled]
                             [--alone] [--json out.json] [--from out.json]

The corpus is benchmarks/zoo/corpus.py (each net's provenance: benchmarks/zoo/SOURCES.md, and
../shared/caffe-models/SOURCES.txt for the shared ones); the nets that benchmarks/load_all.py
found not running in brewnet (benchmarks/results/load_all.json; --load-all '' to try every net) are
skipped. Each (net, batch) runs in its own
process (memory is freed between nets; a crash costs one row). Weights: random, drawn to compute
what a trained net would (tests/test_every_net_every_call.py's ``realistic``), written to a
caffemodel so that every runtime runs the same weights on the same input. Runtimes, timed in
turn (the order rotated each round; in each round a runtime's ``BLOCK`` timed calls follow
untimed ones for ``SETTLE_S``, so that another runtime's spinning threads, ONNX Runtime's and
OpenCV's, have stopped) after their warm-up: "brewnet": a pycaffe Net
at the user's defaults (engine auto; warmed until it has picked its engine, which the engine
cache remembers from an earlier run: run the benchmark twice on a new machine); "eager" (and
"compiled" with --compiled): the engines by name; "opencv": OpenCV's dnn on
the prototxt and caffemodel; "ort": ONNX Runtime (its default session) on the file ``brewnet
export --fold`` writes (the one auto's engine cache holds, when auto built it); "openvino":
OpenVINO's CPU plugin (latency hint, float32) on that file, shown beside the peers: brewnet's
auto tries it where it is installed, so its column shows what brewnet's call adds around it.
Columns: median ms per call; "vs best peer": brewnet / min(opencv, ort); "engine" the one
brewnet ended on; "%peak": for nets over 1 GFLOP an image, brewnet's GFLOP/s over this
machine's fp32 matrix-multiply rate (torch.mm 2048^2, measured in the same run).
``--alone``: brewnet, OpenCV, ONNX Runtime and OpenVINO each timed in a process of its own (``ALONE_ROUNDS``
processes each, alternating), as a user's process runs one runtime; no "eager" column.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
PEERS = ("opencv", "ort")
OTHERS = ("openvino",)     # runtimes timed beside the peers, not in the ratio (see the docstring)
# After another runtime ran, a runtime's first calls are slow: two ONNX Runtime sessions in one
# process (brewnet's engine, the peer) slow each other's next ~40-60 ms of calls (SqueezeNet:
# 8 ms a call, 3.8 steady; AlexNet-like nets: 30 ms, then 16): the other pool's threads, the
# caches. So each runtime, each round, runs untimed for SETTLE calls and SETTLE_S seconds at
# least, then BLOCK timed calls: each is timed in the state a process running it alone is in.
SETTLE, SETTLE_S, BLOCK = 2, 0.1, 3
# --alone: each runtime in a process of its own, as a user's process runs one: no other pool's
# threads, and brewnet's thread tuner (brewnet/execution/threads.py) sees only its own calls (in
# one process it reacts to the slow calls after the other runtimes': MTCNN P-Net's graph kept one
# thread, 4.6 ms a call against 3.3 on two). ALONE_ROUNDS processes per runtime, alternating.
ALONE_ROUNDS = 2


def corpus():
    sys.path.insert(0, str(ROOT / "benchmarks" / "zoo"))
    import corpus as c

    return c


def mm_peak() -> float:
    """GFLOP/s of torch.mm on 2048 x 2048 fp32 (the better of torch's thread counts here)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = 0.0
    for _ in range(7):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * 2048 ** 3 / (time.perf_counter() - t0) / 1e9)
    return best


def net_flops(net) -> float:
    return float(sum(layer.flops([net.shapes[b] for b in bottoms], [net.shapes[t] for t in tops])
                     for layer, bottoms, tops in zip(net.layer_list, net.bottom_lists, net.top_lists)))


def prepare(entry, batch: int, folder: Path):
    """The calibrated pycaffe Net at ``batch`` with its input, and its caffemodel on disk."""
    import brewnet
    from test_every_net_every_call import feed, realistic

    c = corpus()
    path = c.resolve(entry, ROOT)
    brewnet.set_random_seed(0)
    net = brewnet.Net(str(path), brewnet.TEST)
    if entry.get("input_shape"):
        name = net.inputs[0]
        net.blobs[name].reshape(1, *entry["input_shape"])
        net.reshape()
    side = max(net.blobs[net.inputs[0]].data.shape[2:] or (1,))
    one = any(layer.type in ("Python", "Proposal", "YoloDetectionOutput", "Yolov3DetectionOutput")
              for layer in net.layer_list)          # layers that take one image a batch
    realistic(net, 0, 1 if one or side >= 400 else 4, 0)
    feed(net, batch, 0, 1)
    weights = folder / "w.caffemodel"
    net.save(str(weights))
    xs = {n: net.blobs[n].data.copy() for n in net.inputs}
    return path, weights, xs, net


def warm_brewnet(net, xs, cap_s: float = 90.0):
    """Call until the net has picked its engine and, where the cache's choice is measured again
    (engines.CONFIRMS), confirmed it (or ``cap_s``): the steady state a user reaches."""
    t_end = time.perf_counter() + cap_s
    while True:
        net.forward(**xs)
        lean = net._lean
        if ((lean._picked and lean.confirm is None or lean.guard.off) and lean.calls > 12
                or time.perf_counter() > t_end):
            return


def engine_of(net) -> str:
    lean = net._lean
    if lean.engine is not None:
        return lean.engine.name
    return "eager" if lean.gm is not None else "eager-plain"


def one(name: str, batch: int, reps: int, budget: float, compiled: bool, folder: Path,
        only: str | None = None) -> dict:
    # brewnet first, as a user's script should: torch's OpenMP threads then wait passively
    # instead of spinning beside the other runtimes (brewnet/execution/threads.py)
    brewnet = importlib.import_module("brewnet")
    import cv2
    import onnxruntime as ort
    import torch

    from brewnet.deploy import export_onnx, to_torch
    from brewnet.execution import engine_cache
    from brewnet.execution.runners import OPSET
    from brewnet.pycaffe import Net

    entry = next(e for e in corpus().NETS if e["name"] == name)
    path, weights, xs, core = prepare(entry, batch, folder)
    flops = net_flops(core) / batch
    cached_onnx = engine_cache.onnx_path(core, [x.shape for x in xs.values()], OPSET)
    row = {"name": name, "batch": batch, "category": entry.get("category", ""),
           "gflop": flops / 1e9, "ms": {}, "why": {}}
    runners = {}
    nets = {}
    for label, engine in [("brewnet", None), ("eager", "eager")] + (
            [("compiled", "compiled")] if compiled else []):
        net = Net(str(path), brewnet.TEST, weights=str(weights), engine=engine)
        for n, x in xs.items():
            net.blobs[n].reshape(*x.shape)
        net.reshape()
        nets[label] = net
        runners[label] = (lambda net=net: net.forward(**xs))
    del core
    try:
        cvn = cv2.dnn.readNetFromCaffe(str(path), str(weights))

        def cv_run():
            for n, x in xs.items():
                cvn.setInput(x, n)
            return cvn.forward()
        cv_run()
        runners["opencv"] = cv_run
    except cv2.error as e:
        row["why"]["opencv"] = str(e).strip().splitlines()[-1][:160]
    warm_brewnet(nets["brewnet"], xs)
    try:
        # the file ``brewnet export --fold`` writes; auto's engine cache holds it when auto
        # built its ONNX Runtime candidate (the same file: not exported twice)
        onnx_file = cached_onnx
        if not onnx_file.exists():
            onnx_file = folder / "net.onnx"
            export_onnx(to_torch(nets["eager"], fold=True, dynamic_batch=False), onnx_file)
        sess = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
        feed = {i.name: xs[i.name] for i in sess.get_inputs()}
        runners["ort"] = lambda: sess.run(None, feed)
        runners["ort"]()
    except Exception as e:  # noqa: BLE001 - a row says why a peer could not run the net
        row["why"]["ort"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    try:
        import openvino as ov

        model = ov.Core().compile_model(str(onnx_file), "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                                "INFERENCE_PRECISION_HINT": "f32"})
        request = model.create_infer_request()
        ov_feed = {n: xs[n] for port in model.inputs for n in port.get_names() if n in xs}
        runners["openvino"] = lambda: request.infer(ov_feed)
        runners["openvino"]()
    except Exception as e:  # noqa: BLE001 - a row says why it could not run the net
        row["why"]["openvino"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for label in ("eager", "compiled"):
        if label in nets:
            for _ in range(lean_after() + 2):
                nets[label].forward(**xs)
            if label != "eager" and nets[label]._lean.engine is None:
                row["why"][label] = "engine did not take the net"
                runners.pop(label)
    if only:                   # --alone: this process times one runtime (the others built idle)
        runners = {only: runners[only]} if only in runners else {}
        if not runners:                # (that runtime declined the net: the row says why)
            return dict(row, engine="-")
    times = {k: [] for k in runners}
    order = list(runners)
    t_end = time.perf_counter() + budget
    for r in range(reps):
        for k in order[r % len(order):] + order[:r % len(order)]:
            t_settle = time.perf_counter() + SETTLE_S
            for i in range(1000):     # untimed: see SETTLE
                runners[k]()
                if i + 1 >= SETTLE and time.perf_counter() > t_settle:
                    break
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                runners[k]()
                times[k].append(1e3 * (time.perf_counter() - t0))
        if r >= 2 and time.perf_counter() > t_end:
            break
    row["ms"] = {k: statistics.median(v) for k, v in times.items() if v}
    row["engine"] = engine_of(nets["brewnet"])
    row["threads"] = torch.get_num_threads()
    return row


def lean_after() -> int:
    from brewnet.execution import lean

    return lean.AFTER


def ratio(row) -> float | None:
    peers = [row["ms"][p] for p in PEERS if p in row["ms"]]
    return row["ms"]["brewnet"] / min(peers) if peers and "brewnet" in row["ms"] else None


def table(rows, peak: float) -> None:
    cols = ["brewnet", "eager", "compiled", "opencv", "ort", "openvino"]
    cols = [c for c in cols if any(c in r["ms"] for r in rows)]
    print(f"\nfp32 matrix-multiply peak (torch.mm 2048^2): {peak:.0f} GFLOP/s")
    head = f"{'net':24} {'b':>3} {'GFLOP':>7} " + " ".join(f"{c:>10}" for c in cols)
    print(head + f" {'vs best peer':>12} {'engine':>12} {'%peak':>6}")
    for r in rows:
        ms = " ".join(f"{r['ms'][c]:10.3f}" if c in r["ms"] else f"{'-':>10}" for c in cols)
        q = ratio(r)
        pk = ""
        if r["gflop"] > 1 and "brewnet" in r["ms"]:
            pk = f"{100 * r['gflop'] * r['batch'] / (r['ms']['brewnet'] / 1e3) / peak:5.0f}%"
        print(f"{r['name'][:24]:24} {r['batch']:3d} {r['gflop']:7.2f} {ms} "
              f"{(f'{q:.2f}x' if q else '-'):>12} {r.get('engine', '-'):>12} {pk:>6}")
    for b in sorted({r["batch"] for r in rows}):
        qs = sorted(q for r in rows if r["batch"] == b and (q := ratio(r)) is not None)
        if qs:
            p90 = qs[min(len(qs) - 1, int(0.9 * len(qs)))]
            print(f"batch {b}: brewnet / best peer over {len(qs)} nets: median {statistics.median(qs):.2f}x, "
                  f"p90 {p90:.2f}x, worst {qs[-1]:.2f}x, at or under 1.0x: {sum(q <= 1.0 for q in qs)}")
    for r in rows:
        for k, why in r.get("why", {}).items():
            print(f"  {r['name']} b{r['batch']}: {k}: {why}")


def not_running(path: str) -> dict:
    """{net: why} for the nets that ``path`` (benchmarks/load_all.py's json) found not running in
    brewnet: the corpus also holds nets that do not build (benchmarks/zoo/corpus.py)."""
    p = Path(path) if path else None
    if not p or not p.is_file():
        return {}
    return {r["name"]: r["brewnet"] for r in json.loads(p.read_text())["rows"] if r["brewnet"] != "ok"}


def run_one(cmd) -> tuple[str | None, str | None]:
    """The ROW line of one ``--one`` process, or why there is none."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                             env=dict(os.environ, PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired:
        return None, "timed out (900 s)"
    line = next((x for x in res.stdout.splitlines() if x.startswith("ROW ")), None)
    return line, None if line else (res.stderr.strip().splitlines() or ["no output"])[-1][:200]


def merged(rows: list) -> dict:
    """One row from the processes of one (net, batch): each runtime's median over its processes
    (``--alone``), the engine and reasons from the brewnet process."""
    out = dict(rows[0], ms={}, why={})
    for r in rows:
        out["why"].update(r["why"])
        if "brewnet" in r["ms"]:
            out["engine"] = r["engine"]
    for k in {k for r in rows for k in r["ms"]}:
        out["ms"][k] = statistics.median(r["ms"][k] for r in rows if k in r["ms"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nets", default="", help="names, separated by ',' (default: all)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--budget", type=float, default=4.0, help="seconds of timing per row at most")
    p.add_argument("--compiled", action="store_true", help="also time engine='compiled'")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--load-all", default=str(ROOT / "benchmarks" / "results" / "load_all.json"),
                   help="skip the nets this benchmarks/load_all.py run found not running in brewnet")
    p.add_argument("--from", dest="from_", help="print the table of an earlier --json")
    p.add_argument("--alone", action="store_true",
                   help="each runtime timed in a process of its own (as a user's process runs one)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--only", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        with tempfile.TemporaryDirectory(prefix="zoo-") as folder:   # caffemodels of up to 0.5 GB
            row = one(a.one, a.batch, a.reps, a.budget, a.compiled, Path(folder), a.only)
        print("ROW " + json.dumps(row), flush=True)
        return
    if a.from_:
        data = json.loads(Path(a.from_).read_text())
        table(data["rows"], data["peak"])
        return
    c = corpus()
    want = [s for s in a.nets.split(",") if s]
    entries = [e for e in c.NETS if c.available(e, ROOT) and (not want or e["name"] in want)]
    failing = not_running(a.load_all)
    for e in [e for e in entries if e["name"] in failing]:
        print(f"{e['name']}: skipped (benchmarks/load_all.py: {failing[e['name']]})", flush=True)
    entries = [e for e in entries if e["name"] not in failing]
    peak = mm_peak()
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:      # every net at one batch, then the next
        for e in entries:
            cmd = [sys.executable, __file__, "--one", e["name"], "--batch", str(b), "--reps", str(a.reps),
                   "--budget", str(a.budget)] + (["--compiled"] if a.compiled else [])
            t0 = time.perf_counter()
            alone = ("brewnet",) + PEERS + OTHERS
            parts = [[]] if not a.alone else [["--only", k] for k in alone] * ALONE_ROUNDS
            got = []
            for i, extra in enumerate(parts):
                if a.alone and i // len(alone) % 2:    # every other round reversed
                    extra = parts[len(parts) - 1 - i]
                line, why = run_one(cmd + extra)
                if not line:
                    break
                got.append(json.loads(line[4:]))
            if line:
                rows.append(merged(got))
                r = rows[-1]
                print(f"{e['name']} b{b}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["ms"].items())
                      + f" ms [{r['engine']}] ({time.perf_counter() - t0:.0f} s)", flush=True)
            else:
                print(f"{e['name']} b{b}: FAILED: {why}", flush=True)
            if a.json:         # after each row: an interrupted run keeps what it measured
                Path(a.json).write_text(json.dumps({"peak": peak, "rows": rows}, indent=1))
    table(rows, peak)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
