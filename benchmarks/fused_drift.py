"""How far a fused member is from the same net trained alone, next to the float32 noise floor.

    python benchmarks/fused_drift.py [--iters 1,10,50,500] [--k 4] [--seeds 1]

Four LeNets on real MNIST (t10k from ``../shared``, converted to an LMDB once; batch 64; SGD
momentum 0.9, ``inv``, weight_decay 5e-4, base_lr 0.01 / 0.005 / 0.02 / 0.001, seeds
``--seeds`` .. +3) are trained fused (``FusedSolvers``) and each alone, with the defaults a user
has. "fused" is max over the net's param blobs of max|fused - alone| / max|alone| after each
count of iterations; "floor" is the same measure for the net alone started one ulp away (every
initial weight moved to the next float32 up): how far float32 noise alone carries that run.
"bitwise blobs" counts the net's blobs whose fused values equal alone's bit for bit. Both
formulations of ``FusedSolvers`` are run: ``exact`` (each net's own convolution and
InnerProduct kernels, the default) and ``wide`` (grouped convolutions, batched products).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
T10K = SHARED / "caffe-models" / "trained" / "mnist_t10k" / "data" / "mnist"
RATES = (0.01, 0.005, 0.02, 0.001)


def prepare(work: Path) -> Path:
    """MNIST t10k as an LMDB and LeNet's train net over it at batch 64 (many_nets.py's)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import many_nets

    return many_nets.prepare(work)["lenet"]


def params(net: Path, work: Path, k: int, seed0: int):
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import parse_text

    return [parse_text(f'net: "{net}" base_lr: {RATES[i % 4]} momentum: 0.9 weight_decay: 0.0005 '
                       f'lr_policy: "inv" gamma: 0.0001 power: 0.75 max_iter: 100000 display: 0 '
                       f'snapshot: 0 random_seed: {seed0 + i} snapshot_prefix: "{work / f"s{i}"}"',
                       pb.SolverParameter()) for i in range(k)]


def snap(net) -> list:
    return [p.detach().clone() for p in net.learnable]


def rel(a: list, b: list) -> float:
    return max(float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30))
               for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", default="1,10,50,500")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--formulations", default="exact,wide",
                    help="exact: each net's own convolution and product kernels (the default); "
                         "wide: HFTA's grouped convolutions and batched products")
    a = ap.parse_args()
    import logging

    import torch

    import brewnet  # noqa: F401  (before torch: a user's import order, brewnet/execution/threads.py)
    from brewnet.many.fused import FusedSolvers
    from brewnet.solvers import SOLVERS

    logging.getLogger("brewnet").setLevel(logging.WARNING)
    marks = [int(x) for x in a.iters.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ps = params(prepare(work), work, a.k, a.seeds)
        fused = {}
        for form in a.formulations.split(","):
            fs = FusedSolvers(ps, device="cpu", exact=form == "exact")
            done = 0
            for m in marks:
                fs.step(m - done)
                done = m
                fused[form, m] = [snap(s.net) for s in fs.solvers]
        alone, floor = {m: [] for m in marks}, {m: [] for m in marks}
        for p in ps:
            for shifted in (False, True):
                s = SOLVERS[p.type](p, device="cpu")
                if shifted:
                    with torch.no_grad():
                        for t in s.net.learnable:
                            t.copy_(torch.nextafter(t, torch.full_like(t, float("inf"))))
                done = 0
                for m in marks:
                    s.step(m - done)
                    done = m
                    (floor if shifted else alone)[m].append(snap(s.net))
    names = ["conv1.w", "conv1.b", "conv2.w", "conv2.b", "ip1.w", "ip1.b", "ip2.w", "ip2.b"]
    forms = a.formulations.split(",")
    print("| net | base_lr | formulation | " + " | ".join(f"{m} it: fused / floor" for m in marks)
          + " | bitwise blobs at each |")
    print("|---|---|---|" + "---|" * len(marks) + "---|")
    for k in range(a.k):
        for form in forms:
            cells = [f"{rel(fused[form, m][k], alone[m][k]):.1e} / "
                     f"{rel(floor[m][k], alone[m][k]):.1e}" for m in marks]
            bits = [sum(torch.equal(x, y) for x, y in zip(fused[form, m][k], alone[m][k]))
                    for m in marks]
            print(f"| s{k} | {RATES[k % 4]} | {form} | " + " | ".join(cells) + " | "
                  + ", ".join(f"{b}/{len(names)}" for b in bits) + " |")
    m = marks[min(2, len(marks) - 1)]
    print(f"\nPer blob after {m} iterations (fused vs alone, relative):\n")
    print("| net | formulation | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for k in range(a.k):
        for form in forms:
            print(f"| s{k} | {form} | " + " | ".join(
                f"{rel([x], [y]):.1e}" for x, y in zip(fused[form, m][k], alone[m][k])) + " |")

if __name__ == "__main__":
    main()
