"""Training speed per net against Caffe's, and per layer the kernel brewnet runs and the others.

    python benchmarks/train_speed.py [--nets lenet,cifar10_quick,caffenet] [--iterations 10]
                                     [--rounds 7] [--no-bits] [--nets-only] [--brewnet DIR]

Per net: ``brewnet time``'s forward + backward (``time_net``), a solver step, issue 39's
``caffe time`` (no reference build here) and the fraction of the fp32 peak (``torch.mm`` 2048^3 in the same
run, same threads; FLOPs: ``Layer.flops`` forward, twice that backward). Per layer: ms of each
candidate (median of ``--rounds``, interleaved), ``*`` on brewnet's; ``err``: largest difference
from float64 relative to the largest magnitude; ``bits``: the same on 1, 2 and 4 threads.
Convolutions on NHWC activations: oneDNN on NHWC, on NCHW (copied both ways), im2col + one GEMM
(col2im for the input gradient); the weight gradient as ``wgrad.choose`` runs it. InnerProduct
(forward + both gradients): MKL on one thread, on torch's threads (torch ops here, not a brewnet
kernel), oneDNN. MAX pooling: torch's kernel alone (composites: max_pool.py). ``--nets-only``:
the per-net table alone; ``--brewnet DIR``: import brewnet from another checkout (``git archive
<commit> | tar -x -C DIR``) for a before/after pair of processes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# --brewnet DIR is read before brewnet is imported
CHECKOUT = Path(sys.argv[sys.argv.index("--brewnet") + 1]).resolve() if "--brewnet" in sys.argv \
    else ROOT
sys.path.insert(0, str(CHECKOUT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import brewnet  # noqa: E402,F401,I001  (before torch: MKL's strict mode, OpenMP's passive wait)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from brewnet.analysis.timing import time_net  # noqa: E402
from brewnet.execution import determinism, process, wgrad  # noqa: E402
from brewnet.layers import functional as Fn  # noqa: E402
from brewnet.proto import caffe_pb2 as pb  # noqa: E402
from conv_wgrad import PROTOS, same_on  # noqa: E402
from train import NETS, brewnet_solver  # noqa: E402
from train_passes import train_net  # noqa: E402

CL = torch.channels_last
# issue 39: ``caffe time`` forward + backward on the reference CPU build, ms
CAFFE_MS = {"lenet": 22.6, "cifar10_quick": 184.0, "caffenet": 478.0}
SOLVER = {"lenet": "LeNet", "cifar10_quick": "CIFAR10-quick", "caffenet": "CaffeNet"}


def median_ms(fns: dict, rounds: int) -> dict:
    """{name: median ms} of each of ``fns``, one call of each per round (interleaved)."""
    for fn in fns.values():
        fn()
    got: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            got[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def same_bits(fn) -> bool:
    """``fn()``'s tensors are the same on 1, 2 and 4 torch threads, MKL on one thread each time
    as a training thread runs it."""
    def one():
        determinism.blas_on_one_thread()
        return [t.clone() for t in fn()]
    try:
        return same_on(one)
    finally:
        determinism.blas_on_one_thread()


def rel_err(got, ref) -> float:
    return max((g.double() - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
               for g, r in zip(got, ref))


def peak_gflops(seconds: float = 1.0) -> float:
    """fp32 ``torch.mm`` of 2048 x 2048 matrices on torch's threads (MKL on them too)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    with determinism.blas_on_torch_threads():
        a @ b
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9)
    return best


# -- convolution candidates (NHWC activations, as brewnet's CPU nets run) -----------------------
def _patches(x, kh, kw, stride, pad):
    """(N, OH, OW, KH, KW, C) view of NHWC ``x`` zero-padded by ``pad``."""
    xh = x.permute(0, 2, 3, 1)
    if any(pad):
        xh = F.pad(xh, (0, 0, pad[1], pad[1], pad[0], pad[0]))
    n, h, w, c = xh.shape
    oh, ow = (h - kh) // stride[0] + 1, (w - kw) // stride[1] + 1
    s = xh.stride()
    return xh.as_strided((n, oh, ow, kh, kw, c), (s[0], s[1] * stride[0], s[2] * stride[1],
                                                  s[1], s[2], s[3]))


