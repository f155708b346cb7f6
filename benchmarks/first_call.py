"""The first forward of a deploy net in a fresh process, with the engine cache warm, against its
steady forward (issue 36's goal: within 2x).

    python benchmarks/first_call.py [--nets lenet,mtcnn_det3,squeezenet_v1_1,...] [--runs 2]

For each corpus net (benchmarks/zoo/corpus.py; weights drawn as zoo.py draws them, written to a
caffemodel once): a first process forwards the net until ``engine="auto"`` has picked its engine,
which the cache keeps (the state a user's second run starts in); then ``--runs`` fresh processes
each build ``caffe.Net(prototxt, caffemodel, caffe.TEST)``, reshape it to the benchmark's input
as a user would, and time every forward until 3 s of them: the first call, the worst of calls
2-11, and the steady median (the last 20). Columns: ms; "first/steady"; "engine" the one the
net ran on. Each process is alone on the machine (run it on a quiet one: the rows are
single calls).
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

ROOT = Path(__file__).resolve().parents[1]
NETS = "lenet,cifar10_quick,mtcnn_det2,mtcnn_det3,vanilla_landmarks,squeezenet_v1_1,mobilenet_v2,open_nsfw"


def child(name: str, folder: Path, warm: bool) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
    import numpy as np

    import brewnet
    from brewnet.pycaffe import Net

    if not (folder / "w.caffemodel").exists():
        import zoo

        entry = next(e for e in zoo.corpus().NETS if e["name"] == name)
        path, _, xs, _ = zoo.prepare(entry, 1, folder)
        (folder / "net.json").write_text(json.dumps({"path": str(path), "input": next(iter(xs))}))
        np.save(folder / "x.npy", next(iter(xs.values())))
    meta = json.loads((folder / "net.json").read_text())
    x = np.load(folder / "x.npy")
    t0 = time.perf_counter()
    net = Net(meta["path"], brewnet.TEST, weights=str(folder / "w.caffemodel"))
    build = time.perf_counter() - t0
    net.blobs[meta["input"]].reshape(*x.shape)
    net.reshape()
    ms = []
    while sum(ms) < 3e3 or len(ms) < 31 or (warm and not net._lean._picked and sum(ms) < 90e3):
        t0 = time.perf_counter()
        net.forward(**{meta["input"]: x})
        ms.append(1e3 * (time.perf_counter() - t0))
    engine = net._lean.engine.name if net._lean.engine is not None else "eager"
    return {"build": 1e3 * build, "first": ms[0], "early": max(ms[1:11]),
            "steady": statistics.median(ms[-20:]), "engine": engine}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nets", default=NETS)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("ROW " + json.dumps(child(a.child[0], Path(a.child[1]), a.child[2] == "warm")), flush=True)
        return

    def run(name, folder, mode):
        out = subprocess.run([sys.executable, __file__, "--child", name, str(folder), mode],
                             capture_output=True, text=True, timeout=600, env=dict(os.environ))
        rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
        if not rows:
            raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1:]}")
        return rows[0]

    print(f"{'net':20} {'Net() ms':>9} {'first':>9} {'2-11 max':>9} {'steady':>9} {'first/steady':>13}  engine")
    ratios = []
    for name in a.nets.split(","):
        with tempfile.TemporaryDirectory(prefix="first-call-") as d:
            try:
                run(name, Path(d), "warm")                  # the cache learns the engine
                rows = [run(name, Path(d), "fresh") for _ in range(a.runs)]
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"{name:20} failed: {e}")
                continue
        for r in rows:
            ratios.append(r["first"] / r["steady"])
            print(f"{name:20} {r['build']:9.1f} {r['first']:9.3f} {r['early']:9.3f} {r['steady']:9.3f} "
                  f"{r['first'] / r['steady']:12.2f}x  {r['engine']}")
    if ratios:
        print(f"first / steady over {len(ratios)} fresh processes: median {statistics.median(ratios):.2f}x, "
              f"worst {max(ratios):.2f}x, within 2x: {sum(r <= 2 for r in ratios)}")


if __name__ == "__main__":
    main()
