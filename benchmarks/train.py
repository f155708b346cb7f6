"""Training speed: brewnet's solver vs the same nets written directly in plain PyTorch.

    python benchmarks/train.py [--threads 2] [--rounds N] [--nets LeNet,CIFAR10-quick,CaffeNet]

brewnet side: the nets' own solver + train_val prototxts (data layers swapped for Input layers
with the benchmark batch size), one ``solver.step(1)`` per iteration. Plain side: an nn.Module
with the same layers and weights, ``F.cross_entropy``, autograd and a hand-written Caffe SGD
update (momentum with the rate inside the history, lr_mult/decay_mult, weight decay). Both use
one fixed synthetic batch. Single steps alternate between the two sides (the machines are shared
and noisy) and medians are reported, with the real Caffe's CPU times from the issue for scale.
Building brewnet's CPU solver sets glibc's malloc to keep freed memory (brewnet/execution/process.py), which
is process-wide: the plain side profits from it too.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT.parent / "shared" / "caffe-models"

import brewnet  # noqa: E402
from brewnet.proto import caffe_pb2 as pb  # noqa: E402
from brewnet.proto.io import read_net, read_solver  # noqa: E402
from brewnet.solvers import SGDSolver  # noqa: E402
from timing import timed  # noqa: E402

# name: (solver, train_val, input shape (C, H, W), batch, Caffe CPU ms/step quoted in the issue)
NETS = {
    "LeNet": ("bvlc/examples/mnist/lenet_solver.prototxt",
              "bvlc/examples/mnist/lenet_train_test.prototxt", (1, 28, 28), 64, "22"),
    "CIFAR10-quick": ("bvlc/examples/cifar10/cifar10_quick_solver.prototxt",
                      "bvlc/examples/cifar10/cifar10_quick_train_test.prototxt", (3, 32, 32), 100, "175"),
    "CaffeNet": ("bvlc/models/bvlc_reference_caffenet/solver.prototxt",
                 "bvlc/models/bvlc_reference_caffenet/train_val.prototxt", (3, 227, 227), 10, "470-530"),
}


def brewnet_solver(solver_file: str, net_file: str, shape, batch: int, device=None):
    param = read_solver(MODELS / solver_file)
    net = read_net(MODELS / net_file)
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    for lp in net.layer:
        if lp.type == "Data":
            if any(r.phase == pb.TEST for r in lp.include):
                continue
            lp = pb.LayerParameter(name=lp.name, type="Input", top=lp.top)
            lp.input_param.shape.add().dim.extend([batch, *shape])
            lp.input_param.shape.add().dim.extend([batch])
        out.layer.append(lp)
    param.ClearField("net")
    param.net_param.CopyFrom(out)
    del param.test_iter[:]
    param.test_interval = param.display = param.snapshot = 0
    param.solver_mode = pb.SolverParameter.CPU
    return SGDSolver(param, device=device)


class Plain(nn.Module):
    """The same net as plain torch ops, built from the Caffe layer list (conv/pool/LRN/IP...)."""

    def __init__(self, net):
        super().__init__()
        self.ops, self.lr_mults, self.decay_mults = [], [], []
        params = []
        for layer in net.layer_list:
            lp, t = layer.param, layer.type
            if t == "Convolution":
                c = lp.convolution_param
                w = nn.Parameter(layer.blobs[0].detach().clone())
                b = nn.Parameter(layer.blobs[1].detach().clone())
                s, p = (c.stride[0] if c.stride else 1), (c.pad[0] if c.pad else 0)
                self.ops.append(lambda x, w=w, b=b, s=s, p=p, g=c.group: F.conv2d(x, w, b, s, p, 1, g))
                params += [w, b]
            elif t == "InnerProduct":
                w = nn.Parameter(layer.blobs[0].detach().clone())
                b = nn.Parameter(layer.blobs[1].detach().clone())
                self.ops.append(lambda x, w=w, b=b: F.linear(x.flatten(1), w, b))
                params += [w, b]
            elif t == "Pooling":
                c = lp.pooling_param
                pool = F.max_pool2d if c.pool == pb.PoolingParameter.MAX else F.avg_pool2d
                self.ops.append(lambda x, f=pool, k=c.kernel_size, s=c.stride: f(x, k, s, ceil_mode=True))
            elif t == "ReLU":
                self.ops.append(F.relu)
            elif t == "LRN":
                c = lp.lrn_param
                self.ops.append(lambda x, c=c: F.local_response_norm(x, c.local_size, c.alpha, c.beta, c.k))
            elif t == "Dropout":
                self.ops.append(lambda x, r=lp.dropout_param.dropout_ratio: F.dropout(x, r, True))
            elif t not in ("Input", "SoftmaxWithLoss"):
                raise ValueError(f"plain net: no op for {t}")
        self.params = nn.ParameterList(params)
        self.lr_mults, self.decay_mults = list(net.lr_mults), list(net.decay_mults)
        self.history = [torch.zeros_like(p) for p in params]

    def forward(self, x, y):
        for op in self.ops:
            x = op(x)
        return F.cross_entropy(x, y)

    def sgd_step(self, x, y, lr: float, momentum: float, weight_decay: float) -> float:
        for p in self.params:
            p.grad = None            # what optimizer.zero_grad() does by default
        loss = self(x, y)
        loss.backward()
        with torch.no_grad():
            for p, h, lm, dm in zip(self.params, self.history, self.lr_mults, self.decay_mults):
                if weight_decay * dm:
                    p.grad.add_(p, alpha=weight_decay * dm)
                h.mul_(momentum).add_(p.grad, alpha=lr * lm)
                p.sub_(h)
        return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=0, help="timed steps per side (default per net)")
    ap.add_argument("--nets", default=",".join(NETS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} torch={torch.__version__}")
    print(f"{'net':<14} {'batch':>5} {'brewnet ms':>11} {'plain ms':>9} {'ratio':>6} "
          f"{'brewnet it/s':>12} {'Caffe ms':>9} {'vs Caffe':>8}   (medians; min brewnet/plain)")
    for name in args.nets.split(","):
        solver_file, net_file, shape, batch, caffe_ms = NETS[name]
        brewnet.set_random_seed(1)
        solver = brewnet_solver(solver_file, net_file, shape, batch)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        y = rng.integers(0, 10, batch)
        solver.net.blobs["data" if "data" in solver.net.inputs else solver.net.inputs[0]].data[...] = x
        solver.net.blobs[solver.net.inputs[1]].data[...] = y
        plain = Plain(solver.net)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        p = solver.param
        lr = solver.lr

        def run_plain():
            plain.sgd_step(xt, yt, lr, p.momentum, p.weight_decay)

        first = (plain.sgd_step(xt, yt, lr, p.momentum, p.weight_decay), None)
        solver.step(1)
        first = (solver.loss, first[0])
        rounds = args.rounds or {"LeNet": 100, "CIFAR10-quick": 40, "CaffeNet": 15}.get(name, 20)
        tb, tp = [], []
        for _ in range(rounds):      # alternate single steps so both see the same machine load
            tb += timed(lambda: solver.step(1), 1)
            tp += timed(run_plain, 1)
        mb, mp = statistics.median(tb) * 1e3, statistics.median(tp) * 1e3
        lo = float(caffe_ms.split("-")[0])
        print(f"{name:<14} {batch:>5} {mb:>11.1f} {mp:>9.1f} {mb / mp:>6.2f} {1e3 / mb:>12.1f} "
              f"{caffe_ms:>9} {lo / mb:>7.1f}x   min {min(tb) * 1e3:.1f}/{min(tp) * 1e3:.1f} ms "
              f"(first-step loss brewnet {first[0]:.4f}, plain {first[1]:.4f})")


if __name__ == "__main__":
    main()
