"""torch.profiler's table of one corpus net's steady inference, as a pycaffe user runs it.

    python benchmarks/profile_net.py NAME [--batch 1] [--calls 50] [--brewnet DIR]

NAME is a net of benchmarks/zoo/corpus.py, built with zoo.py's weights and input. The Net is
called at the user's defaults until it is steady (past the lean graph's call and, with engines,
until auto has picked one), then ``--calls`` calls are profiled: the top ops by self CPU time,
the engine the net ended on, and the median ms per call. ``--brewnet DIR``: import brewnet from
another checkout (``git worktree add /tmp/before <commit>``) for a before/after pair.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--brewnet", help="a checkout whose brewnet is imported instead of this one")
    a = p.parse_args()
    if a.brewnet:
        sys.path.insert(0, str(Path(a.brewnet).resolve()))
    tests = str(Path(a.brewnet).resolve() / "tests" if a.brewnet else ROOT / "tests")
    sys.path.insert(1, str(ROOT / "benchmarks"))
    sys.path.append(str(ROOT))
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    import brewnet
    import zoo

    sys.path.insert(0, tests)       # (zoo put this checkout's tests first: the weights' helpers)

    entry = next(e for e in zoo.corpus().NETS if e["name"] == a.name)
    path, weights, xs, core = zoo.prepare(entry, a.batch, Path(tempfile.mkdtemp(prefix="profile-")))
    del core
    net = brewnet.pycaffe.Net(str(path), brewnet.TEST, weights=str(weights))
    for n, x in xs.items():
        net.blobs[n].reshape(*x.shape)
    net.reshape()
    zoo.warm_brewnet(net, xs) if hasattr(net._lean, "_picked") else [net.forward(**xs) for _ in range(15)]
    times = []
    for _ in range(a.calls):
        t0 = time.perf_counter()
        net.forward(**xs)
        times.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.calls):
            net.forward(**xs)
    engine = getattr(net._lean, "engine", None)
    print(f"{a.name} batch {a.batch}: brewnet from {Path(brewnet.__file__).parents[1]}, engine "
          f"{engine.name if engine is not None else ('eager (graph)' if net._lean.gm is not None else 'eager')}, "
          f"{statistics.median(times):.3f} ms per call (median of {a.calls}), torch threads {torch.get_num_threads()}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
