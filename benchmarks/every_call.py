"""Every call of every deploy net: what each call costs and whether call N equals call 1.

    python benchmarks/every_call.py [--batch 1] [--calls 25] [--size S] [--nets SUBSTR,...]
                                    [--list]

For every deploy net the project can reach (a prototxt with Input layers or input dims, not a
train_val or solver file: tests/data/caffe-models, tests/data/forks and ../shared/caffe-models,
whose copy wins where both have one; the nets only in ../shared are left out without it), one
at a time and freed after: a pycaffe ``Net`` as a user builds it, with the user's defaults (no
BREWNET_* switch: a set one is printed; brewnet's own thread choice). Weights: the real
caffemodel where ``WEIGHTS`` names one in the shared data, otherwise the fillers'
(``brewnet.set_random_seed(0)``) drawn to compute what a trained net would (``realistic``:
outputs of unit deviation, BatchNorm statistics of 4 random calibration images, or 1).
The input blob is reshaped to ``--batch`` at the prototxt's size (``--size S``: S x S), given
one fixed random input (an ``im_info`` input: the image's height, width, scale 1), and
``net.forward()`` is called ``--calls`` times. Call ``lean.AFTER + 1`` (11) is where a net that
can become one graph is recorded and run as one (brewnet/execution/lean.py).

Columns: "path" the one the net ended on (lean: the recorded graph; eager: layer by layer, with
the reason brewnet gave); "before ms" the median wall time of calls 2-10; "switch ms" call 11;
"after ms" the median of calls 12 to the last; "after/before"; "max rel dev" the largest
|call i - call 1| of any output over that output's largest |value| in call 1 ("0": every call
is call 1 bit for bit; tests/test_every_net_every_call.py holds it to LEAN_RTOL = 1e-5);
"steady bits" whether the calls on one path at one thread count all gave the same bits;
"equal bits" which of those groups (path@threads) gave the same bits as each other; "threads"
the torch thread counts brewnet's tuner ran calls 2-10 on → calls 12 on, in order of first use
(brewnet/execution/threads.py times forward-only calls and tries the other count from about call 9,
keeping the faster: the before and after times may be on different counts; a reduction split
over other threads also rounds differently); "RSS MiB" the process's resident memory after
call 10 → after the last (the recording at call 11 holds every tensor of its run until it ends,
and brewnet keeps freed memory for reuse: execution/process.py); "warn" the WARNING records the calls logged
(building the net is not a call). Wall times of one process on a shared machine: compare
within one run.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # the test's input and weights, drawn the same way
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
VENDORED = ROOT / "tests" / "data"

import brewnet  # noqa: E402
from brewnet.execution import lean  # noqa: E402
from brewnet.proto.io import read_net  # noqa: E402
from test_every_net_every_call import WEIGHTS, feed, realistic  # noqa: E402


def is_deploy(path: Path) -> bool:
    """A net whose inputs are Input layers or input dims (not a train/test or solver file)."""
    if "solver" in path.name or "train_val" in path.name:
        return False
    try:
        p = read_net(str(path))
    except Exception:        # a label map, a solver: not a NetParameter
        return False
    return bool(p.input) or any(lp.type == "Input" for lp in p.layer)


def deploy_nets() -> list[tuple[str, Path, Path | None]]:
    """(name, prototxt, caffemodel or None) of every deploy net, sorted by name."""
    found: dict[str, Path] = {}
    for root, prefix in ((VENDORED / "caffe-models", "caffe-models/"), (VENDORED / "forks", "forks/"),
                         (SHARED / "caffe-models", "caffe-models/")):     # shared last: it wins
        for p in sorted(root.rglob("*.prototxt")) if root.is_dir() else ():
            if is_deploy(p):
                found[prefix + p.relative_to(root).as_posix()] = p
    out = []
    for name, path in sorted(found.items()):
        w = WEIGHTS.get(name.removeprefix("caffe-models/"))
        w = SHARED / "caffe-models" / w if w else None
        out.append((name, path, w if w is not None and w.exists() else None))
    return out


def build(path: Path, weights: Path | None, batch: int, size: int = 0, seed: int = 0):
    """The pycaffe Net, its input blobs at ``batch`` (``size``: spatial size, 0 the prototxt's)
    holding one fixed random input. Calibration runs on 4 images, or on 1 where the net takes
    one image a batch (py-faster-rcnn's Proposal, the YOLO forks' detection outputs) or the
    image has 400 pixels a side or more (enough positions a channel)."""
    brewnet.set_random_seed(seed)
    net = brewnet.Net(str(path), brewnet.TEST, weights=str(weights) if weights else None)
    if weights is None:
        one = any(layer.type in ("Python", "Proposal", "YoloDetectionOutput", "Yolov3DetectionOutput")
                  for layer in net.layer_list)
        side = size or max(net.blobs[net.inputs[0]].data.shape[2:])
        realistic(net, size, 1 if one or side >= 400 else 4, seed)
    feed(net, batch, size, seed + 1)
    return net


class Records(logging.Handler):
    """The brewnet logger's records during the calls."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def run_calls(net, calls: int):
    """(seconds per call, outputs per call, (path, torch threads) of each call: path "lean"
    where the recorded graph ran the call, else "eager"; resident MiB after each call)."""
    import torch

    times, outs, modes, rss = [], [], [], []
    for _ in range(calls):
        t = time.perf_counter()
        got = net.forward()
        times.append(time.perf_counter() - t)
        outs.append({k: v.copy() for k, v in got.items()})
        modes.append(("lean" if net._lean.gm is not None else "eager", torch.get_num_threads()))
        rss.append(resident_mib())
    return times, outs, modes, rss


def resident_mib() -> float:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def same(a: dict, b: dict) -> bool:
    return all(a[k].shape == b[k].shape and np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def deviation(outs) -> float:
    """The largest |call i - call 1| over the output's largest |value| in call 1; 0.0: every call
    bit for bit call 1's; inf: a shape changed or a value is not finite where call 1's is."""
    worst = 0.0
    for o in outs[1:]:
        for k, ref in outs[0].items():
            got = o[k]
            if got.shape != ref.shape:
                return float("inf")
            if np.array_equal(got, ref, equal_nan=True):
                continue
            scale = float(np.abs(ref).max()) if ref.size else 0.0
            d = float(np.abs(got.astype(np.float64) - ref).max())
            worst = max(worst, d / scale if scale else float("inf"))
    return worst


def bit_groups(outs, modes) -> tuple[bool, str]:
    """(whether the calls of one (path, threads) all equal bit for bit, which groups give the
    same bits as each other: "lean@2=eager@2" etc.; groups that differ are left out)."""
    first: dict = {}
    steady = True
    for o, m in zip(outs, modes):
        if m in first:
            steady &= same(first[m], o)
        else:
            first[m] = o
    keys = list(first)
    eq = [f"{a[0]}@{a[1]}={b[0]}@{b[1]}" for i, a in enumerate(keys) for b in keys[i + 1:]
          if same(first[a], first[b])]
    return steady, " ".join(eq) or "-"


def path_of(net, records) -> str:
    """"lean", or "eager (why)": the reason brewnet gave for keeping the net layer by layer."""
    lf = net._lean
    if lf.gm is not None:
        return "lean"
    guard = getattr(lf, "guard", None)
    why = getattr(guard, "off", None)
    for r in records:                      # the logged reason (the first)
        msg = r.getMessage()
        if why is None and ("stays layer by layer" in msg or "stays off" in msg
                            or "eager path" in msg):
            why = msg.split("(no graph: ", 1)[-1].split("stays off: ", 1)[-1]
    if why is None and net._needs_backward:
        why = "the net needs a backward"
    return f"eager ({why.splitlines()[0][:160]})" if why else "eager"


def free() -> None:
    """Free the last net (it lives in reference cycles) and hand the heap brewnet keeps for
    reuse back (glibc), so each net starts from little."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--size", type=int, default=0, help="spatial input size (0: the prototxt's)")
    ap.add_argument("--nets", default="", help="comma-separated substrings of the nets' names")
    ap.add_argument("--list", action="store_true", help="list the nets and stop")
    args = ap.parse_args()
    if args.calls < lean.AFTER + 3:
        ap.error(f"--calls must be at least {lean.AFTER + 3} (past the switch at call {lean.AFTER + 1})")
    for k in sorted(os.environ):
        if k.startswith("BREWNET_") and k != "BREWNET_SHARED":
            print(f"note: {k}={os.environ[k]} is set (not the user defaults)")
    nets = deploy_nets()
    if args.nets:
        nets = [n for n in nets if any(s in n[0] for s in args.nets.split(","))]
    if args.list:
        for name, path, w in nets:
            print(name, w.name if w else "")
        return
    if not (SHARED / "caffe-models").is_dir():
        print(f"note: {SHARED / 'caffe-models'} is missing: the nets only there are left out")
    import torch

    print(f"batch {args.batch}, {args.calls} calls, switch at call {lean.AFTER + 1}, "
          f"torch {torch.__version__}, {os.cpu_count()} cores, load "
          f"{open('/proc/loadavg').read().split()[0]}\n")
    print("| net | input | weights | path | before ms (2-10) | switch ms (11) | "
          f"after ms (12-{args.calls}) | after/before | max rel dev | steady bits | equal bits "
          "| threads | RSS MiB | warn |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|---|---:|")
    log = logging.getLogger("brewnet")
    for name, path, weights in nets:
        handler = Records()
        log.addHandler(handler)
        old = log.level
        log.setLevel(logging.DEBUG)
        try:
            net = build(path, weights, args.batch, args.size)
            built = len(handler.records)       # warnings while building are not the calls'
            shape = "x".join(map(str, net.blobs[net.inputs[0]].data.shape))
            times, outs, modes, rss = run_calls(net, args.calls)
        except Exception as e:    # report it, go on with the next net
            print(f"| {name} | | | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]} "
                  "| | | | | | | | | | |", flush=True)
            net = outs = None
            free()
            continue
        finally:
            log.removeHandler(handler)
            log.setLevel(old)
        ms = [t * 1e3 for t in times]
        before, switch = statistics.median(ms[1:lean.AFTER]), ms[lean.AFTER]
        after = statistics.median(ms[lean.AFTER + 1:])
        dev = deviation(outs)
        warns = sum(r.levelno >= logging.WARNING for r in handler.records[built:])
        ths = " → ".join("/".join(str(t) for t in dict.fromkeys(m[1] for m in part))
                         for part in (modes[1:lean.AFTER], modes[lean.AFTER + 1:]))
        steady, equal = bit_groups(outs, modes)
        print(f"| {name} | {shape} | {'real' if weights else 'fillers'} | {path_of(net, handler.records)} "
              f"| {before:.2f} | {switch:.2f} | {after:.2f} | {after / before:.2f} "
              f"| {'0' if dev == 0 else f'{dev:.1e}'} | {'yes' if steady else 'NO'} | {equal} "
              f"| {ths} | {rss[lean.AFTER - 1]:.0f} → {rss[-1]:.0f} | {warns} |", flush=True)
        del net, outs
        free()


if __name__ == "__main__":
    main()
