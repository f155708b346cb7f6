"""A convolution's weight gradient, per convolution: the per-image path, oneDNN, and the chunks.

    python benchmarks/conv_wgrad.py [--nets lenet,cifar10_quick,caffenet,mobilenet,resnet]
                                    [--rounds 5] [--threads 2] [--no-per-image]
    python benchmarks/conv_wgrad.py --profile cifar10_quick [--iterations 5]

Every convolution of LeNet (batch 64), CIFAR10-quick (batch 100) and CaffeNet (batch 10, as
``brewnet time`` of the CaffeNet-like net), from the BVLC prototxts, and a MobileNet depthwise
3x3 and pointwise 1x1 and a ResNet block's 3x3 and 1x1 (batch 16). Columns, ms of the weight and
bias gradient (median of ``--rounds``, the candidates interleaved in each round: the machine may
be shared):

- ``per-image``: Caffe's im2col and one product per image (``determinism.per_image_wgrad``,
  the previous fallback);
- ``oneDNN``: torch's own, on all ``--threads``; ``same`` says whether 1, 2 and 4 threads gave it
  the same bits (the previous rule kept it only then);
- ``chunks oneDNN`` / ``chunks GEMM``: ``brewnet/execution/wgrad.py``'s chunks (one thread each,
  in parallel) by each kernel; both always the same bits on 1, 2 and 4 threads (checked: ``bits``);
- ``old``: what the previous rule ran; ``chosen``: the path ``wgrad.choose`` picks here;
- ``err``: the chosen path's largest difference from a float64 weight gradient, relative to its
  largest magnitude.

``--profile NET``: torch.profiler's top ops (self CPU) over ``--iterations`` forward + backward
passes of the net (``brewnet time``'s pass) with the previous rule (``BREWNET_CONV_WGRAD=old``)
and with the chunks, in one process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# brewnet before torch, as the CLI: MKL's strict mode, and OpenMP's passive wait (a spinning
# OpenMP thread of the caller steals a chunk worker's core)
import brewnet  # noqa: E402,F401,I001
import torch  # noqa: E402
from brewnet.execution import determinism, wgrad  # noqa: E402
from brewnet.net import Net  # noqa: E402
from brewnet.proto import caffe_pb2 as pb  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from thread_bits import MODELS, with_input  # noqa: E402

# (x shape, w shape, stride, pad, groups) of the nets not in the BVLC tree
EXTRA = {
    "mobilenet": [("conv2_1/dw", (16, 32, 112, 112), (32, 1, 3, 3), 1, 1, 32),
                  ("conv2_1/sep", (16, 32, 112, 112), (64, 32, 1, 1), 1, 0, 1)],
    "resnet": [("res2a_branch2b", (16, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1),
               ("res2a_branch2c", (16, 64, 56, 56), (256, 64, 1, 1), 1, 0, 1)],
}
PROTOS = {
    "lenet": ("examples/mnist/lenet_train_test.prototxt", [64, 1, 28, 28]),
    "cifar10_quick": ("examples/cifar10/cifar10_quick_train_test.prototxt", [100, 3, 32, 32]),
    "caffenet": ("models/bvlc_reference_caffenet/train_val.prototxt", [10, 3, 227, 227]),
}


def convolutions(name: str):
    """(layer, x shape, w shape, stride, pad, groups) of each 2-D convolution of net ``name``."""
    if name in EXTRA:
        return [(n, x, w, (s, s), (p, p), g) for n, x, w, s, p, g in EXTRA[name]]
    path, shape = PROTOS[name]
    net = Net(with_input(MODELS / path, shape), pb.TRAIN)
    return [(layer.name, net.shapes[bottoms[0]], tuple(layer.blobs[0].shape), tuple(layer.stride),
             tuple(layer.pad), layer.group)
            for layer, bottoms in zip(net.layer_list, net.bottom_lists)
            if layer.type == "Convolution"]


def same_on(fn, counts=(1, 2, 4)) -> bool:
    ref = None
    before = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            got = fn()
            if ref is None:
                ref = got
            elif not all(torch.equal(a, b) for a, b in zip(ref, got)):
                return False
        return True
    finally:
        torch.set_num_threads(before)


def profile(name: str, iterations: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from brewnet.analysis.timing import time_net

    path, shape = PROTOS[name]
    net = Net(with_input(MODELS / path, shape), pb.TRAIN)
    gen = torch.Generator().manual_seed(1)
    net.blobs["data"].tensor.copy_(torch.rand(net.blobs["data"].shape, generator=gen))
    net.blobs["label"].tensor.copy_(torch.randint(0, 10, (shape[0],), generator=gen).float())
    for how in ("old", "auto"):
        os.environ["BREWNET_CONV_WGRAD"] = how
        time_net(net, 2)
        with prof(activities=[ProfilerActivity.CPU]) as p:
            t = time_net(net, iterations, warmup=0)
        ms = (t.forward_total_ms + t.backward_total_ms) / iterations
        print(f"\n### {name}, BREWNET_CONV_WGRAD={how}: {ms:.1f} ms a forward + backward "
              f"({torch.get_num_threads()} threads)\n")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    os.environ.pop("BREWNET_CONV_WGRAD")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="lenet,cifar10_quick,caffenet,mobilenet,resnet")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-per-image", action="store_true", help="skip the slow per-image column")
    ap.add_argument("--profile", metavar="NET", help="torch.profiler tables of NET, old and new")
    ap.add_argument("--iterations", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.profile:
        return profile(a.profile, a.iterations)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.rounds} interleaved "
          f"rounds, ms of one weight + bias gradient\n")
    print("| net | layer | x | w | per-image | oneDNN (same) | chunks oneDNN | chunks GEMM | old "
          "| chosen | bits | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for net in a.nets.split(","):
        for layer, xs, ws, stride, pad, g in convolutions(net):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(xs, generator=gen)
            w = torch.randn(ws, generator=gen) * 0.1
            with torch.no_grad():
                dy = torch.randn(torch.nn.functional.conv2d(x, w, None, stride, pad, 1, g).shape,
                                 generator=gen)
            dil = (1, 1)
            k = wgrad.chunks(xs, ws, dy.shape[2:])
            how, _ = wgrad.choose(x, w, stride, pad, dil, g)
            kernel = {"oneDNN": "oneDNN", "per-image": "per-image"}.get(how, how[len("chunks/"):])
            inv = determinism.onednn_invariant(x, w, stride, pad, dil, g)

            def chunked(name):
                return lambda: wgrad._run(dy, x, w, stride, pad, dil, g, name, k)

            cands = {"per-image": lambda: determinism.per_image_wgrad(dy, x, w, stride, pad, dil,
                                                                      g, True),
                     "oneDNN": lambda: determinism.onednn_backward(dy, x, w, stride, pad, dil, g,
                                                                   [False, True, True])[1:],
                     "onednn": chunked("onednn"), "gemm": chunked("gemm")}
            if a.no_per_image:
                del cands["per-image"]
            bits = same_on(cands["onednn"]) and same_on(cands["gemm"])
            ref = determinism.onednn_backward(dy.double(), x.double(), w.double(), stride, pad,
                                              dil, g, [False, True, False])[1]
            err = ((cands[kernel]()[0].double() - ref).abs().max() / ref.abs().max()).item()
            times = {n: [] for n in cands}
            for f in cands.values():
                f()
            for _ in range(a.rounds):
                for n, f in cands.items():
                    t0 = time.perf_counter()
                    f()
                    times[n].append(time.perf_counter() - t0)
            ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            old = "oneDNN" if inv else "per-image"
            print(f"| {net} | {layer} | {'x'.join(map(str, xs))} | {'x'.join(map(str, ws))}"
                  f"{'/g' + str(g) if g > 1 else ''} | {ms.get('per-image', float('nan')):.2f} | "
                  f"{ms['oneDNN']:.2f} ({'yes' if inv else 'no'}) | {ms['onednn']:.2f} | "
                  f"{ms['gemm']:.2f} | {old} | {how} | {'same' if bits else 'DIFFER'} | "
                  f"{err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
