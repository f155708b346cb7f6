"""torchvision's classification models to Caffe (``brewnet.convert``), each proven in brewnet and
run again in OpenCV's dnn (``cv2.dnn.readNetFromCaffe`` on the written files).

    python benchmarks/from_torch.py [--models resnet18,mobilenet_v2] [--onnx] [--out DIR]

Weights are random (no downloads here) with BatchNorm statistics and affine parameters set to
non-trivial values, so a wrong BatchNorm mapping shows. torchvision 0.28's compiled ops are built
for the CUDA torch and ``import torchvision`` fails beside the CPU torch ("operator
torchvision::nms does not exist"); its model definitions are plain Python, so the two modules
that register those ops are kept from loading. Set TORCHVISION_PATH to a folder holding the
wheel's files (``pip install --no-deps --target DIR torchvision==0.28``) when it is not installed.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import types

import numpy as np

import brewnet  # noqa: F401  (before torch, as users are told)

MODELS = ["resnet18", "resnet50", "mobilenet_v2", "vgg16_bn", "vgg11_bn", "squeezenet1_0", "squeezenet1_1",
          "alexnet", "resnext50_32x4d", "wide_resnet50_2", "densenet121", "googlenet", "shufflenet_v2_x1_0",
          "mobilenet_v3_small", "mobilenet_v3_large", "mnasnet1_0", "efficientnet_b0", "regnet_y_400mf"]


def torchvision_models():
    if os.environ.get("TORCHVISION_PATH"):
        sys.path.insert(0, os.environ["TORCHVISION_PATH"])
    for m in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(m, types.ModuleType(m))
    import torchvision.models as tvm

    return tvm


def build(tvm, name: str):
    import torch

    kw = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    torch.manual_seed(0)
    m = getattr(tvm, name)(weights=None, **kw).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                c = mod.num_features
                mod.running_mean.copy_(torch.randn(c, generator=g) * 0.2)
                mod.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
                mod.weight.copy_(torch.rand(c, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(c, generator=g) * 0.2)
    return m


def opencv_diff(proto: str, model: str, x: np.ndarray, want: np.ndarray) -> float:
    try:
        import cv2
    except ImportError:
        return float("nan")
    try:
        net = cv2.dnn.readNetFromCaffe(proto, model)
        net.setInput(x)
        got = net.forward()
    except cv2.error as e:
        print(f"    OpenCV: {str(e).strip().splitlines()[-1][:160]}", file=sys.stderr)
        return float("nan")
    return float(np.abs(got.reshape(want.shape) - want).max() / max(np.abs(want).max(), 1e-12))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dialect", default="bvlc")
    p.add_argument("--onnx", action="store_true", help="also through torch.onnx.export + brewnet import")
    p.add_argument("--out", default=None, help="where the files go (default: a temporary folder)")
    args = p.parse_args()
    import torch

    logging.disable(logging.WARNING)
    from brewnet.convert import ConversionError, from_onnx, from_torch

    tvm = torchvision_models()
    out = args.out or tempfile.mkdtemp(prefix="from_torch_")
    rows = []
    print("| model | dialect | layers | worst rel. diff (brewnet) | worst rel. diff (OpenCV) | time (s) "
          "| ONNX path: layers, worst rel. diff |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        m = build(tvm, name)
        torch.manual_seed(2)
        x = torch.randn(1, 3, 224, 224)
        prefix = os.path.join(out, name)
        try:
            res = from_torch(m, (x,), prefix, dialect=args.dialect)
        except ConversionError as e:
            print(f"| {name} | {args.dialect} | - | fails: {str(e)[:200]} | | | |", flush=True)
            continue
        with torch.no_grad():
            want = m(x).numpy()
        cv = opencv_diff(res.prototxt, res.caffemodel, x.numpy(), want)
        onnx_col = ""
        if args.onnx:
            try:
                torch.onnx.export(m, (x,), prefix + ".onnx", dynamo=True, verbose=False)
                r2 = from_onnx(prefix + ".onnx", prefix + "_onnx", dialect=args.dialect,
                               example_inputs=[x.numpy()])
                onnx_col = f"{r2.layers}, {r2.worst:.1e}"
            except Exception as e:  # noqa: BLE001  (a row, not the end of the table)
                onnx_col = f"fails: {str(e).splitlines()[0][:120]}"
        rows.append((name, res))
        print(f"| {name} | {res.dialect} | {res.layers} | {res.worst:.1e} | {cv:.1e} | {res.seconds:.1f} "
              f"| {onnx_col} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
