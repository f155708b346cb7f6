"""Same bits on 1, 2 and 4 torch threads? Per layer, per net, per mode, with the step time.

    python benchmarks/thread_bits.py [--nets lenet,cifar10_quick,ip,caffenet] [--steps 5]
                                     [--threads 1,2,4] [--repeat 3]

For each net (LeNet batch 64, CIFAR10-quick batch 100, the single-InnerProduct MNIST net batch
100, CaffeNet-like: CaffeNet's train net at batch 8, Caffe's LeNet/CIFAR-10/CaffeNet prototxts
with the data layers replaced by random inputs):

- **layers**: each layer's forward and backward alone (``Net.forward_layer``/``backward_layer``)
  on the same bottoms and top diffs at each thread count; a row per layer whose tops, bottom
  diffs or parameter gradients differ from one thread (none: "every layer the same bits").
- **runs**: ``--steps`` SGD steps (momentum, weight decay) from the same weights at each thread
  count, default mode and deterministic mode (``brewnet.set_deterministic``): do the final
  weights equal the one-thread run's, and the step time (median of ``--repeat`` timed rounds,
  the modes and counts alternated in each round: the machine is shared).

Counts above the cores oversubscribe them (timed anyway; bits still meaningful).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import brewnet  # noqa: E402  (first: a user's import order, brewnet/execution/threads.py)
from brewnet import determinism  # noqa: E402
from brewnet.net import Net  # noqa: E402
from brewnet.proto import caffe_pb2 as pb  # noqa: E402
from brewnet.proto.io import read_net  # noqa: E402

MODELS = ROOT / "tests" / "data" / "caffe-models" / "bvlc"
IP = """name: "ip" layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 100 dim: 1 dim: 28 dim: 28 } shape { dim: 100 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }"""


def with_input(path: Path, shape) -> pb.NetParameter:
    """The TRAIN net of ``path`` with its data layers replaced by one Input (data, label)."""
    p = read_net(str(path))
    out = pb.NetParameter(name=p.name)
    inp = out.layer.add(name="data", type="Input")
    inp.top.extend(["data", "label"])
    inp.input_param.shape.add().dim.extend(shape)
    inp.input_param.shape.add().dim.extend([shape[0]])
    for layer in p.layer:
        if layer.type in ("Data", "ImageData", "HDF5Data") or any(
                r.phase == pb.TEST for r in layer.include):
            continue
        out.layer.add().CopyFrom(layer)
    return out


def nets() -> dict:
    return {
        "lenet": (with_input(MODELS / "examples/mnist/lenet_train_test.prototxt", [64, 1, 28, 28]), 10),
        "cifar10_quick": (with_input(MODELS / "examples/cifar10/cifar10_quick_train_test.prototxt",
                                     [100, 3, 32, 32]), 10),
        "ip": (text_format.Parse(IP, pb.NetParameter()), 10),
        "caffenet": (with_input(MODELS / "models/bvlc_reference_caffenet/train_val.prototxt",
                                [8, 3, 227, 227]), 1000),
    }


def fill_inputs(net: Net, classes: int) -> None:
    gen = torch.Generator().manual_seed(1)
    shape = net.blobs["data"].shape
    net.blobs["data"].tensor.copy_(torch.rand(shape, generator=gen))
    net.blobs["label"].tensor.copy_(torch.randint(0, classes, (shape[0],), generator=gen).float())


def layer_rows(name: str, param, classes: int, counts) -> list[str]:
    """Per layer alone: (layer, type, what differs, thread count, largest relative difference)."""
    determinism.counts()          # the counts a default run may use, before this sets its own
    torch.manual_seed(0)
    net = Net(param, pb.TRAIN)
    fill_inputs(net, classes)
    torch.set_num_threads(1)
    net.forward_tensors()
    net.backward_tensors()
    saved = {n: (b.tensor.detach().clone(), b.diff_tensor.clone()) for n, b in net.blobs.items()}
    rows = []
    for i, layer in enumerate(net.layer_list):
        if layer.type == "Input":
            continue
        got = {}
        for n in counts:
            torch.set_num_threads(n)
            for b, (data, diff) in saved.items():
                net.blobs[b].tensor.copy_(data)
                net.blobs[b].write_diff(diff.clone())
            for p in layer.blobs:
                p.grad = None
            torch.manual_seed(0)         # Dropout's mask: the same draw at every count
            net.forward_layer(i)
            tops = [net.blobs[t].tensor.detach().clone() for t in net.top_lists[i]]
            for t, (_, diff) in zip(net.top_lists[i], (saved[t] for t in net.top_lists[i])):
                net.blobs[t].write_diff(diff.clone())
            net.backward_layer(i)
            diffs = [net.blobs[b].diff_tensor.clone() for b in net.bottom_lists[i]]
            grads = [p.grad.clone() for p in layer.blobs if p.grad is not None]
            got[n] = {"top": tops, "bottom diff": diffs, "param grad": grads}
        for n in counts[1:]:
            for what in ("top", "bottom diff", "param grad"):
                for a, b in zip(got[counts[0]][what], got[n][what]):
                    if not torch.equal(a, b):
                        rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
                        rows.append(f"| {name} | {layer.name} ({layer.type}) | {what} | "
                                    f"{counts[0]} vs {n} | {rel:.1e} |")
    return rows


def write_solver(folder: Path, name: str, param) -> Path:
    net = folder / f"{name}.prototxt"
    net.write_text(text_format.MessageToString(param))
    solver = folder / f"{name}_solver.prototxt"
    solver.write_text(f'net: "{net}" base_lr: 0.001 momentum: 0.9 weight_decay: 0.0005 '
                      f'lr_policy: "fixed" max_iter: 1000000 display: 0 snapshot: 0 '
                      f'random_seed: 7 snapshot_prefix: "{folder / name}"')
    return solver


def run(solver_path: Path, classes: int, threads: int, deterministic: bool, steps: int):
    """Final weights after ``steps`` steps and seconds per step (the last step: warmed up)."""
    brewnet.set_deterministic(deterministic)
    torch.set_num_threads(threads)
    s = brewnet.get_solver(str(solver_path))
    fill_inputs(s.net, classes)
    s.step(1)
    tic = time.perf_counter()
    s.step(steps)
    dt = (time.perf_counter() - tic) / steps
    return [p.detach().clone() for p in s.net.learnable], dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="lenet,cifar10_quick,ip,caffenet")
    ap.add_argument("--threads", default="1,2,4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    counts = [int(c) for c in a.threads.split(",")]
    print(f"oneDNN weight gradients checked on {determinism.counts()} threads (a default run's)")
    all_nets = nets()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, MKL strict: "
          f"{determinism.mkl_strict()}, thread counts {counts}\n")
    print("Per layer alone (forward and backward), what differs from one thread:\n")
    print("| net | layer | differs | threads | max rel diff |\n|---|---|---|---|---|")
    for name in a.nets.split(","):
        rows = layer_rows(name, *all_nets[name], counts)
        print("\n".join(rows) if rows else f"| {name} | every layer the same bits | | | |")
    print(f"\nWhole runs ({a.steps} SGD steps, momentum and decay): same final weights as the "
          "one-thread run of its mode, and ms per step (median of rounds, modes alternated)\n")
    print("| net | mode | " + " | ".join(f"{n} thr bits | {n} thr ms" for n in counts) + " |")
    print("|---|---|" + "---|---|" * len(counts))
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.nets.split(","):
            param, classes = all_nets[name]
            path = write_solver(Path(tmp), name, param)
            times = {(m, n): [] for m in (False, True) for n in counts}
            final = {}
            for _ in range(a.repeat):
                for n in counts:
                    for mode in (False, True):
                        w, dt = run(path, classes, n, mode, a.steps)
                        final[(mode, n)] = w
                        times[(mode, n)].append(dt)
            for mode in (False, True):
                cells = []
                for n in counts:
                    same = all(torch.equal(x, y) for x, y in zip(final[(mode, counts[0])],
                                                                  final[(mode, n)]))
                    cells.append(f"{'same' if same else 'DIFFER'} | "
                                 f"{statistics.median(times[(mode, n)]) * 1e3:.1f}")
                print(f"| {name} | {'deterministic' if mode else 'default'} | "
                      + " | ".join(cells) + " |")
    brewnet.set_deterministic(False)


if __name__ == "__main__":
    main()
