"""Feature extraction throughput and memory: ``brewnet extract`` of LeNet's ip1 and prob over
MNIST t10k (the trained caffemodel from ../shared/caffe-models/trained), N = 1,000 and 10,000
images, each in a fresh process; peak RSS must not grow with N (the .npy files are memory-mapped
and filled batch by batch).

    python benchmarks/tools.py [--batch 100]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT.parent / "shared" / "caffe-models" / "trained"
sys.path.insert(0, str(ROOT))

DATA = """name: "LeNet"
layer {{ name: "mnist" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }} }}
"""
LAYERS = "\n".join(["layer { name: \"conv1\" type: \"Convolution\" bottom: \"data\" top: \"conv1\" "
                 "convolution_param { num_output: 20 kernel_size: 5 } }",
                 "layer { name: \"pool1\" type: \"Pooling\" bottom: \"conv1\" top: \"pool1\" "
                 "pooling_param { pool: MAX kernel_size: 2 stride: 2 } }",
                 "layer { name: \"conv2\" type: \"Convolution\" bottom: \"pool1\" top: \"conv2\" "
                 "convolution_param { num_output: 50 kernel_size: 5 } }",
                 "layer { name: \"pool2\" type: \"Pooling\" bottom: \"conv2\" top: \"pool2\" "
                 "pooling_param { pool: MAX kernel_size: 2 stride: 2 } }",
                 "layer { name: \"ip1\" type: \"InnerProduct\" bottom: \"pool2\" top: \"ip1\" "
                 "inner_product_param { num_output: 500 } }",
                 "layer { name: \"relu1\" type: \"ReLU\" bottom: \"ip1\" top: \"ip1\" }",
                 "layer { name: \"ip2\" type: \"InnerProduct\" bottom: \"ip1\" top: \"ip2\" "
                 "inner_product_param { num_output: 10 } }",
                 "layer { name: \"prob\" type: \"Softmax\" bottom: \"ip2\" top: \"prob\" }"])


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (MiB) of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    if status:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr.read().decode()[-2000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss // 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    images = TRAINED / "mnist_t10k" / "data" / "mnist"
    weights = TRAINED / "lenet_mnist_ethereon" / "examples" / "mnist" / "lenet_iter_10000.caffemodel"
    if not images.exists() or not weights.exists():
        sys.exit(f"needs {images} and {weights} (../shared)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        db = tmp / "t10k_lmdb"
        subprocess.run([sys.executable, "-m", "brewnet.cli", "convert-mnist",
                        str(images / "t10k-images-idx3-ubyte.gz"), str(images / "t10k-labels-idx1-ubyte.gz"),
                        str(db)], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True)
        net = tmp / "lenet.prototxt"
        net.write_text(DATA.format(db=db, batch=args.batch) + LAYERS)
        print(f"brewnet extract of ip1 (500) and prob (10), LeNet on MNIST t10k, batch {args.batch}, .npy")
        print(f"{'images':>8} {'seconds':>8} {'images/s':>9} {'peak RSS MiB':>13} {'ip1 file MiB':>13}")
        for n in (1000, 10000):
            out = tmp / f"f{n}.npy"
            cmd = [sys.executable, "-m", "brewnet.cli", "extract", "--model", str(net), "--weights",
                   str(weights), "--blobs", "ip1,prob", "--iterations", str(n // args.batch), "--out", str(out)]
            secs, rss = run(cmd)
            size = (tmp / f"f{n}_ip1.npy").stat().st_size / 2**20
            print(f"{n:>8} {secs:>8.2f} {n / secs:>9.0f} {rss:>13} {size:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
