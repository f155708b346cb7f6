"""Inference kernels brewnet picks by size on the CPU, against torch's own, as a user's process runs them.

    python benchmarks/inference_kernels.py [--rounds 7] [--threads 2]

brewnet is imported before torch, as a user's script does (OpenMP's passive wait: a parallel
op wakes the pool, tens of microseconds). Without a gradient, NHWC memory. Tables, microseconds
per call, median of ``--rounds`` (the two interleaved); ``rule``: what brewnet's size rule
takes, starred where that is the faster:

- MAX pooling: torch's ``F.max_pool2d`` against the chain of maxima ``pooling.max_pool2d``
  takes (``_window_max``; windows inside the plane);
- PReLU: ``F.prelu`` against the NHWC rows form ``neuron.prelu`` takes for channel counts
  that are not a multiple of 4 (``_prelu_rows_ok``);
- small convolutions in the lean graph: oneDNN's against torch's im2col + GEMM on NCHW
  (``lean.small_conv``, with the NCHW copy of an NHWC input it needs).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import brewnet  # noqa: E402,F401,I001  (before torch: the user's OpenMP wait policy)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from brewnet.execution import lean  # noqa: E402
from brewnet.layers import neuron, pooling  # noqa: E402

POOLS = [("MTCNN P-Net pool1, 320x240 image", (1, 10, 238, 318), 2, 2),
         ("the same, batch 16", (16, 10, 238, 318), 2, 2),
         ("LeNet pool1, batch 64", (64, 20, 24, 24), 2, 2),
         ("LeNet pool2, batch 64", (64, 50, 8, 8), 2, 2),
         ("CaffeNet pool1, batch 1", (1, 96, 55, 55), 3, 2)]
POOLS += [(f"grid {k}x{k}/{s}", (b, c, hw, hw), k, s) for b in (1, 16)
          for k, s, hw in ((2, 2, 56), (3, 2, 57), (3, 1, 28)) for c in (8, 16, 24, 32, 64, 128)]
PRELUS = [("MTCNN P-Net PReLU1", (1, 10, 238, 318)), ("MTCNN P-Net PReLU2", (1, 16, 117, 157)),
          ("MTCNN O-Net PReLU1, batch 16", (16, 32, 46, 46))]
PRELUS += [(f"grid {c} channels", (b, c, hw, hw)) for b, hw in ((1, 64), (1, 128), (16, 64))
           for c in (3, 6, 10, 14, 16, 20, 30, 48)]
CONVS = [("MTCNN P-Net conv4-1 (1x1 to 2)", (1, 32, 115, 155), 2, 1),
         ("LeNet conv1, batch 1", (1, 1, 28, 28), 20, 5), ("LeNet conv2, batch 1", (1, 20, 12, 12), 50, 5),
         ("1x1 to 4 on 64x56x56", (1, 64, 56, 56), 4, 1), ("3x3 to 8 on 16x32x32", (1, 16, 32, 32), 8, 3)]


def nhwc(shape):
    return torch.randn(shape).contiguous(memory_format=torch.channels_last)


def timed(fns: dict, rounds: int, numel: int) -> dict:
    n = max(1, int(2e6 // numel))
    runs = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs[k].append((time.perf_counter() - t0) * 1e6 / n)
    return {k: statistics.median(v) for k, v in runs.items()}


def row(name, shape, extra, us, took, ours, theirs):
    star = "*" if (us[ours] < us[theirs]) == (took == ours) else ""
    print(f"| {name} | {'x'.join(map(str, shape))}{extra} | {us[theirs]:.1f} | {us[ours]:.1f} | "
          f"{us[theirs] / us[ours]:.2f} | {took}{star} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.rounds} rounds, us per call\n")
    print("| MAX pooling | shape | torch | maxima | torch / maxima | rule |\n|---|---|---|---|---|---|")
    for name, shape, k, s in POOLS:
        x = nhwc(shape)
        out = pooling.pool_out_shape(shape[2:], (k, k), (s, s), (0, 0))
        fns = {"torch": lambda: F.max_pool2d(x, k, s, 0, ceil_mode=True),
               "maxima": lambda: pooling._window_max(x, out, (k, k), (s, s))}
        assert torch.equal(fns["torch"](), fns["maxima"]()), name
        took = "maxima" if pooling._window_max_ok(x, out, (k, k), (s, s), (0, 0)) else "torch"
        row(name, shape, f" {k}x{k}/{s}", timed(fns, a.rounds, x.numel()), took, "maxima", "torch")
    print("\n| PReLU | shape | torch | rows | torch / rows | rule |\n|---|---|---|---|---|---|")
    for name, shape in PRELUS:
        x, w = nhwc(shape), torch.rand(shape[1])
        n_, c, h, wd = shape
        fns = {"torch": lambda: F.prelu(x, w), "rows": lambda: neuron.prelu(x, w)}
        took = "rows" if neuron._prelu_rows_ok(x, w) else "torch"
        if took == "torch":     # the rows form by hand, to time it where the rule declines it
            fns["rows"] = lambda: F.prelu(x.permute(0, 2, 3, 1).reshape(n_ * h, wd * c),
                                          w.reshape(1, c).expand(wd, c).reshape(-1))
        row(name, shape, "", timed(fns, a.rounds, x.numel()), took, "rows", "torch")
    print("\n| small convolution | input | oneDNN | im2col+GEMM (NCHW) | oneDNN / GEMM | rule |\n"
          "|---|---|---|---|---|---|")
    for name, shape, o, k in CONVS:
        x, w, b = nhwc(shape), torch.randn(o, shape[1], k, k), torch.randn(o)
        fns = {"oneDNN": lambda: F.conv2d(x, w, b),
               "GEMM": lambda: lean.small_conv(x, w, b, [1, 1], [0, 0], True)}
        flops = 2 * fns["oneDNN"]().numel() * w[0].numel()
        small = flops < lean.SMALL_CONV_FLOPS and x.numel() <= lean.SMALL_CONV_MAX_INPUT
        row(name, shape, f" {k}x{k} to {o}", timed(fns, a.rounds, x.numel()),
            "GEMM" if small else "oneDNN", "GEMM", "oneDNN")


if __name__ == "__main__":
    main()
