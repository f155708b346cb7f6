"""Keyframe feature reuse on real videos (``brewnet.video``): speed and agreement with per-frame
inference, for fixed and adaptive keyframes, copy and flow propagation.

    python benchmarks/video.py --videos DIR [--frames 0] [--width 320] [--plot video.png]
                               [--json rows.json]     (then --rows rows.json: tables and plot again)

DIR holds vtest.avi, Megamind.avi and tree.avi from Debian's opencv-doc package:
``apt-get download opencv-doc && dpkg -x opencv-doc_*.deb X`` and DIR is
``X/usr/share/doc/opencv-doc/examples/data``. The nets come from the shared data
(``$BREWNET_SHARED``, default ../shared next to the checkout), both trained and made fully
convolutional (``brewnet.fully_convolutional``):

- open_nsfw (ResNet-50 1by2, 2 classes, a 2 x 4 map at 320 x 240), split after res2
  (``eltwise_stage0_block2``, stride 4): conv1 + res2 are 28% of its FLOPs (``Layer.flops``);
- CIFAR-10 "full" (10 classes, 32 x 32 windows at stride 8: a 27 x 37 map), split after
  ``norm1`` (conv1, pool1, LRN: 20% of its FLOPs at 320 x 240).

The adaptive measure (``brewnet.video``'s notes) is the net's input blob, the transformed
frame, averaged over cells of the output's stride (8 for CIFAR-10, 32 for open_nsfw): with the
split blob as the measure the low part ran on every frame and adaptive keyframes reached only
1.0-1.6x (``examples/video/README.md``, the earlier run); the input costs no layer, so
adaptive keyframes cost what fixed ones do at the same keyframe share. On a pilot of 60 frames
a video (CIFAR-10, copy, thresholds calibrated as below), the input at full resolution gave
89.1% / 92.7% argmax agreement at 20% / 33% keyframes (vtest got only the max-gap keyframes,
tree 47-77%), conv1 89.1% / 92.3%, norm1 (the split) 90.1% / 92.9%, the input at stride 8
90.6% / 93.6%; every:5 / every:3 gave 90.3% / 93.2%.

The two adaptive thresholds are calibrated, per net, to keyframe shares (``--shares``, 20% as
every:5 and 33% as every:3: equal speed when the measure is free) on the measure alone over the
first ``--calibration`` frames of each video: the policy's rule is replayed for a threshold
found by bisection; no output or agreement is looked at. One threshold for all videos, so
that a moving camera (tree) gets more keyframes than a static one (vtest).

Each video's frames (all by default) are decoded once and resized to ``--width`` (height
from the aspect ratio; decoding is not timed). Per video and net: ``every:1`` (per frame, the
reference), ``every:3``, ``every:5``, ``every:10`` and ``adaptive`` at the two thresholds (max
gap 20), each with copy and flow, all interleaved frame by frame with each step timed (on the
shared machine the load drifts; run one after the other, the policies saw loads several times
apart), on ``--threads`` torch threads (1: a team of two on the shared 2-core machine stalled
at every barrier while a neighbour held a core). Columns: frames/s, speed-up over every:1, the
same ratio of process CPU time, keyframe share, mean |output - per-frame output| (softmax
probabilities), and the share of (frame, position) pairs whose argmax class agrees with
per-frame inference. Prints a table per net and the pooled numbers over the videos (speed:
total frames over total time; agreement: frame-weighted), with the fixed-interval curve's
agreement at each adaptive point's speed (linear between the fixed points); saves a plot of
speed-up vs agreement and vs mean |diff|.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import brewnet  # noqa: E402
from brewnet.net import Net  # noqa: E402
from brewnet.video import Adaptive, VideoNet, change, pool_measure, read_frames  # noqa: E402

SHARED = Path(os.environ.get("BREWNET_SHARED") or Path(__file__).resolve().parents[2] / "shared")
T = SHARED / "caffe-models/trained"
C10 = T / "everpeace_caffe_2014_v1format/examples/cifar10"
NETS = {   # prototxt, weights, split, adaptive measure blob and stride (see the notes), mean (BGR)
    "open_nsfw": (T / "open_nsfw/deploy.prototxt", T / "open_nsfw/resnet_50_1by2_nsfw.caffemodel",
                  "eltwise_stage0_block2", "data", 32, (104, 117, 123)),
    # CIFAR-10's mean is ~114-125 per channel; the net was trained on RGB and gets BGR here:
    # only agreement with its own per-frame outputs is measured, not accuracy.
    "cifar10_full": (C10 / "cifar10_full.prototxt", C10 / "cifar10_full_iter_70000.caffemodel",
                     "norm1", "data", 8, (120,)),
}
VIDEOS = ("vtest.avi", "Megamind.avi", "tree.avi")
FIXED = ("every:1", "every:3", "every:5", "every:10")


def policies(thresholds):
    out = [("every:1", "copy")]
    for spec in FIXED[1:] + tuple(f"adaptive:{t:.4g}" for t in thresholds):
        out += [(spec, "copy"), (spec, "flow")]
    return out


def run(vns, frames):
    """All ``vns`` over ``frames`` interleaved frame by frame, each step timed (wall and process
    CPU time): on a shared machine whose load drifts, every policy sees the same load. Per
    vn: ((seconds, CPU seconds), outputs (frames, ...), keyframe flags). They may share a net:
    a step sets its input and runs all it needs before the next vn's step."""
    gens = [vn.run(frames) for vn in vns]
    took = np.zeros((len(vns), 2))
    outs, keys = [[] for _ in vns], [[] for _ in vns]
    for _ in frames:
        for i, g in enumerate(gens):
            start, cpu = time.perf_counter(), time.process_time()
            o = next(g)
            took[i] += time.perf_counter() - start, time.process_time() - cpu
            outs[i].append(o.outputs["prob"][0].cpu().numpy())
            keys[i].append(o.is_keyframe)
    return [(tuple(t), np.stack(o), np.asarray(k)) for t, o, k in zip(took, outs, keys)]


