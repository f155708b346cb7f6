"""Data pipeline speed: LMDB read + decode + transform rate, and the share of training time
spent waiting for data when LeNet and CIFAR10-quick train from LMDB.

    python benchmarks/data.py [--iters 150] [--cifar-iters 40] [--skip-train]

Datasets, built in a temporary folder: MNIST t10k (real, converted with convert_mnist from
../shared), a CIFAR-shaped LMDB of 10,000 random 3x32x32 images (CIFAR-10 itself is not on
this machine; the reader cannot tell the difference) with its compute_mean file, and an
ImageNet-shaped LMDB of 600 JPEG-encoded 256x256 records (the sample images, re-encoded).

Rates: one thread, the layer's own loader (read + parse + decode + transform into a batch),
no prefetch, best of 3. Training: the nets' real solvers and train_test prototxts with the
sources pointed at those LMDBs; ``wait`` is the time the Data layer's forward blocked on the
prefetch queue (or, loading in the forward pass, spent loading), as a share of the iteration
time; "unset" leaves data_param.prefetch out, so the layer makes its own timed choice.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT.parent / "shared" / "caffe-models"
MNIST = MODELS / "trained" / "mnist_t10k" / "data" / "mnist"

import brewnet  # noqa: E402
from brewnet.data.convert import compute_mean, convert_imageset, convert_mnist  # noqa: E402
from brewnet.data.db import open_writer  # noqa: E402
from brewnet.data.prefetch import data_busy, plan_threads, usable_cores  # noqa: E402
from brewnet.proto import caffe_pb2 as pb  # noqa: E402
from brewnet.proto.io import read_net, read_solver  # noqa: E402
from brewnet.solvers import SGDSolver  # noqa: E402


def make_data(tmp: Path) -> dict:
    convert_mnist(MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz",
                  tmp / "mnist", progress=False)
    rng = np.random.default_rng(0)
    with open_writer(tmp / "cifar") as w:
        for i in range(10000):
            d = pb.Datum(channels=3, height=32, width=32, label=int(rng.integers(10)),
                         data=rng.integers(0, 256, 3 * 32 * 32, dtype=np.uint8).tobytes())
            w.put(f"{i:05d}", d.SerializeToString())
    compute_mean(tmp / "cifar", tmp / "cifar_mean.binaryproto", progress=False)
    images = [MODELS / "images" / n for n in ("astronaut.png", "chelsea.png", "coffee.png")] + \
             [MODELS / "bvlc/examples/images" / n for n in ("cat.jpg", "fish-bike.jpg", "cat_gray.jpg")]
    (tmp / "list.txt").write_text("".join(f"{images[i % 6]} {i % 6}\n" for i in range(600)))
    convert_imageset("", tmp / "list.txt", tmp / "jpeg", resize_height=256, resize_width=256,
                     encode_type="jpg", progress=False)
    return {"mnist": tmp / "mnist", "cifar": tmp / "cifar", "mean": tmp / "cifar_mean.binaryproto",
            "jpeg": tmp / "jpeg"}


def data_layer(source, batch, transform, phase=pb.TRAIN):
    net = brewnet.Net(f'''layer {{ name: "d" type: "Data" top: "data" top: "label"
        data_param {{ source: "{source}" batch_size: {batch} backend: LMDB prefetch: 0 }}
        transform_param {{ {transform} }} }}''', phase)
    return net.layer_list[0]


def rate(layer, batches: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(batches):
            layer.loader()
        best = min(best, time.perf_counter() - t0)
    return batches * layer.shapes[0][0] / best


def rates(data: dict) -> None:
    print("\nLMDB read + decode + transform, one thread, records/s")
    print(f"{'records':<26} {'transform':<58} {'records/s':>10}")
    rows = [
        ("MNIST raw 1x28x28", data["mnist"], 64, "scale: 0.00390625"),
        ("CIFAR-shape raw 3x32x32", data["cifar"], 100, f'mean_file: "{data["mean"]}"'),
        ("CIFAR-shape raw 3x32x32", data["cifar"], 100,
         f'mean_file: "{data["mean"]}" crop_size: 28 mirror: true'),
        ("JPEG 256x256 (encoded)", data["jpeg"], 32,
         "crop_size: 227 mirror: true mean_value: 104 mean_value: 117 mean_value: 123"),
    ]
    for name, src, batch, transform in rows:
        layer = data_layer(src, batch, transform)
        n = 20 if "JPEG" in name else 100
        short = transform.replace(f' "{data["mean"]}"', " mean.binaryproto").replace(
            "104 mean_value: 117 mean_value: 123", "104,117,123")
        print(f"{name:<26} {short:<58} {rate(layer, n):>10,.0f}")


def solver_for(solver_file, net_file, sources: dict, mean=None, prefetch=None) -> SGDSolver:
    param = read_solver(MODELS / solver_file)
    net = read_net(MODELS / net_file)
    for lp in net.layer:
        if lp.type == "Data":
            lp.data_param.source = str(sources["train" if any(r.phase == pb.TRAIN for r in lp.include) else "test"])
            if lp.transform_param.HasField("mean_file"):
                lp.transform_param.mean_file = str(mean)
            if prefetch is not None:          # None: unset, the layer's own timed choice
                lp.data_param.prefetch = prefetch
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    param.test_initialization = False
    param.display = 0
    param.snapshot = 0
    param.snapshot_prefix = str(Path(tempfile.gettempdir()) / "brewnet_bench")
    param.solver_mode = pb.SolverParameter.CPU
    return SGDSolver(param)


def train_share(name, make, iters: int, configs, rounds: int = 3) -> None:
    """Interleaved rounds (the machine is shared and noisy): median ms/iter, total wait share.
    ``threads`` None: planned from the producer's measured load over 20 warm-up iterations."""
    runs = []
    for label, threads, prefetch in configs:
        solver = make(prefetch)
        layer = next(l for l in solver.net.layer_list if l.type == "Data")
        if threads is None:
            torch.set_num_threads(usable_cores())
            t0 = time.perf_counter()
            solver.step(20)
            busy = data_busy([solver.net], time.perf_counter() - t0)
            threads = plan_threads(busy, apply=False)
            label += f" (busy {busy:.2f})"
        runs.append((label, threads, solver, layer, [], []))
    for _ in range(rounds):
        for label, threads, solver, layer, times, waits in runs:
            torch.set_num_threads(threads)
            solver.step(3)                               # warm up, refill the queue
            w0, t0 = layer.data_wait_s, time.perf_counter()
            solver.step(iters)
            times.append(time.perf_counter() - t0)
            waits.append(layer.data_wait_s - w0)
    for label, threads, solver, layer, times, waits in runs:
        ms = 1e3 * float(np.median(times)) / iters
        print(f"{name:<15} {label:<34} {threads:>7} {ms:>9.1f} {1e3 * sum(waits) / (iters * rounds):>9.2f} "
              f"{100 * sum(waits) / sum(times):>7.1f}%")
        if layer.prefetcher is not None:
            layer.prefetcher.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=100, help="LeNet iterations per configuration and round")
    ap.add_argument("--cifar-iters", type=int, default=20, help="CIFAR10-quick iterations per round")
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cores = usable_cores()
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp))
        rates(data)
        if args.skip_train:
            return
        configs = [("prefetch 4, planned", None, 4),
                   ("prefetch 4, 1 torch thread", 1, 4),
                   ("prefetch 4, torch threads = cores", cores, 4),
                   ("prefetch 0 (load in forward)", cores, 0),
                   ("prefetch unset (timed choice)", cores, None)]
        print(f"\nTraining from LMDB on {cores} cores: wait = Data forward blocked on the queue")
        print(f"{'net':<15} {'configuration':<34} {'threads':>7} {'ms/iter':>9} {'wait ms':>9} {'wait':>8}")
        mnist = {"train": data["mnist"], "test": data["mnist"]}
        cifar = {"train": data["cifar"], "test": data["cifar"]}
        train_share("LeNet", lambda pf: solver_for("bvlc/examples/mnist/lenet_solver.prototxt",
                                                   "bvlc/examples/mnist/lenet_train_test.prototxt", mnist,
                                                   prefetch=pf),
                    args.iters, configs)
        train_share("CIFAR10-quick", lambda pf: solver_for(
            "bvlc/examples/cifar10/cifar10_quick_solver.prototxt",
            "bvlc/examples/cifar10/cifar10_quick_train_test.prototxt", cifar, data["mean"], prefetch=pf),
            args.cifar_iters, configs)


if __name__ == "__main__":
    main()
