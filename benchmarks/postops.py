"""The lean graph without vs with oneDNN post-op fusion (brewnet/execution/postops.py).

    python benchmarks/postops.py [--nets open_nsfw,mobilenet,caffenet] [--batches 1,16]
                                 [--repeats 15] [--threads 1] [--variants off,on,...]
                                 [--profile]

One pycaffe ``Net`` per variant, the same weights (open_nsfw's caffemodel; the others their
fillers drawn by the test's ``realistic``) and one input; each runs ``lean.AFTER + 1`` forwards
(the graph is built at call 11), then the variants' ``net.forward()`` calls are timed in turn
(interleaved: the machine's load hits each alike), ``--repeats`` rounds, the median kept. The
engine is held at ``eager`` (the lean graph itself). Variants: ``off`` (the pass not run),
``on`` (its defaults), ``unary`` / ``binary`` / ``lone`` (only that rewrite), ``noblock`` (NHWC
weights, not oneDNN's blocked ones), ``noinplace`` (the add into a fresh output), ``nolone``
(convolutions without a post-op left alone). "dev" is the largest |variant - first variant|
of an output over its largest |first variant|. ``--profile``: torch.profiler's top 10 ops
by self CPU time, open_nsfw at batch 16, off then on. Wall times on a shared machine: compare
within one run.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")

import torch  # noqa: E402

import brewnet  # noqa: E402
from brewnet.execution import lean, postops  # noqa: E402
from test_every_net_every_call import realistic  # noqa: E402

NETS = {
    "open_nsfw": (SHARED / "caffe-models/trained/open_nsfw/deploy.prototxt",
                  SHARED / "caffe-models/trained/open_nsfw/resnet_50_1by2_nsfw.caffemodel"),
    "mobilenet": (ROOT / "tests/data/caffe-models/mobilenet/mobilenet_deploy.prototxt", None),
    "mobilenet_v2": (ROOT / "tests/data/caffe-models/mobilenet/mobilenet_v2_deploy.prototxt", None),
    "caffenet": (SHARED / "caffe-models/bvlc/models/bvlc_reference_caffenet/deploy.prototxt", None),
}
VARIANTS = {"off": None, "on": {}, "unary": dict(binary=False, lone=False),
            "binary": dict(unary=False, lone=False), "lone": dict(unary=False, binary=False),
            "noblock": dict(blocked=False), "noinplace": dict(inplace=False),
            "nolone": dict(lone=False)}
_REAL = postops.fuse_postops


def patch(fn) -> None:
    """The pass lean.py runs (its module-level name, and the module's for a late import)."""
    postops.fuse_postops = fn
    if hasattr(lean, "fuse_postops"):
        lean.fuse_postops = fn


def build(name: str, batch: int, variant: str, like=None):
    """The net at ``batch`` on the lean graph built with ``variant``'s pass (weights copied
    from ``like``)."""
    proto, weights = NETS[name]
    kw = VARIANTS[variant]
    patch((lambda *a, **k: 0) if kw is None else functools.partial(_REAL, **kw))
    try:
        brewnet.set_random_seed(0)
        net = brewnet.Net(str(proto), brewnet.TEST, weights=str(weights) if weights else None)
        net.engine = "eager"
        feed = net.inputs[0]
        shape = list(net.blobs[feed].data.shape)
        if like is None and weights is None:
            realistic(net, 0, 2)
        elif like is not None:
            for layer, blobs in like.params.items():
                for b, src in zip(net.params[layer], blobs):
                    b.data[...] = src.data
        net.blobs[feed].reshape(batch, *shape[1:])
        net.reshape()
        x = np.random.default_rng(1).standard_normal([batch, *shape[1:]]).astype(np.float32)
        for _ in range(lean.AFTER + 1):
            out = net.forward(**{feed: x})
        assert net._lean.gm is not None, f"{name}: no lean graph"
    finally:
        patch(_REAL)
    return net, (lambda: net.forward(**{feed: x})), {k: v.copy() for k, v in out.items()}


def fused(gm) -> str:
    kinds = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("mkldnn._convolution_pointwise"):
            k = "add" if "binary" in str(n.target) else n.args[7]
            kinds[k] = kinds.get(k, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(kinds.items())) or "-"


def measure(name: str, batch: int, variants: list[str], repeats: int) -> list[str]:
    runs = {}
    like = None
    for v in variants:
        runs[v] = build(name, batch, v, like)
        like = like or runs[v][0]
    times = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            t = time.perf_counter()
            runs[v][1]()
            times[v].append(time.perf_counter() - t)
    ref = runs[variants[0]][2]
    rows = []
    base = statistics.median(times[variants[0]]) * 1e3
    for v in variants:
        ms = statistics.median(times[v]) * 1e3
        out = runs[v][2]
        dev = max(float(np.abs(out[k].astype(np.float64) - ref[k]).max() / np.abs(ref[k]).max())
                  for k in ref)
        rows.append(f"| {name} | {batch} | {v} | {ms:.2f} | {base / ms:.2f}x | {dev:.2g} | "
                    f"{fused(runs[v][0]._lean.gm)} |")
    return rows


def profile(variants=("off", "on")) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for v in variants:
        net, call, _ = build("open_nsfw", 16, v)
        for _ in range(3):
            call()
        with prof(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(5):
                call()
        print(f"\nopen_nsfw batch 16, {v} (5 calls):")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="open_nsfw,mobilenet,caffenet")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="off,on")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)      # a user's count: brewnet's tuner leaves it
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{a.threads} thread(s), median of {a.repeats} interleaved calls")
    print("| net | batch | variant | ms | speed-up vs first | dev | fused convs |")
    print("|---|---|---|---|---|---|---|")
    for name in a.nets.split(","):
        for batch in map(int, a.batches.split(",")):
            for row in measure(name, batch, a.variants.split(","), a.repeats):
                print(row, flush=True)
    if a.profile:
        profile()


if __name__ == "__main__":
    main()
