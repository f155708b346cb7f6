"""MAX pooling for training on the CPU: torch's kernel (brewnet's path) against exact composites.

    python benchmarks/max_pool.py [--rounds 7] [--threads 2]

Every MAX pooling of LeNet (batch 64, 2x2/2), CIFAR10-quick (batch 100, 3x3/2 under Caffe's
ceil rule: a partial last window) and CaffeNet (batch 10, 3x3/2), channels-last as the nets
run them. Columns, ms of the forward (top and what the backward needs) and of the backward (the
bottom's gradient), median of ``--rounds``, the candidates interleaved in each round (the
machine may be shared):

- ``torch``: ``max_pool2d_with_indices`` and its backward, what ``pooling.max_pool2d`` runs;
- ``views``: the maximum of the k*k strided views of the NHWC plane (-inf past the edge), the
  first maximum's window offset as one uint8 per output, and a backward adding each offset's
  gradient into its strided view of a zeroed bottom gradient, the views in reverse window order
  (so an input shared by up to four windows sums their gradients in torch's row-major order);
- ``scatter``: torch's forward, the backward as ``scatter_add_`` of the top gradient into the
  (N, H*W, C) bottom gradient at torch's indices.

``bits``: whether each composite gave torch's bits, forward and backward, on integers in
[-3, 3) (many ties) with -0.0 in the top gradient. Measured here (issue 39): both composites
are exact and slower than torch's kernel on every shape, so brewnet keeps torch's kernel.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# brewnet before torch, as the CLI (OpenMP's passive wait)
import brewnet  # noqa: E402,F401,I001
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from brewnet.layers.pooling import pool_out_shape  # noqa: E402

# (pooling, bottom N, C, H, W, kernel, stride) of the BVLC prototxts' MAX poolings
SHAPES = [
    ("LeNet pool1", (64, 20, 24, 24), 2, 2),
    ("LeNet pool2", (64, 50, 8, 8), 2, 2),
    ("CIFAR10-quick pool1", (100, 32, 32, 32), 3, 2),
    ("CaffeNet pool1", (10, 96, 55, 55), 3, 2),
    ("CaffeNet pool2", (10, 256, 27, 27), 3, 2),
    ("CaffeNet pool5", (10, 256, 13, 13), 3, 2),
]
BACKWARD = torch.ops.aten.max_pool2d_with_indices_backward


def torch_fwd(x, k, s):
    return F.max_pool2d(x, k, s, 0, ceil_mode=True, return_indices=True)


def torch_bwd(g, x, idx, k, s):
    return BACKWARD(g, x, [k, k], [s, s], [0, 0], [1, 1], True, idx)


def _views(xl, k, s, out_hw):
    eh, ew = (out_hw[0] - 1) * s + 1, (out_hw[1] - 1) * s + 1
    return [xl[:, i:i + eh:s, j:j + ew:s] for i in range(k) for j in range(k)]


def views_fwd(x, k, s):
    n, c, h, w = x.shape
    out_hw = pool_out_shape((h, w), (k, k), (s, s), (0, 0))
    need = ((out_hw[0] - 1) * s + k, (out_hw[1] - 1) * s + k)
    xl = x.permute(0, 2, 3, 1)
    if need != (h, w):
        xp = xl.new_full((n, need[0], need[1], c), float("-inf"))
        xp[:, :h, :w] = xl
        xl = xp
    vs = _views(xl, k, s, out_hw)
    y = torch.empty(vs[0].shape, dtype=x.dtype)
    torch.maximum(vs[0], vs[1], out=y)
    for v in vs[2:]:
        torch.maximum(y, v, out=y)
    off = torch.full(y.shape, len(vs) - 1, dtype=torch.uint8)
    hit = torch.empty(y.shape, dtype=torch.bool)
    for i in range(len(vs) - 2, -1, -1):        # the lowest offset written last: the first max
        torch.eq(vs[i], y, out=hit)
        off.masked_fill_(hit, i)
    return y.permute(0, 3, 1, 2), off


def views_bwd(g, shape, off, k, s):
    n, c, h, w = shape
    out_hw = tuple(g.shape[-2:])
    need = (max(h, (out_hw[0] - 1) * s + k), max(w, (out_hw[1] - 1) * s + k))
    gl = g.permute(0, 2, 3, 1)
    gx = torch.zeros((n, need[0], need[1], c), dtype=g.dtype)
    hit = torch.empty(gl.shape, dtype=torch.bool)
    part = torch.empty(gl.shape, dtype=g.dtype)
    zero = torch.zeros((), dtype=g.dtype)
    for i, view in reversed(list(enumerate(_views(gx, k, s, out_hw)))):
        torch.eq(off, i, out=hit)
        torch.where(hit, gl, zero, out=part)
        view.add_(part)
    return gx[:, :h, :w].permute(0, 3, 1, 2)


def scatter_bwd(g, shape, idx):
    n, c, h, w = shape
    gx = torch.zeros((n, h * w, c), dtype=g.dtype)
    gx.scatter_add_(1, idx.permute(0, 2, 3, 1).reshape(n, -1, c),
                    g.permute(0, 2, 3, 1).reshape(n, -1, c))
    return gx.view(n, h, w, c).permute(0, 3, 1, 2)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.rounds} rounds, ms\n")
    print("| pooling | shape | torch fwd | views fwd | torch bwd | views bwd | scatter bwd "
          "| bits |")
    print("|---|---|---|---|---|---|---|---|")
    for name, shape, k, s in SHAPES:
        x = torch.randint(-3, 3, shape, generator=gen).float().contiguous(
            memory_format=torch.channels_last)
        y, idx = torch_fwd(x, k, s)
        g = torch.randint(-3, 3, y.shape, generator=gen).float().contiguous(
            memory_format=torch.channels_last)
        g[g == 0] = -0.0
        gx = torch_bwd(g, x, idx, k, s)
        vy, off = views_fwd(x, k, s)
        same = (torch.equal(vy, y) and torch.equal(views_bwd(g, shape, off, k, s), gx)
                and torch.equal(scatter_bwd(g, shape, idx), gx)
                and torch.equal(gx.signbit(), views_bwd(g, shape, off, k, s).signbit()))
        runs = {key: [] for key in ("tf", "vf", "tb", "vb", "sb")}
        for _ in range(a.rounds):
            runs["tf"].append(timed(lambda: torch_fwd(x, k, s)))
            runs["vf"].append(timed(lambda: views_fwd(x, k, s)))
            runs["tb"].append(timed(lambda: torch_bwd(g, x, idx, k, s)))
            runs["vb"].append(timed(lambda: views_bwd(g, shape, off, k, s)))
            runs["sb"].append(timed(lambda: scatter_bwd(g, shape, idx)))
        med = {key: statistics.median(v) for key, v in runs.items()}
        print(f"| {name} | {'x'.join(map(str, shape))} {k}x{k}/{s} | {med['tf']:.2f} | "
              f"{med['vf']:.2f} | {med['tb']:.2f} | {med['vb']:.2f} | {med['sb']:.2f} | "
              f"{'same' if same else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    main()
