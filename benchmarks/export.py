"""to_torch and ONNX against the Net on every deploy net given (default: every prototxt under
../shared/caffe-models with Input layers), random weights scaled by fan-in; prints per net the
largest relative difference of the graph module and of onnxruntime, or why it cannot export.

    python benchmarks/export.py                       # all (DenseNets and VGGs take minutes each)
    python benchmarks/export.py --nets resnet,vgg     # those whose path (under caffe-models) has one
    python benchmarks/export.py --nets ResNet-152 --logits  # drop a final Softmax first
    python benchmarks/export.py path/to/deploy.prototxt ...
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from brewnet.deploy import export_onnx, to_torch
from brewnet.net import Net
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_net

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")


def randomise(net: Net) -> None:
    with torch.no_grad():
        for layer in net.layer_list:
            for k, b in enumerate(layer.blobs):
                if layer.type == "BatchNorm":        # mean, variance, scale factor
                    b.normal_().mul_(0.1) if k == 0 else b.uniform_(0.5, 1.5) if k == 1 else b.fill_(1)
                elif b.dim() >= 2:
                    b.normal_().mul_(b[0].numel() ** -0.5)
                else:
                    b.normal_().mul_(0.1).add_(1.0 if layer.type == "Scale" and k == 0 else 0.0)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def check(path: Path, out: Path, logits: bool = False) -> str:
    import onnxruntime as ort

    param = read_net(str(path))
    if logits and param.layer and param.layer[-1].type == "Softmax":
        del param.layer[-1]          # compare the logits: a saturated softmax hides differences
    if not any(lp.type == "Input" for lp in param.layer):      # before building its data layers
        return "skip: no Input layer (a train/val net)"
    for lp in param.layer:
        for s in lp.input_param.shape:
            s.dim[0] = 1
    torch.manual_seed(0)
    net = Net(param, pb.TEST)
    randomise(net)
    try:
        gm = to_torch(net)
    except ValueError as e:
        return f"cannot export: {e}"
    xs = [torch.randn(net.shapes[n]) for n in net.inputs]
    for n, x in zip(net.inputs, xs):
        net.blobs[n].tensor.copy_(x)
    with torch.no_grad():
        net.forward_tensors()
        got = gm(*xs)
    want = [net.blobs[n].tensor.numpy() for n in net.outputs]
    got = got if isinstance(got, tuple) else (got,)
    t_rel = max(rel(g, w) for g, w in zip(got, want))
    export_onnx(gm, out)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    o_rel = max(rel(g, w) for g, w in zip(sess.run(None, {n: x.numpy() for n, x in zip(net.inputs, xs)}), want))
    # random weights can push a softmax to exact 0s and 1s, where any graph agrees: say so
    flat = np.concatenate([np.abs(np.asarray(w, np.float64)).ravel() for w in want])
    saturated = ("  (outputs saturated at 0/1: uninformative)"
                 if np.all(np.minimum(flat, np.abs(1 - flat)) < 1e-6) else "")
    return f"torch {t_rel:.1e}  onnx {o_rel:.1e}  batch {'dynamic' if gm.dynamic_batch else 'fixed'}{saturated}"


def shown(p: Path) -> str:
    """The path as the table prints it: relative to ../shared/caffe-models, never this machine's."""
    for base in (SHARED / "caffe-models", Path.cwd()):
        try:
            return str(p.resolve().relative_to(base.resolve()))
        except ValueError:
            pass
    return p.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, help="prototxts (default: every one under ../shared/caffe-models)")
    ap.add_argument("--nets", default="", help="comma-separated substrings; keep the paths holding one")
    ap.add_argument("--logits", action="store_true", help="drop a final Softmax (for nets whose "
                    "random-weight outputs saturate)")
    args = ap.parse_args()
    paths = args.paths or sorted(
        p for p in (SHARED / "caffe-models").rglob("*.prototxt") if "solver" not in p.name and "labelmap" not in p.name)
    keys = [k for k in args.nets.split(",") if k]
    if keys:
        paths = [p for p in paths if any(k.lower() in shown(p).lower() for k in keys)]
    with tempfile.TemporaryDirectory() as d:
        for p in paths:
            t0 = time.perf_counter()
            try:
                line = check(p, Path(d) / "net.onnx", args.logits)
            except Exception as e:  # noqa: BLE001  (a table row, not a crash)
                msg = str(e).splitlines()[0][:200] if str(e) else ""
                line = f"error: {type(e).__name__}: {msg.replace(str(SHARED.resolve()), '../shared')}"
            print(f"{shown(p)}: {line}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
