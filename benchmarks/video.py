"""Keyframe feature reuse on real videos (``brewnet.video``): speed and agreement with per-frame
inference, for fixed and adaptive keyframes, copy and flow propagation.

    python benchmarks/video.py --videos DIR [--frames 60] [--width 320] [--plot video.png]

DIR holds vtest.avi, Megamind.avi and tree.avi from Debian's opencv-doc package:
``apt-get download opencv-doc && dpkg -x opencv-doc_*.deb X`` and DIR is
``X/usr/share/doc/opencv-doc/examples/data``. The nets come from the shared data
(``$BREWNET_SHARED``, default ../shared next to the checkout), both trained and made fully
convolutional (``brewnet.fully_convolutional``):

- open_nsfw (ResNet-50 1by2, 2 classes), split after res2 (``eltwise_stage0_block2``, stride
  4): at 320 x 240, conv1 + res2 are 28% of its FLOPs (``Layer.flops``), res3-res5 and the
  classifier the rest, so a skipped high part saves most of the work, and the adaptive
  measure looks at mid-level features;
- CIFAR-10 "full" (10 classes, 32 x 32 windows at stride 8), split after ``norm1`` (conv1,
  pool1, LRN: 20% of its FLOPs at 320 x 240).

Each video's first ``--frames`` frames are decoded once and resized to ``--width`` (height
from the aspect ratio; decoding is not timed). Per video and net: ``every:1`` (per frame, the
reference), ``every:5``, ``every:10`` and ``adaptive`` at two thresholds (max gap 20), each with
copy and flow. Columns: frames/s, speed-up over every:1 in the same process (its time: the
mean of a run before and one after the others), the same ratio of process CPU time (steadier
than wall time on a loaded machine), keyframe share,
mean |output - per-frame output| (softmax probabilities), and the share of (frame, position)
pairs whose argmax class agrees with per-frame inference. Prints a table per net and the
pooled numbers over the videos; saves a plot of speed-up vs agreement.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import brewnet  # noqa: E402
from brewnet.net import Net  # noqa: E402
from brewnet.video import VideoNet, read_frames  # noqa: E402

SHARED = Path(os.environ.get("BREWNET_SHARED") or Path(__file__).resolve().parents[2] / "shared")
T = SHARED / "caffe-models/trained"
C10 = T / "everpeace_caffe_2014_v1format/examples/cifar10"
NETS = {   # prototxt, weights, split, mean (BGR), the two adaptive thresholds
    "open_nsfw": (T / "open_nsfw/deploy.prototxt", T / "open_nsfw/resnet_50_1by2_nsfw.caffemodel",
                  "eltwise_stage0_block2", (104, 117, 123), (0.10, 0.14)),
    # CIFAR-10's mean is ~114-125 per channel; the net was trained on RGB and gets BGR here:
    # only agreement with its own per-frame outputs is measured, not accuracy.
    "cifar10_full": (C10 / "cifar10_full.prototxt", C10 / "cifar10_full_iter_70000.caffemodel",
                     "norm1", (120,), (0.10, 0.14)),
}
VIDEOS = ("vtest.avi", "Megamind.avi", "tree.avi")


def policies(thresholds):
    out = [("every:1", "copy")]
    for spec in ("every:5", "every:10") + tuple(f"adaptive:{t:g}" for t in thresholds):
        out += [(spec, "copy"), (spec, "flow")]
    return out


def run(vn, frames):
    outs, keys = [], []
    start, cpu = time.perf_counter(), time.process_time()
    for o in vn.run(frames):
        outs.append(o.outputs["prob"][0].cpu().numpy())
        keys.append(o.is_keyframe)
    return (time.perf_counter() - start, time.process_time() - cpu), np.stack(outs), np.asarray(keys)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--videos", required=True, help="folder with vtest.avi, Megamind.avi, tree.avi")
    ap.add_argument("--frames", type=int, default=60, help="first N frames of each video")
    ap.add_argument("--width", type=int, default=320, help="frames resized to this width")
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--max-gap", type=int, default=20)
    ap.add_argument("--plot", default="video_benchmark.png")
    args = ap.parse_args(argv)
    import cv2

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(f"# {args.frames} first frames per video at width {args.width}, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    rows = []
    for net_name in args.nets.split(","):
        proto, weights, split, mean, thresholds = NETS[net_name]
        original = Net(proto, weights=weights)
        for video in VIDEOS:
            frames = list(read_frames(Path(args.videos) / video, args.frames))
            h = round(frames[0].shape[0] * args.width / frames[0].shape[1])
            frames = [cv2.resize(f, (args.width, h), interpolation=cv2.INTER_AREA) for f in frames]
            net = brewnet.fully_convolutional(original, (h, args.width))
            run(VideoNet(net, None, mean=mean), frames[:2])        # warm-up, not timed
            ref, first = None, len(rows)
            for spec, prop in policies(thresholds):
                vn = VideoNet(net, split, prop, spec, args.max_gap, mean=mean)
                s, out, keys = run(vn, frames)
                if ref is None:
                    ref = out
                rows.append(dict(net=net_name, video=video, policy=spec, propagate=prop,
                                 frames=len(frames), fps=len(frames) / s[0], cpu=s[1], keys=keys.mean(),
                                 mad=np.abs(out - ref).mean(),
                                 agree=(out.argmax(1) == ref.argmax(1)).mean(),
                                 positions=int(np.prod(ref.shape[2:]))))
            # The per-frame time: the mean of a run before and one after the others (the
            # machine is shared; its load drifts).
            again = run(VideoNet(net, None, mean=mean), frames)[0]
            base = (len(frames) / rows[first]["fps"] + again[0]) / 2
            base_cpu = rows[first]["cpu"] = (rows[first]["cpu"] + again[1]) / 2
            rows[first]["fps"] = len(frames) / base
            for r in rows[first:]:
                r["speedup"] = base / (len(frames) / r["fps"])
                r["cpu_speedup"] = base_cpu / r["cpu"]
                print(f"{net_name:12s} {video:12s} {r['policy']:14s} {r['propagate']:4s} "
                      f"{r['fps']:6.2f} fps x{r['speedup']:4.2f} (CPU time x{r['cpu_speedup']:4.2f}) "
                      f"keys {r['keys']:.2f} |d| {r['mad']:.2e} agree {r['agree']:.3f}", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
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
              "mean abs diff | argmax agree |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in pooled(rows, net):
            print(f"| {r['policy']} | {r['propagate']} | {r['fps']:.2f} | {r['speedup']:.2f}x | "
                  f"{r['cpu_speedup']:.2f}x | {r['keys']:.0%} | {r['mad']:.2e} | {r['agree']:.1%} |")


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = list(dict.fromkeys(r["net"] for r in rows))
    fig, axes = plt.subplots(1, len(nets), figsize=(6 * len(nets), 4.5), squeeze=False)
    for ax, net in zip(axes[0], nets):
        res = pooled(rows, net)
        for prop, colour in (("copy", "tab:blue"), ("flow", "tab:orange")):
            fixed = sorted((r for r in res if r["policy"].startswith("every") and
                            (r["propagate"] == prop or r["policy"] == "every:1")),
                           key=lambda r: r["speedup"])
            ax.plot([r["speedup"] for r in fixed], [100 * r["agree"] for r in fixed], "o-",
                    color=colour, label=f"every:1/5/10, {prop}")
            ada = [r for r in res if r["policy"].startswith("adaptive") and r["propagate"] == prop]
            ax.plot([r["speedup"] for r in ada], [100 * r["agree"] for r in ada], "s", ms=8,
                    color=colour, mfc="none", label=f"adaptive, {prop}")
            for r in ada:
                ax.annotate(r["policy"].split(":")[1], (r["speedup"], 100 * r["agree"]),
                            textcoords="offset points", xytext=(5, -10), fontsize=8)
        ax.axhline(95, color="grey", lw=0.8, ls=":")
        ax.axvline(3, color="grey", lw=0.8, ls=":")
        ax.set(title=f"{net} (3 videos pooled)", xlabel="speed-up over per-frame (x)",
               ylabel="argmax agreement with per-frame (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    sys.exit(main())