def calibrate(clips, split, measure, stride, mean, max_gap, shares):
    """The adaptive thresholds whose keyframe share on ``clips`` ((net, frames) pairs) is each
    of ``shares``, by bisection on the measure alone (``brewnet.video.change`` and the policy's
    rule, as ``VideoNet.run`` applies them): no output, no agreement is looked at."""
    lows = []
    with torch.no_grad():
        for net, clip in clips:
            vn = VideoNet(net, split, keyframes="adaptive:0", mean=mean, measure=measure)
            lows.append([])
            for f in clip:
                x = net.blobs[vn.input].tensor = vn.prepare(f)[0]
                if vn.m is not None:
                    net.forward_tensors(0, vn.m)
                low = x if vn.m is None else net.blobs[measure].tensor
                lows[-1].append(pool_measure(low, stride).clone())

    def share(t):
        policy, keys = Adaptive(t, max_gap), 0
        for clip in lows:
            key, gap = clip[0], 0
            for low in clip[1:]:
                gap += 1
                if policy.is_key(gap, change(low, key)):
                    key, gap, keys = low, 0, keys + 1
        return (keys + len(lows)) / sum(map(len, lows))

    out = []
    for target in shares:
        lo, hi = 0.0, 1.0
        while share(hi) > target:
            hi *= 2
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share(mid) > target else (lo, mid)
        out.append(hi)
        print(f"# {clips[0][0].name}: adaptive threshold {hi:.4g} for a {target:.0%} keyframe "
              f"share on the calibration frames (measured {share(hi):.1%})", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--videos", help="folder with vtest.avi, Megamind.avi, tree.avi")
    ap.add_argument("--frames", type=int, default=0, help="first N frames of each video (0: all)")
    ap.add_argument("--width", type=int, default=320, help="frames resized to this width")
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--max-gap", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every run (one: on a shared machine a team of two "
                         "stalls at every barrier whenever a neighbour holds a core)")
    ap.add_argument("--calibration", type=int, default=100,
                    help="adaptive thresholds from the measure on each video's first N frames")
    ap.add_argument("--shares", default="0.2,0.33",
                    help="the keyframe shares the two thresholds are calibrated to")
    ap.add_argument("--plot", default="video_benchmark.png")
    ap.add_argument("--json", default="", help="also save the rows here (for --rows)")
    ap.add_argument("--rows", default="", help="only the tables and plot of saved --json rows")
    args = ap.parse_args(argv)
    if args.rows:
        rows = json.loads(Path(args.rows).read_text())
        table(rows)
        plot(rows, args.plot)
        return 0
    if not args.videos:
        ap.error("--videos is required (unless --rows)")
    import cv2

    torch.set_num_threads(args.threads)
    print(f"# {'all' if not args.frames else f'the first {args.frames}'} frames of each video at "
          f"width {args.width}, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    videos = {}
    for video in VIDEOS:
        frames = list(read_frames(Path(args.videos) / video, args.frames or None))
        h = round(frames[0].shape[0] * args.width / frames[0].shape[1])
        videos[video] = [cv2.resize(f, (args.width, h), interpolation=cv2.INTER_AREA) for f in frames]
        print(f"# {video}: {len(frames)} frames, {frames[0].shape[1]} x {frames[0].shape[0]} "
              f"-> {args.width} x {h}", flush=True)
    rows = []
    for net_name in args.nets.split(","):
        proto, weights, split, measure, stride, mean = NETS[net_name]
        original = Net(proto, weights=weights)
        nets = {v: brewnet.fully_convolutional(original, f[0].shape[:2]) for v, f in videos.items()}
        thresholds = calibrate([(nets[v], f[: args.calibration]) for v, f in videos.items()],
                               split, measure, stride, mean, args.max_gap,
                               [float(v) for v in args.shares.split(",")])
        for video, frames in videos.items():
            net = nets[video]
            run([VideoNet(net, None, mean=mean)], frames[:3])        # warm-up, not timed
            specs = policies(thresholds)
            vns = [VideoNet(net, split, prop, spec, args.max_gap, mean=mean, measure=measure,
                            measure_stride=stride) for spec, prop in specs]
            results = run(vns, frames)
            ref, first = results[0][1], len(rows)
            for (spec, prop), (s, out, keys) in zip(specs, results):
                rows.append(dict(net=net_name, video=video, policy=spec, propagate=prop,
                                 frames=len(frames), fps=len(frames) / s[0], cpu=s[1],
                                 keys=float(keys.mean()), mad=float(np.abs(out - ref).mean()),
                                 agree=float((out.argmax(1) == ref.argmax(1)).mean()),
                                 positions=int(np.prod(ref.shape[2:]))))
            base, base_cpu = len(frames) / rows[first]["fps"], rows[first]["cpu"]
            for r in rows[first:]:
                r["speedup"] = base / (len(frames) / r["fps"])
                r["cpu_speedup"] = base_cpu / r["cpu"]
                print(f"{net_name:12s} {video:12s} {r['policy']:16s} {r['propagate']:4s} "
                      f"{r['fps']:6.2f} fps x{r['speedup']:4.2f} (CPU time x{r['cpu_speedup']:4.2f}) "
                      f"keys {r['keys']:.2f} |d| {r['mad']:.2e} agree {r['agree']:.3f} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, default=float, indent=0))
    table(rows)
    plot(rows, args.plot)
    return 0


def pooled(rows, net):
    """Per policy over the videos: total frames / total time, frame-weighted agreement."""
    out = {}
    for r in rows:
        if r["net"] == net:
            out.setdefault((r["policy"], r["propagate"]), []).append(r)
    res = []
    for (spec, prop), rs in out.items():
        n = sum(r["frames"] for r in rs)
        base = [b for b in rows if b["net"] == net and b["policy"] == "every:1"]
        t_base = sum(b["frames"] / b["fps"] for b in base)
        t = sum(r["frames"] / r["fps"] for r in rs)
        cpu = sum(b["cpu"] for b in base) / sum(r["cpu"] for r in rs)
        res.append(dict(policy=spec, propagate=prop, fps=n / t, speedup=t_base / t, cpu_speedup=cpu,
                        keys=sum(r["keys"] * r["frames"] for r in rs) / n,
                        mad=sum(r["mad"] * r["frames"] for r in rs) / n,
                        agree=sum(r["agree"] * r["frames"] for r in rs) / n))
    return res


def table(rows) -> None:
    for net in dict.fromkeys(r["net"] for r in rows):
        print(f"\n## {net}: per video")
        print("| video | policy | propagate | frames/s | speed-up | CPU-time speed-up | keyframes | "
              "mean abs diff | argmax agree |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if r["net"] == net:
                print(f"| {r['video']} | {r['policy']} | {r['propagate']} | {r['fps']:.2f} | "
                      f"{r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | {r['keys']:.0%} | {r['mad']:.2e} | "
                      f"{r['agree']:.1%} |")
        print(f"\n## {net}: the three videos pooled (time-weighted speed, frame-weighted agreement)")
        print("| policy | propagate | frames/s | speed-up | CPU-time speed-up | keyframes | "
              "mean abs diff | argmax agree | fixed at equal speed (wall / CPU) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        res = pooled(rows, net)
        for r in res:
            eq = ""
            if r["policy"].startswith("adaptive"):
                eq = " / ".join(f"{a:.1%}" if a is not None else "-" for a in
                                (fixed_at(res, r["propagate"], r[k], k) for k in ("speedup", "cpu_speedup")))
            print(f"| {r['policy']} | {r['propagate']} | {r['fps']:.2f} | {r['speedup']:.2f}x | "
                  f"{r['cpu_speedup']:.2f}x | {r['keys']:.0%} | {r['mad']:.2e} | {r['agree']:.1%} | {eq} |")


def fixed_at(res, prop, speed, key="speedup"):
    """The fixed-interval curve's agreement at ``speed`` (linear between its points, the same
    propagation; None outside it): what an adaptive point at that speed must beat."""
    pts = sorted((r[key], r["agree"]) for r in res if r["policy"].startswith("every") and
                 (r["propagate"] == prop or r["policy"] == "every:1"))
    for (s0, a0), (s1, a1) in zip(pts, pts[1:]):
        if s0 <= speed <= s1:
            return a0 + (a1 - a0) * (speed - s0) / (s1 - s0) if s1 > s0 else max(a0, a1)
    return None


def plot(rows, path) -> None:
    """Per net, pooled over the videos: speed-up vs argmax agreement (top) and vs mean |diff|
    (bottom, log scale; the informative one where the argmax barely moves, as open_nsfw's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = list(dict.fromkeys(r["net"] for r in rows))
    fig, axes = plt.subplots(2, len(nets), figsize=(6 * len(nets), 8.5), squeeze=False)
    fixed_names = "/".join(p.split(":")[1] for p in FIXED)
    for col, net in enumerate(nets):
        res = pooled(rows, net)
        for ax, key, scale, label in ((axes[0][col], "agree", 100, "argmax agreement with per-frame (%)"),
                                      (axes[1][col], "mad", 1, "mean |output - per-frame output|")):
            for prop, colour in (("copy", "tab:blue"), ("flow", "tab:orange")):
                fixed = sorted((r for r in res if r["policy"].startswith("every") and
                                (r["propagate"] == prop or r["policy"] == "every:1")),
                               key=lambda r: r["speedup"])
                if key == "mad":
                    fixed = [r for r in fixed if r["policy"] != "every:1"]   # 0 on a log scale
                ax.plot([r["speedup"] for r in fixed], [scale * r[key] for r in fixed], "o-",
                        color=colour, label=f"every:{fixed_names}, {prop}")
                ada = [r for r in res if r["policy"].startswith("adaptive") and r["propagate"] == prop]
                ax.plot([r["speedup"] for r in ada], [scale * r[key] for r in ada], "s", ms=8,
                        color=colour, mfc="none", label=f"adaptive, {prop}")
                for r in ada:
                    ax.annotate(r["policy"].split(":")[1], (r["speedup"], scale * r[key]),
                                textcoords="offset points", xytext=(5, -10), fontsize=7)
            if key == "agree":
                ax.axhline(95, color="grey", lw=0.8, ls=":")
            else:
                ax.set_yscale("log")
            ax.axvline(3, color="grey", lw=0.8, ls=":")
            ax.set(title=f"{net} (3 videos pooled)", xlabel="speed-up over per-frame (x)", ylabel=label)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    sys.exit(main())
