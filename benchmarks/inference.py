"""Inference speed: brewnet vs OpenCV's dnn Caffe importer, same nets, same run, same threads.

    python benchmarks/inference.py [--threads 0] [--repeats 30]

Prints ms per image at batch 1 and 16 for open_nsfw (real weights), LeNet (real weights) and
CaffeNet (random weights written to a temporary .caffemodel by brewnet), brewnet/OpenCV, and
p90/p50 of brewnet's calls (steadiness). brewnet runs as a user's script does: plain
``caffe.Net(...).forward()``, its own thread choice (``--threads 0``; N fixes both sides to N),
after warm-up calls (the 11th whole forward is where a net becomes one graph: brewnet/execution/lean.py).
OpenCV gets the usable cores. Column ``torch`` is the floor a PyTorch program of the same net
meets: the net as one graph of plain torch ops (``brewnet.deploy.to_torch``, folded) called
under ``torch.inference_mode`` with brewnet's thread count. Runs are interleaved and the median is taken, since these
machines are shared and noisy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT.parent / "shared" / "caffe-models"

import brewnet  # noqa: E402
from brewnet.deploy import to_torch  # noqa: E402
from timing import timed  # noqa: E402

NETS = {
    "open_nsfw": ("trained/open_nsfw/deploy.prototxt", "trained/open_nsfw/resnet_50_1by2_nsfw.caffemodel"),
    "LeNet": ("trained/lenet_mnist_ethereon/examples/mnist/lenet.prototxt",
              "trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel"),
    "CaffeNet": ("bvlc/models/bvlc_reference_caffenet/deploy.prototxt", None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="0: brewnet's choice, OpenCV all cores")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--nets", default=",".join(NETS))
    args = ap.parse_args()
    import cv2

    from brewnet.execution.threads import usable_cores

    if args.threads:
        torch.set_num_threads(args.threads)
    cv2.setNumThreads(args.threads or usable_cores())
    tmp = Path(tempfile.mkdtemp())
    print(f"threads={args.threads} repeats={args.repeats} torch={torch.__version__} opencv={cv2.__version__}")
    print(f"{'net':<10} {'batch':>5} {'brewnet ms/img':>15} {'OpenCV ms/img':>14} {'ratio':>7} "
          f"{'torch ms/img':>13} {'p90/p50':>8} {'threads':>7}  load")
    for name in args.nets.split(","):
        proto, weights = NETS[name]
        proto = str(MODELS / proto)
        if weights is None:
            brewnet.set_random_seed(1)
            weights = str(tmp / f"{name}.caffemodel")
            brewnet.Net(proto, brewnet.TEST).save(weights)
        else:
            weights = str(MODELS / weights)
        bnet = brewnet.Net(proto, brewnet.TEST, weights=weights)
        cnet = cv2.dnn.readNetFromCaffe(proto, weights)
        plain = to_torch(proto, weights, fold=True)
        in_name = bnet.inputs[0]
        shape = bnet.blobs[in_name].shape
        for batch in (1, 16):
            x = np.random.default_rng(0).standard_normal((batch, *shape[1:])).astype(np.float32)
            bnet.blobs[in_name].reshape(*x.shape)

            def run_brewnet():
                bnet.forward(**{in_name: x})

            def run_cv():
                cnet.setInput(x)
                cnet.forward()

            xt = torch.from_numpy(x)

            def run_torch():
                with torch.inference_mode():
                    plain(xt)

            timed(run_brewnet, 12)                  # past the lean-inference trace
            tb, tc, tt = [], [], []
            for _ in range(max(1, args.repeats // 5)):  # interleave to share the noise
                tb += timed(run_brewnet, 5, warmup=1)
                tc += timed(run_cv, 5, warmup=1)
                tt += timed(run_torch, 5, warmup=1)   # under the threads brewnet's call left set
            mb, mc = statistics.median(tb) * 1e3 / batch, statistics.median(tc) * 1e3 / batch
            mt = statistics.median(tt) * 1e3 / batch
            p90 = sorted(tb)[int(0.9 * (len(tb) - 1))] / statistics.median(tb)
            print(f"{name:<10} {batch:>5} {mb:>15.2f} {mc:>14.2f} {mb / mc:>7.2f} {mt:>13.2f} {p90:>8.2f} "
                  f"{torch.get_num_threads():>7}  {open('/proc/loadavg').read().split()[0]}", flush=True)


if __name__ == "__main__":
    main()
