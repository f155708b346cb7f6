"""What a pycaffe forward costs around its engine, on nets whose call is under a millisecond.

    python benchmarks/call_overhead.py [--nets lenet,mtcnn_det2,mtcnn_det3,...] [--rounds 15]
                                       [--engines auto,openvino,opencv]

For each corpus net (benchmarks/zoo/corpus.py, weights drawn as zoo.py draws them) at batch 1
and each of ``--engines`` (default: auto), in one process: a pycaffe ``Net`` on that engine is
called until it runs on it (``auto``: until it has picked);
then, interleaved in blocks of ~50 ms, median of ``--rounds``: the engine alone on the input
(``engine.arrays``: what a user of that runtime pays, bar its own Python wrapper), brewnet's
``net.forward(data=x)`` (the direct steady call, ``LeanForward.direct``), and the same forward
with the direct call refused (the general path: what every call cost before it). Columns: ms
per call; "around": brewnet minus the engine alone, in microseconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
NETS = "lenet,cifar10_quick,mtcnn_det2,mtcnn_det3,vanilla_landmarks"


def one(name: str, rounds: int, engine: str = "auto") -> dict:
    import brewnet
    import zoo
    from brewnet.pycaffe import Net

    entry = next(e for e in zoo.corpus().NETS if e["name"] == name)
    with tempfile.TemporaryDirectory(prefix="call-overhead-") as d:
        path, weights, xs, _ = zoo.prepare(entry, 1, Path(d))
        net = Net(str(path), brewnet.TEST, weights=str(weights), engine=engine)
        for n, x in xs.items():
            net.blobs[n].reshape(*x.shape)
        net.reshape()
        zoo.warm_brewnet(net, xs)
    lean = net._lean
    if lean.engine is None or lean._direct is None:
        return {"name": name, "engine": lean.engine.name if lean.engine else "eager", "ms": {}}
    engine, arrays = lean.engine, lean._direct[3]

    def general():
        lean.direct = lambda inputs: None          # (an instance attribute: this net only)
        try:
            return net.forward(**xs)
        finally:
            del lean.direct

    runs = {"engine": lambda: engine.arrays(arrays), "brewnet": lambda: net.forward(**xs),
            "general": general}
    t0 = time.perf_counter()
    for _ in range(50):
        net.forward(**xs)
    n = max(20, int(0.05 / ((time.perf_counter() - t0) / 50)))
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            times[k].append(1e3 * (time.perf_counter() - t0) / n)
    return {"name": name, "engine": engine.name, "ms": {k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nets", default=NETS)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--engines", default="auto", help="engines to run each net on (default: auto)")
    a = p.parse_args()
    print(f"{'net':20} {'engine':>20} {'engine alone':>13} {'brewnet':>9} {'general':>9} {'around us':>10}")
    for name, engine in [(n, e) for n in a.nets.split(",") for e in a.engines.split(",")]:
        r = one(name, a.rounds, engine)
        ms = r["ms"]
        if not ms:
            print(f"{name:20} {r['engine']:>20}  (no direct call: not on an engine with numpy I/O)")
            continue
        print(f"{name:20} {r['engine']:>20} {ms['engine']:13.4f} {ms['brewnet']:9.4f} {ms['general']:9.4f} "
              f"{1e3 * (ms['brewnet'] - ms['engine']):10.1f}")


if __name__ == "__main__":
    main()
