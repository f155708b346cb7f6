"""``brewnet time``'s layer-by-layer pass against the solver's step on the same net, in one
process, alternating (benchmarks/train.py's nets: train_val with Input layers, its batch sizes).

    python benchmarks/time_vs_step.py [LeNet CIFAR10-quick CaffeNet]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as T  # noqa: E402
from brewnet.analysis.timing import time_net  # noqa: E402


def main(names) -> int:
    torch.set_num_threads(2)
    print(f"{'net':<14} {'solver step ms':>15} {'fwd+bwd ms':>11} {'brewnet time ms':>16}   (medians of 8)")
    for name in names:
        s = T.brewnet_solver(*T.NETS[name][:4])
        s.net.blobs["data"].data[...] = np.random.rand(*s.net.blobs["data"].shape)
        s.net.blobs["label"].data[...] = np.random.randint(10, size=s.net.blobs["label"].shape)
        step, whole, layers = [], [], []
        for _ in range(8):
            t0 = time.perf_counter()
            s.step(1)
            step.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            s.net.forward_tensors()
            s.net.backward_tensors(blob_diffs=False)
            whole.append((time.perf_counter() - t0) * 1e3)
            layers.append(time_net(s.net, 1, warmup=0).total_ms)
        med = statistics.median
        print(f"{name:<14} {med(step):>15.1f} {med(whole):>11.1f} {med(layers):>16.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["LeNet", "CIFAR10-quick", "CaffeNet"]))
