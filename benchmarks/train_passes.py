"""Training passes around the kernels (issue 39, "Fewer passes"): a fused autograd Function
against the autograd chain brewnet runs, forward + backward, at the training nets' shapes.

    python benchmarks/train_passes.py [--rounds 15] [--threads 2] [--only pool,LRN,loss]

Rows: MAX pooling's -FLT_MAX floor (``functional._MaxPool2d``: the floor in place and one
``threshold_backward`` in the backward, against ``clamp_min`` under autograd: a copy forward,
``ge`` + ``where`` backward); LRN across channels (``functional._LRNAcross``: Caffe's backward
formula, against autograd through ``avg_pool1d``, ``pow`` and the products); SoftmaxWithLoss with
its gradient made in the forward (``LossGradInForward`` here: tried, not adopted). Columns:
median ms of each (interleaved, one call of each per round), the forward's largest difference,
the input gradients' largest difference relative to their largest magnitude, and whether the
fused one gives the same bits on 1, 2 and 4 threads.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import brewnet  # noqa: E402,F401,I001  (before torch, as the CLI)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from brewnet.layers import functional as Fn  # noqa: E402
from brewnet.layers import loss as L  # noqa: E402
from conv_wgrad import same_on  # noqa: E402
from layer_passes import lrn_across_before  # noqa: E402

CL = torch.channels_last


def pool_before(x, k, s):
    """MAX pooling under autograd before ``_MaxPool2d``: torch's, then the floor out of place."""
    return F.max_pool2d(x, k, s, 0, ceil_mode=True).clamp_min(-Fn.FLT_MAX)


def pool_now(x, k, s):
    return Fn.max_pool2d(x, (k, k), (s, s), (0, 0))[0]


class LossGradInForward(torch.autograd.Function):
    """The tried candidate: softmax - onehot made in the forward and saved; the backward only
    scales it (no ignore_label, one-hot rows: SoftmaxWithLoss's common case)."""

    @staticmethod
    def forward(ctx, x, lab, norm):
        logp = torch.log_softmax(x, 1)
        loss = -logp.gather(1, lab).clamp_min(math.log(L.FLT_MIN)).sum() / norm
        dx = logp.exp_().scatter_add_(1, lab, torch.full(lab.shape, -1.0, dtype=x.dtype))
        ctx.save_for_backward(dx)
        ctx.norm = norm
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dx, = ctx.saved_tensors
        return dx * (g / ctx.norm), None, None


def loss_before(x, lab):
    return L._WeightedLogLoss.apply(x, lab, None, None, L.FLT_MIN, float(x.shape[0]))


def loss_now(x, lab):
    return LossGradInForward.apply(x, lab, float(x.shape[0]))


def lrn_now(x, size, alpha, beta, k):
    return Fn.lrn_across_channels(x, size, alpha, beta, k)


# (name, input shape, old, new, args): the pooling, LRN and loss layers of LeNet, CIFAR10-quick
# and CaffeNet at their training batches
CASES = [
    ("LeNet pool1 2x2/2", (64, 20, 24, 24), pool_before, pool_now, (2, 2)),
    ("LeNet pool2 2x2/2", (64, 50, 8, 8), pool_before, pool_now, (2, 2)),
    ("CIFAR10-quick pool1 3x3/2", (100, 32, 32, 32), pool_before, pool_now, (3, 2)),
    ("CaffeNet pool1 3x3/2", (10, 96, 55, 55), pool_before, pool_now, (3, 2)),
    ("CaffeNet pool2 3x3/2", (10, 256, 27, 27), pool_before, pool_now, (3, 2)),
    ("CaffeNet norm1 LRN 5", (10, 96, 27, 27), lrn_across_before, lrn_now, (5, 1e-4, 0.75, 1.0)),
    ("CaffeNet norm2 LRN 5", (10, 256, 13, 13), lrn_across_before, lrn_now, (5, 1e-4, 0.75, 1.0)),
    ("LeNet loss", (64, 10), loss_before, loss_now, (torch.arange(64).remainder(10)[:, None],)),
    ("CaffeNet loss", (10, 1000), loss_before, loss_now, (torch.arange(10)[:, None] * 7,)),
]


def fwd_bwd(fn, x, dy, args):
    xg = x.detach().requires_grad_()
    y = fn(xg, *args)
    y.backward(dy)
    return y.detach(), xg.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated parts of case names to run")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.rounds} interleaved "
          "rounds, ms of a forward + backward\n")
    print("| case | autograd ms | fused ms | autograd / fused | forward diff | gradient diff (rel) "
          "| fused bits on 1, 2, 4 threads |")
    print("|---|---|---|---|---|---|---|")
    for name, shape, old, new, args in CASES:
        if a.only and not any(w in name for w in a.only.split(",")):
            continue
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen)
        y = new(x, *args)
        dy = torch.randn(y.shape, generator=gen)
        if x.dim() == 4:
            x, dy = x.contiguous(memory_format=CL), dy.contiguous(memory_format=CL)
        runs = {"old": lambda: fwd_bwd(old, x, dy, args), "new": lambda: fwd_bwd(new, x, dy, args)}
        times: dict = {k: [] for k in runs}
        for fn in runs.values():
            fn()
        for _ in range(a.rounds):
            for k, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t) * 1e3)
        (y0, g0), (y1, g1) = runs["old"](), runs["new"]()
        ms = {k: statistics.median(v) for k, v in times.items()}
        bits = same_on(lambda: list(runs["new"]()))
        torch.set_num_threads(a.threads)
        rel = ((g1 - g0).abs().max() / g0.abs().max()).item()
        print(f"| {name} {tuple(shape)} | {ms['old']:.2f} | {ms['new']:.2f} | "
              f"{ms['old'] / ms['new']:.2f}x | {(y1 - y0).abs().max().item():.0e} | {rel:.0e} | "
              f"{'y' if bits else 'n'} |")


if __name__ == "__main__":
    main()