def gemm_forward(x, w, b, stride, pad, groups):
    """im2col of the NHWC input (rows: pixels, columns: (kh, kw, c)) and one GEMM per group:
    the output comes out NHWC."""
    o, cg, kh, kw = w.shape
    p = _patches(x, kh, kw, stride, pad)
    n, oh, ow = p.shape[:3]
    outs = []
    for g in range(groups):
        cols = p[..., g * cg:(g + 1) * cg].reshape(n * oh * ow, kh * kw * cg)
        wg = w[g * (o // groups):(g + 1) * (o // groups)].permute(0, 2, 3, 1).reshape(o // groups, -1)
        outs.append(cols @ wg.t())
    y = outs[0] if groups == 1 else torch.cat(outs, 1)
    if b is not None:
        y += b
    return y.view(n, oh, ow, o).permute(0, 3, 1, 2)


def gemm_input_grad(dy, x, w, stride, pad, groups):
    """One GEMM per group (columns of the input gradient) and col2im (``F.fold``)."""
    o, cg, kh, kw = w.shape
    n, _, oh, ow = dy.shape
    d = dy.permute(0, 2, 3, 1).reshape(n * oh * ow, o)
    cols = []
    for g in range(groups):
        og = o // groups
        cols.append((d[:, g * og:(g + 1) * og] @ w[g * og:(g + 1) * og].reshape(og, -1))
                    .view(n, oh * ow, cg * kh * kw))
    cols = torch.cat(cols, 2).transpose(1, 2)
    return F.fold(cols, tuple(x.shape[2:]), (kh, kw), 1, tuple(pad), tuple(stride))


def conv_rows(name, x_shape, w_shape, stride, pad, groups, rounds, bits, need_dx):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=gen).contiguous(memory_format=CL)
    w = torch.randn(w_shape, generator=gen) * 0.1
    b = torch.randn(w_shape[0], generator=gen)
    xd, wd, bd = x.double(), w.double(), b.double()
    y64 = F.conv2d(xd, wd, bd, stride, pad, 1, groups)
    dy = torch.randn(y64.shape, generator=gen).contiguous(memory_format=CL)
    dx64 = torch.nn.grad.conv2d_input(xd.shape, wd, dy.double(), stride, pad, 1, groups)
    dw64 = torch.nn.grad.conv2d_weight(xd, wd.shape, dy.double(), stride, pad, 1, groups)
    xn, dyn = x.contiguous(), dy.contiguous()
    conv = (stride, pad, (1, 1), groups)

    def dnn_dx(d, i):
        return determinism.onednn_backward(d, i, w, *conv, [True, False, False])[0]

    fwd = {"oneDNN NHWC*": lambda: F.conv2d(x, w, b, stride, pad, 1, groups),
           "oneDNN NCHW": lambda: F.conv2d(xn.contiguous(), w, b, stride, pad, 1, groups)
           .contiguous(memory_format=CL),
           "im2col+GEMM": lambda: gemm_forward(x, w, b, stride, pad, groups)}
    dxs = {"oneDNN NHWC*": lambda: dnn_dx(dy, x),
           "oneDNN NCHW": lambda: dnn_dx(dyn.contiguous(), xn).contiguous(memory_format=CL),
           "GEMM+col2im": lambda: gemm_input_grad(dy, x, w, stride, pad, groups)}
    how, k = wgrad.choose(x, w, stride, pad, (1, 1), groups)
    wg = {f"{how}{f' x{k}' if how.startswith('chunks') else ''}*":
          lambda: wgrad.weight_grad(dy, x, w, stride, pad, (1, 1), groups)}
    rows = [(name, "forward", fwd, lambda f: rel_err([f()], [y64]))]
    if need_dx:
        rows.append((name, "input grad", dxs, lambda f: rel_err([f()], [dx64])))
    rows.append((name, "weight grad", wg, lambda f: rel_err(f()[:1], [dw64])))
    return [(n, what, median_ms(fns, rounds), {k: err(f) if err else None for k, f in fns.items()},
             {k: same_bits(lambda f=f: _tuple(f())) if bits else None for k, f in fns.items()})
            for n, what, fns, err in rows]


def _tuple(t):
    return t if isinstance(t, tuple) else (t,)


def ip_rows(name, m, k, n, rounds, bits):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1
    b, dy = torch.randn(n, generator=gen), torch.randn(m, n, generator=gen)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    ref = [xd @ wd.t() + b.double(), dyd @ wd, dyd.t() @ xd]
    lin = Fn._dnn_linear()

    def blas():
        return torch.addmm(b, x, w.t()), dy @ w, dy.t() @ x

    def blas_threads():
        with determinism.blas_on_torch_threads():
            return blas()

    def dnn():
        return lin(x, w, b), lin(dy, w.t(), None), lin(dy.t().contiguous(), x.t().contiguous(), None)

    # functional.inner_product's rule: oneDNN by weight size, else MKL (one thread when training)
    big = w.numel() >= Fn.DNN_MIN_WEIGHT and lin is not None
    runs = "oneDNN" if big else "MKL 1 thread"
    fns = {"MKL 1 thread": blas, "MKL torch threads": blas_threads}
    if lin is not None:
        fns["oneDNN"] = dnn
    fns = {(f"{key}*" if key == runs else key): f for key, f in fns.items()}
    return [(name, "fwd+grads", median_ms(fns, rounds),
             {key: rel_err(f(), ref) for key, f in fns.items()},
             {key: same_bits(f) if bits else None for key, f in fns.items()})]


def pool_rows(name, shape, k, s, pad, rounds, bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(shape, generator=gen)).contiguous(memory_format=CL)
    y, idx = F.max_pool2d(x, k, s, pad, ceil_mode=True, return_indices=True)
    dy = torch.randn(y.shape, generator=gen).contiguous(memory_format=CL)
    op = torch.ops.aten.max_pool2d_with_indices_backward

    def fwd_bwd():
        y, i = F.max_pool2d(x, k, s, pad, ceil_mode=True, return_indices=True)
        return y, op(dy, x, [k, k], [s, s], [pad, pad], [1, 1], True, i)

    fns = {"torch max_pool2d*": fwd_bwd}
    return [(name, "fwd+bwd", median_ms(fns, rounds), {"torch max_pool2d*": 0.0},
             {"torch max_pool2d*": same_bits(fwd_bwd) if bits else None})]


def layer_rows(net, rounds, bits):
    out = []
    for layer, bottoms in zip(net.layer_list, net.bottom_lists):
        shape = tuple(net.shapes[bottoms[0]]) if bottoms else ()
        if layer.type == "Convolution":
            out += conv_rows(layer.name, shape, tuple(layer.blobs[0].shape), tuple(layer.stride),
                             tuple(layer.pad), layer.group, rounds, bits,
                             need_dx=bottoms[0] != "data")
        elif layer.type == "InnerProduct":
            m = shape[0]
            kk = int(torch.tensor(shape[1:]).prod())
            out += ip_rows(layer.name, m, kk, layer.blobs[0].shape[0], rounds, bits)
        elif layer.type == "Pooling" and layer.param.pooling_param.pool == pb.PoolingParameter.MAX:
            out += pool_rows(layer.name, shape, layer.kernel[0], layer.stride[0], layer.pad[0],
                             rounds, bits)
    return out


def net_flops(net) -> float:
    """Forward FLOPs of the layers that count them, times three (the backward is about twice)."""
    total = 0
    for layer, bottoms, tops in zip(net.layer_list, net.bottom_lists, net.top_lists):
        total += layer.flops([net.shapes[b] for b in bottoms], [net.shapes[t] for t in tops])
    return 3.0 * total


def step_ms(key, iterations: int) -> float:
    solver_file, net_file, shape, batch, _ = NETS[SOLVER[key]]
    solver = brewnet_solver(solver_file, net_file, shape, batch)
    net = solver.net
    gen = torch.Generator().manual_seed(1)
    net.blobs["data"].tensor.copy_(torch.rand(net.blobs["data"].shape, generator=gen))
    net.blobs["label"].tensor.copy_(torch.randint(0, 10, (batch,), generator=gen).float())
    solver.step(3)
    ts = []
    for _ in range(iterations):
        t = time.perf_counter()
        solver.step(1)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="lenet,cifar10_quick,caffenet")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-bits", action="store_true", help="skip the 1/2/4-thread bits column")
    ap.add_argument("--nets-only", action="store_true", help="the per-net table alone")
    ap.add_argument("--brewnet", help="a checkout whose brewnet is imported instead of this one")
    a = ap.parse_args()
    process.configure(torch.device("cpu"), keep_memory=True)
    nets, per_layer = [], []
    for key in a.nets.split(","):
        shape = PROTOS[key][1]
        net, n_threads = train_net(key)
        fb = statistics.median(time_net(net, a.iterations, warmup=2).iteration_ms)
        peak = peak_gflops()
        step = step_ms(key, a.iterations)
        nets.append((key, shape[0], n_threads, fb, step, CAFFE_MS[key],
                     net_flops(net) / (min(fb, step) * 1e-3) / 1e9 / peak, peak))
        if not a.nets_only:
            per_layer += [(key, *r) for r in layer_rows(net, a.rounds, not a.no_bits)]
    print(f"brewnet from {brewnet.__file__}; torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}; median of {a.iterations} passes / steps\n")
    print("| net | batch | threads | fwd+bwd ms | solver step ms | Caffe ms (issue 39) | "
          "Caffe / brewnet | fp32 peak (GFLOP/s) | peak fraction |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, batch, nt, fb, step, caffe, frac, peak in nets:
        print(f"| {key} | {batch} | {nt} | {fb:.1f} | {step:.1f} | {caffe:g} | "
              f"{caffe / min(fb, step):.2f}x | {peak:.0f} | {frac:.1%} |")
    if a.nets_only:
        return
    print(f"\nPer layer: ms of each candidate (median of {a.rounds} interleaved rounds, on the "
          "net's threads); * the one brewnet runs; err vs float64 (relative); bits: same on "
          "1, 2, 4 threads\n")
    print("| net | layer | pass | candidate: ms (err, bits) | fastest / brewnet's |")
    print("|---|---|---|---|---|")
    for key, name, what, ms, err, bits in per_layer:
        cells = []
        for cand, v in ms.items():
            e = "" if err.get(cand) is None else f"{err[cand]:.0e}"
            bt = "" if bits.get(cand) is None else ("y" if bits[cand] else "n")
            extra = ", ".join(s for s in (e, bt) if s)
            cells.append(f"{cand} {v:.2f}" + (f" ({extra})" if extra else ""))
        mine = next(v for c, v in ms.items() if c.endswith("*"))
        print(f"| {key} | {name} | {what} | {'; '.join(cells)} | {min(ms.values()) / mine:.2f} |")


if __name__ == "__main__":
    main()
