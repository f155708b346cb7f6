"""Fused training speed: K nets as one fused net (brewnet.many.fused) vs one-by-one solvers.

    python benchmarks/fused.py [--ks 1,2,4,8] [--rounds 5] [--threads 2] [--formulations]

Nets: the single-InnerProduct net of issue 12's seed (MNIST 784 -> 10, batch 100, SGD) and
Caffe's LeNet (batch 64), both reading a synthetic LMDB written once here. For each K: wall time
of one step of all K nets, fused (``FusedSolvers.step(1)``) and one-by-one (K solvers,
``step(1)`` each); rounds alternate the two sides (the machine is shared and noisy) and medians
are reported, with the speed-up as a ratio measured in the same run.

``--formulations`` times the candidate formulations of one training step's forward and backward
(no solver), in plain torch over LeNet's and the ip net's shapes, K copies: ``loop`` (K separate
nets), ``wide`` (one conv with K x filters then grouped convs, batched matmuls; NCHW),
``wide-nhwc`` (the same in channels_last) and ``vmap`` (``torch.func.functional_call`` of one net
under ``vmap`` over ``stack_module_state`` params, the data shared: in_dims None).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from brewnet.data.db import open_writer  # noqa: E402
from brewnet.data.transform import chw_to_datum  # noqa: E402
from brewnet.many.fused import FusedSolvers  # noqa: E402
from brewnet.net import _nhwc  # noqa: E402
from brewnet.proto import caffe_pb2 as pb  # noqa: E402
from brewnet.proto.io import parse_text  # noqa: E402
from brewnet.solvers import SOLVERS  # noqa: E402

IP_NET = """name: "ip" layer { name: "data" type: "Data" top: "data" top: "label"
  transform_param { scale: 0.00390625 } data_param { source: "SRC" batch_size: 100 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }"""


def make_data(d: Path) -> Path:
    rng = np.random.default_rng(0)
    with open_writer(str(d / "train")) as w:
        for i in range(2000):
            w.put(f"{i:08d}", chw_to_datum(rng.integers(0, 256, (1, 28, 28), dtype=np.uint8),
                                           int(rng.integers(10))).SerializeToString())
    (d / "ip.prototxt").write_text(IP_NET.replace("SRC", str(d / "train")))
    lenet = (ROOT / "examples/mnist/lenet_train_test.prototxt").read_text()
    lenet = lenet.replace("examples/mnist/mnist_train_lmdb", str(d / "train"))
    # TEST phase is never run here (no test_iter); point it at the same records.
    (d / "lenet.prototxt").write_text(lenet.replace("examples/mnist/mnist_test_lmdb", str(d / "train")))
    return d


def solvers(d: Path, net: str, k: int):
    return [parse_text(f"""net: "{d / net}.prototxt" base_lr: {0.01 * (j + 1)} momentum: 0.9
        weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75 max_iter: 100000
        solver_mode: CPU random_seed: {j + 1} type: "SGD" """, pb.SolverParameter())
            for j in range(k)]


def bench_solvers(d: Path, ks, rounds: int) -> None:
    print(f"{'net':6} {'K':>2} {'one-by-one ms':>14} {'fused ms':>9} {'speed-up':>8}")
    for net in ("ip", "lenet"):
        for k in ks:
            ps = solvers(d, net, k)
            alone = [SOLVERS["SGD"](p, device="cpu") for p in ps]
            fused = FusedSolvers(ps, device="cpu")
            for s in alone:
                s.step(2)
            fused.step(2)
            a, f = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                for s in alone:
                    s.step(1)
                a.append(time.perf_counter() - t)
                t = time.perf_counter()
                fused.step(1)
                f.append(time.perf_counter() - t)
            ma, mf = statistics.median(a) * 1e3, statistics.median(f) * 1e3
            print(f"{net:6} {k:2d} {ma:14.1f} {mf:9.1f} {ma / mf:7.2f}x", flush=True)
            del alone, fused


# -- formulations, in plain torch ----------------------------------------------------------
def lenet_params(k: int):
    g = torch.Generator().manual_seed(0)
    shapes = [(20, 1, 5, 5), (20,), (50, 20, 5, 5), (50,), (500, 800), (500,), (10, 500), (10,)]
    return [(torch.randn((k, *s), generator=g) * 0.05).requires_grad_() for s in shapes]


def lenet_one(p, x, y):
    w1, b1, w2, b2, w3, b3, w4, b4 = p
    h = F.max_pool2d(F.conv2d(x, w1, b1), 2, 2)
    h = F.max_pool2d(F.conv2d(h, w2, b2), 2, 2)
    h = F.relu(F.linear(h.flatten(1), w3, b3))
    return F.cross_entropy(F.linear(h, w4, b4), y)


def lenet_wide(p, x, y, nhwc: bool):
    w1, b1, w2, b2, w3, b3, w4, b4 = p
    k, n = w1.shape[0], x.shape[0]
    if nhwc:
        x = _nhwc(x)                       # NHWC strides even for one channel
    h = F.max_pool2d(F.conv2d(x, w1.flatten(0, 1), b1.flatten()), 2, 2)
    h = F.max_pool2d(F.conv2d(h, w2.flatten(0, 1), b2.flatten(), groups=k), 2, 2)
    h = h.reshape(n, k, -1).transpose(0, 1)
    h = F.relu(torch.baddbmm(b3.unsqueeze(1), h, w3.transpose(1, 2)))
    out = torch.baddbmm(b4.unsqueeze(1), h, w4.transpose(1, 2))
    return sum(F.cross_entropy(out[j], y) for j in range(k))


def ip_params(k: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn((k, 10, 784), generator=g) * 0.05).requires_grad_(),
            torch.zeros((k, 10)).requires_grad_()]


def ip_one(p, x, y):
    return F.cross_entropy(F.linear(x.flatten(1), p[0], p[1]), y)


def ip_wide(p, x, y, nhwc: bool):
    w, b = p
    k = w.shape[0]
    out = torch.addmm(b.flatten(), x.flatten(1), w.flatten(0, 1).t()).view(x.shape[0], k, -1)
    return sum(F.cross_entropy(out[:, j], y) for j in range(k))


def bench_formulations(ks, rounds: int) -> None:
    from torch.func import grad, vmap

    cases = {"ip": (ip_params, ip_one, ip_wide, 100), "lenet": (lenet_params, lenet_one, lenet_wide, 64)}
    print(f"{'net':6} {'K':>2} {'loop ms':>8} {'wide ms':>8} {'wide-nhwc':>9} {'vmap ms':>8}")
    for name, (params, one, wide, n) in cases.items():
        x, y = torch.rand(n, 1, 28, 28), torch.randint(0, 10, (n,))
        for k in ks:
            p = params(k)
            rows = [[q[j].detach().clone().requires_grad_() for q in p] for j in range(k)]
            vgrad = vmap(grad(lambda q, x, y: one(q, x, y)), in_dims=(0, None, None))

            def loop():
                for r in rows:
                    torch.autograd.grad(one(r, x, y), r)

            sides = {"loop": loop,
                     "wide": lambda: torch.autograd.grad(wide(p, x, y, False), p),
                     "wide-nhwc": lambda: torch.autograd.grad(wide(p, x, y, True), p),
                     "vmap": lambda: vgrad([q.detach() for q in p], x, y)}
            times = {s: [] for s in sides}
            for f in sides.values():
                f()
            for _ in range(rounds):
                for s, f in sides.items():
                    t = time.perf_counter()
                    f()
                    times[s].append(time.perf_counter() - t)
            m = {s: statistics.median(v) * 1e3 for s, v in times.items()}
            print(f"{name:6} {k:2d} {m['loop']:8.1f} {m['wide']:8.1f} {m['wide-nhwc']:9.1f} "
                  f"{m['vmap']:8.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formulations", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    logging.getLogger("brewnet").setLevel(logging.WARNING)
    ks = [int(k) for k in a.ks.split(",")]
    print(f"torch {torch.__version__}, {a.threads} thread(s), medians of {a.rounds} rounds")
    if a.formulations:
        bench_formulations(ks, a.rounds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        bench_solvers(make_data(Path(tmp)), ks, a.rounds)


if __name__ == "__main__":
    main()
