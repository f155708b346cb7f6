"""Training passes around the kernels (issue 39, "Fewer passes"): a fused autograd Function
against the autograd chain brewnet runs, forward + backward, at the training nets' shapes.

    python benchmarks/train_passes.py [--rounds 15] [--threads 2] [--only pool,LRN,loss]
    python benchmarks/train_passes.py --nets lenet,cifar10_quick,caffenet [--rounds 15]
    python benchmarks/train_passes.py --profile caffenet [--rounds 10]

Rows: MAX pooling's -FLT_MAX floor (``pooling._MaxPool2d``: the floor in place and one
``threshold_backward`` in the backward, against ``clamp_min`` under autograd: a copy forward,
``ge`` + ``where`` backward); LRN across channels (``functional._LRNAcross``: Caffe's backward
formula, against autograd through ``avg_pool1d``, ``pow`` and the products); SoftmaxWithLoss with
its gradient made in the forward (``LossGradInForward`` here: tried, not adopted). Columns:
median ms of each (interleaved, one call of each per round), the forward's largest difference,
the input gradients' largest difference relative to their largest magnitude, and whether the
fused one gives the same bits on 1, 2 and 4 threads.

``--nets``: ``brewnet time``'s forward + backward of each net (Input-layer train nets, as
train_speed.py builds them), one pass with the previous code patched back in (the pooling and LRN
formulas above, the weight copied by oneDNN in each call) and one with brewnet's, in turn, in one
process: the machine is shared, and a before/after pair of processes saw its load change between
them. Medians of ``--rounds`` passes each. ``--profile NET``: torch.profiler's ops by self CPU
time, ms a pass, over ``--rounds`` passes of each path.
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
from brewnet.layers import pooling as Pool  # noqa: E402
from brewnet.layers import loss as L  # noqa: E402
from conv_wgrad import same_on  # noqa: E402
from layer_passes import lrn_across_before  # noqa: E402

CL = torch.channels_last


def pool_before(x, k, s):
    """MAX pooling under autograd before ``_MaxPool2d``: torch's, then the floor out of place."""
    return F.max_pool2d(x, k, s, 0, ceil_mode=True).clamp_min(-Pool.FLT_MAX)


def pool_now(x, k, s):
    return Pool.max_pool2d(x, (k, k), (s, s), (0, 0))[0]


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


def max_pool2d_before(x, kernel, stride, pad, ceil_mode=True, return_mask=False):
    """``pooling.max_pool2d`` before ``_MaxPool2d`` on the nets' (native) windows."""
    if not return_mask and Fn.grad_needed(x):
        return pool_before(x, kernel[0], stride[0]), None
    return _max_pool2d(x, kernel, stride, pad, ceil_mode, return_mask)


def lrn_before(x, size, alpha, beta, k):
    return lrn_across_before(x, size, alpha, beta, k) if Fn.grad_needed(x) else \
        _lrn(x, size, alpha, beta, k)


_max_pool2d, _lrn, _nhwc = Pool.max_pool2d, Fn.lrn_across_channels, Fn._nhwc
PATHS = {"before": (max_pool2d_before, lrn_before, lambda x: False),
         "now": (_max_pool2d, _lrn, _nhwc)}


def train_net(name):
    """(net, threads) of ``brewnet time``'s Input-layer train net ``name``, with an input."""
    from brewnet.execution import determinism, process, threads
    from brewnet.net import Net
    from brewnet.proto import caffe_pb2 as pb
    from conv_wgrad import PROTOS
    from thread_bits import MODELS, with_input

    process.configure(torch.device("cpu"), keep_memory=True)
    path, shape = PROTOS[name]
    net = Net(with_input(MODELS / path, shape), pb.TRAIN)
    n = threads.plan_beside(net.layer_list)
    determinism.blas_on_one_thread()
    determinism.prepare(net)
    gen = torch.Generator().manual_seed(1)
    net.blobs["data"].tensor.copy_(torch.rand(net.blobs["data"].shape, generator=gen))
    net.blobs["label"].tensor.copy_(torch.randint(0, 10, (shape[0],), generator=gen).float())
    return net, n


def profile(name, rounds: int) -> None:
    from torch.profiler import profile as prof

    from brewnet.analysis.timing import time_net
    net, _ = train_net(name)
    tables = {}
    for key, patch in PATHS.items():
        Pool.max_pool2d, Fn.lrn_across_channels, Fn._nhwc = patch
        time_net(net, 2, warmup=0)
        with prof() as p:
            time_net(net, rounds, warmup=0)
        tables[key] = {e.key: (e.self_cpu_time_total / rounds / 1e3, e.count / rounds)
                       for e in p.key_averages()}
    Pool.max_pool2d, Fn.lrn_across_channels, Fn._nhwc = PATHS["now"]
    ops = sorted(set(tables["before"]) | set(tables["now"]),
                 key=lambda k: -max(t.get(k, (0, 0))[0] for t in tables.values()))
    print(f"{name}: ms a forward + backward by op (self CPU), calls a pass\n")
    print("| op | before ms (calls) | now ms (calls) |\n|---|---|---|")
    for op in ops[:30]:
        print(f"| {op} | " + " | ".join(f"{t[op][0]:.2f} ({t[op][1]:g})" if op in t else "-"
                                       for t in tables.values()) + " |")
    print("| total | " + " | ".join(f"{sum(v[0] for v in t.values()):.1f}"
                                    for t in tables.values()) + " |")


def nets(names, rounds: int) -> None:
    from brewnet.analysis.timing import time_net

    print("| net | batch | threads | before ms | now ms | before / now |")
    print("|---|---|---|---|---|---|")
    for name in names:
        net, n = train_net(name)
        shape = net.blobs["data"].shape
        got: dict = {k: [] for k in PATHS}
        for r in range(rounds + 2):
            for key, (pool, lrn, nhwc) in PATHS.items():
                Pool.max_pool2d, Fn.lrn_across_channels, Fn._nhwc = pool, lrn, nhwc
                ms = time_net(net, 1, warmup=0).iteration_ms[0]
                if r >= 2:                       # two warm-up rounds
                    got[key].append(ms)
        Pool.max_pool2d, Fn.lrn_across_channels, Fn._nhwc = PATHS["now"]
        b, a = (statistics.median(got[k]) for k in PATHS)
        print(f"| {name} | {shape[0]} | {n} | {b:.1f} | {a:.1f} | {b / a:.3f}x |", flush=True)


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
    ap.add_argument("--nets", help="comma-separated nets: whole forward + backward passes")
    ap.add_argument("--profile", metavar="NET", help="torch.profiler's ops of NET, both paths")
    a = ap.parse_args()
    if a.profile:
        return profile(a.profile, a.rounds)
    if a.nets:
        return nets(a.nets.split(","), a.rounds)
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
