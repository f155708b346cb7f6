"""What ``precision="bf16"`` costs in accuracy and gives in speed, on trained models and real inputs.

    python benchmarks/bf16.py [--images DIR] [--reps 9]

Models (../shared/caffe-models/trained): open_nsfw (ResNet-50 1by2) on real photographs (every
.jpg/.png in ``--images``, default Debian opencv-doc's examples/data, plus
../shared/caffe-models/images), resized to 256 and centre-cropped to 224, BGR minus its mean
(104, 117, 123); LeNet (two trained copies) on the 10,000 MNIST t10k digits scaled by 1/256, with
their labels; the CIFAR-10 quick and full nets on the same photographs resized to 32x32 minus 128
(no CIFAR images here: agreement with fp32 only). Columns: top-1 agreement with fp32, accuracy
where labels exist, the largest and mean |probability difference|, then ms per forward at batch
1 and 16 of fp32 (engine eager) and bf16, interleaved, median, and the speed-up.
"""
from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "caffe-models"
TRAINED = SHARED / "trained"
OPENCV_DATA = Path("/usr/share/doc/opencv-doc/examples/data")   # Debian's opencv-doc


def photos(folder: Path, size: int, crop: int, mean) -> np.ndarray:
    import cv2

    files = sorted(p for d in (folder, SHARED / "images") if d.is_dir() for p in d.iterdir()
                   if p.suffix.lower() in (".jpg", ".png"))
    out = []
    for f in files:
        im = cv2.imread(str(f), cv2.IMREAD_COLOR)
        if im is None or min(im.shape[:2]) < 32:
            continue
        im = cv2.resize(im, (size, size), interpolation=cv2.INTER_LINEAR).astype(np.float32)
        o = (size - crop) // 2
        out.append((im[o:o + crop, o:o + crop] - np.asarray(mean, np.float32)).transpose(2, 0, 1))
    return np.stack(out)


def mnist() -> tuple[np.ndarray, np.ndarray]:
    d = TRAINED / "mnist_t10k/data/mnist"
    with gzip.open(d / "t10k-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(d / "t10k-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return x.astype(np.float32) / 256, y


def run_all(net, x: np.ndarray, out: str, batch: int = 100) -> np.ndarray:
    res = []
    for i in range(0, len(x), batch):
        xb = x[i:i + batch]
        res.append(net.forward(**{net.inputs[0]: xb})[out].reshape(len(xb), -1).copy())
    return np.concatenate(res)


def speed(nets: dict, x: np.ndarray, reps: int) -> dict:
    for net in nets.values():
        for _ in range(12):
            net.forward(**{net.inputs[0]: x})
    times = {k: [] for k in nets}
    for r in range(reps):
        for k in (list(nets) if r % 2 == 0 else list(reversed(nets))):
            t0 = time.perf_counter()
            nets[k].forward(**{nets[k].inputs[0]: x})
            times[k].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    import brewnet
    from brewnet.execution import runners
    from brewnet.pycaffe import Net

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", default=str(OPENCV_DATA))
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    if runners.bf16_refusal():
        sys.exit(runners.bf16_refusal())
    imgs224 = photos(Path(a.images), 256, 224, (104, 117, 123))
    imgs32 = photos(Path(a.images), 32, 32, (128, 128, 128))
    digits, labels = mnist()
    ev = TRAINED / "everpeace_caffe_2014_v1format/examples"
    models = [
        ("open_nsfw", TRAINED / "open_nsfw/deploy.prototxt", TRAINED / "open_nsfw/resnet_50_1by2_nsfw.caffemodel",
         imgs224, None, 16),
        ("lenet (ethereon)", TRAINED / "lenet_mnist_ethereon/examples/mnist/lenet.prototxt",
         TRAINED / "lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel", digits, labels, 100),
        ("lenet (everpeace V1)", ev / "mnist/lenet.prototxt", ev / "mnist/lenet_iter_10000.caffemodel",
         digits, labels, 100),
        ("cifar10_quick", ev / "cifar10/cifar10_quick.prototxt", ev / "cifar10/cifar10_quick_iter_5000.caffemodel",
         imgs32, None, 100),
        ("cifar10_full", ev / "cifar10/cifar10_full.prototxt", ev / "cifar10/cifar10_full_iter_70000.caffemodel",
         imgs32, None, 100),
    ]
    print(f"CPU: {brewnet.execution.engine_cache.cpu_model()}; {len(imgs224)} photographs, {len(digits)} digits")
    head = (f"{'model':22} {'inputs':>6} {'top-1 agree':>11} {'acc fp32':>8} {'acc bf16':>8} {'max |dp|':>9} "
            f"{'mean |dp|':>9} {'fp32 b1':>8} {'bf16 b1':>8} {'x':>5} {'fp32 b16':>9} {'bf16 b16':>9} {'x':>5}")
    print(head)
    for name, proto, weights, x, y, batch in models:
        fp = Net(str(proto), brewnet.TEST, weights=str(weights), engine="eager")
        bf = Net(str(proto), brewnet.TEST, weights=str(weights), precision="bf16")
        out = fp.outputs[-1]
        pf, pb = run_all(fp, x, out, batch), run_all(bf, x, out, batch)
        agree = float((pf.argmax(1) == pb.argmax(1)).mean())
        acc = (f"{(pf.argmax(1) == y).mean():8.4f} {(pb.argmax(1) == y).mean():8.4f}" if y is not None
               else f"{'-':>8} {'-':>8}")
        d = np.abs(pf - pb)
        s1 = speed({"fp32": fp, "bf16": bf}, x[:1], a.reps)
        s16 = speed({"fp32": fp, "bf16": bf}, x[:16], a.reps)
        print(f"{name:22} {len(x):6d} {agree:11.4f} {acc} {d.max():9.2e} {d.mean():9.2e} "
              f"{s1['fp32']:8.2f} {s1['bf16']:8.2f} {s1['fp32'] / s1['bf16']:5.2f} "
              f"{s16['fp32']:9.2f} {s16['bf16']:9.2f} {s16['fp32'] / s16['bf16']:5.2f}", flush=True)


if __name__ == "__main__":
    main()
