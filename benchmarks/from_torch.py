"""torchvision's classification, segmentation and detection models to Caffe (``brewnet.convert``),
each proven in brewnet and run again in OpenCV's dnn (``cv2.dnn.readNetFromCaffe`` on the written
files).

    python benchmarks/from_torch.py [--models resnet18,mobilenet_v2] [--weights calibrated] [--onnx]

Weights are random (no downloads here) with BatchNorm statistics and affine parameters set to
non-trivial values, so a wrong BatchNorm mapping shows. ``--weights calibrated``: the same random
weights and BatchNorm affine parameters, then the BatchNorm statistics measured on real images:
the BatchNorm layers alone in train mode (cumulative averages, momentum None, statistics reset)
over 4 batches of 8 photos (OpenCV's sample images, each resized on its shorter side and centre-
cropped to the input size, RGB, ImageNet mean/std), then eval; the proof's input is a 33rd photo
instead of a normal sample. Segmentation models (``fcn_resnet50``, ``deeplabv3_resnet50``,
``lraspp_mobilenet_v3_large``: their ``out``) run at 226x226, so their resizes are not integer
scales; ``ssdlite320_mobilenet_v3_large`` is its backbone and head up to the raw box regressions
and class logits (no anchors, no NMS), at 320x320 in the ssd dialect.

torchvision 0.28's compiled ops are built for the CUDA torch and ``import torchvision`` fails
beside the CPU torch ("operator torchvision::nms does not exist"); its model definitions are
plain Python, so the two modules that register those ops are kept from loading. Set
TORCHVISION_PATH to a folder holding the wheel's files (``pip install --no-deps --target DIR
torchvision==0.28``) when it is not installed; IMAGES to a folder of photos when OpenCV's samples
(opencv-doc) are not installed.
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
SEGMENTATION = ["fcn_resnet50", "deeplabv3_resnet50", "lraspp_mobilenet_v3_large"]
DETECTION = ["ssdlite320_mobilenet_v3_large"]
SIZE = {**{m: 226 for m in SEGMENTATION}, "ssdlite320_mobilenet_v3_large": 320}
DIALECT = {"ssdlite320_mobilenet_v3_large": "ssd"}
IMAGE_DIRS = ["/usr/share/doc/opencv-doc/examples/data", "../shared/caffe-models/images"]


def torchvision_models():
    if os.environ.get("TORCHVISION_PATH"):
        sys.path.insert(0, os.environ["TORCHVISION_PATH"])
    for m in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(m, types.ModuleType(m))
    import torchvision.models as tvm

    return tvm


def _heads(name: str):
    """Wrappers that give a segmentation model's ``out`` and SSDLite's raw head outputs."""
    import torch

    class Out(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)["out"]

    class SSDRaw(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.backbone, self.head = m.backbone, m.head

        def forward(self, x):
            h = self.head(list(self.backbone(x).values()))
            return h["bbox_regression"], h["cls_logits"]

    return SSDRaw if name in DETECTION else Out


def build(tvm, name: str):
    import torch

    kw = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    torch.manual_seed(0)
    if name in SEGMENTATION or name in DETECTION:
        sub = tvm.segmentation if name in SEGMENTATION else tvm.detection
        m = _heads(name)(getattr(sub, name)(weights=None, weights_backbone=None)).eval()
    else:
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


def photos(size: int, count: int):
    """``count`` photos as a (count, 3, size, size) ImageNet-normalised RGB batch."""
    import cv2
    import torch

    folder = os.environ.get("IMAGES") or next((d for d in IMAGE_DIRS if os.path.isdir(d)), None)
    if folder is None:
        raise SystemExit(f"--weights calibrated needs photos: set IMAGES (looked in {IMAGE_DIRS})")
    out = []
    for f in sorted(os.listdir(folder)):
        img = cv2.imread(os.path.join(folder, f), cv2.IMREAD_COLOR) \
            if f.lower().endswith((".jpg", ".jpeg", ".png")) else None
        if img is None or min(img.shape[:2]) < 64:
            continue
        h, w = img.shape[:2]
        k = size / min(h, w)
        img = cv2.resize(img, (max(size, round(w * k)), max(size, round(h * k))), interpolation=cv2.INTER_AREA)
        t, left = (img.shape[0] - size) // 2, (img.shape[1] - size) // 2
        out.append(img[t:t + size, left:left + size, ::-1].astype(np.float32) / 255.0)
        if len(out) == count:
            break
    if len(out) < count:
        raise SystemExit(f"{folder}: {len(out)} photos, {count} needed")
    x = (np.stack(out) - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def calibrate(m, images, batch: int = 8):
    """BatchNorm statistics measured on ``images``: the BatchNorm layers alone in train mode, their
    statistics reset and averaged over the batches (momentum None), then eval."""
    import torch

    bns = [mod for mod in m.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
        bn.train()
    with torch.no_grad():
        for i in range(0, len(images), batch):
            m(images[i:i + batch])
    return m.eval()


def opencv_diff(res, x: np.ndarray, want: list) -> float:
    try:
        import cv2
    except ImportError:
        return float("nan")
    try:
        net = cv2.dnn.readNetFromCaffe(res.prototxt, res.caffemodel)
        if hasattr(net, "enableWinograd"):     # its Winograd 3x3 drifts (as in load_all.py)
            net.enableWinograd(False)
        net.setInput(x)
        got = net.forward([row[0] for row in res.outputs])
    except cv2.error as e:
        print(f"    OpenCV: {str(e).strip().splitlines()[-1][:160]}", file=sys.stderr)
        return float("nan")
    return max(float(np.abs(g.reshape(t.shape) - t).max() / max(np.abs(t).max(), 1e-12))
               for g, t in zip(got, want))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dialect", default=None, help="default: bvlc (ssd for the SSDLite head)")
    p.add_argument("--weights", default="random", choices=("random", "calibrated"),
                   help="calibrated: BatchNorm statistics measured on photos (see above)")
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
        size = SIZE.get(name, 224)
        dialect = args.dialect or DIALECT.get(name, "bvlc")
        torch.manual_seed(2)
        if args.weights == "calibrated":
            images = photos(size, 33)
            m = calibrate(m, images[:32])
            x = images[32:]
        else:
            x = torch.randn(1, 3, size, size)
        prefix = os.path.join(out, name)
        label = name if size == 224 else f"{name} ({size}x{size})"
        try:
            res = from_torch(m, (x,), prefix, dialect=dialect)
        except ConversionError as e:
            print(f"| {label} | {dialect} | - | fails: {str(e)[:200]} | | | |", flush=True)
            continue
        with torch.no_grad():
            want = m(x)
        want = [t.numpy() for t in (want if isinstance(want, tuple) else (want,))]
        cv = opencv_diff(res, x.numpy(), want)
        onnx_col = ""
        if args.onnx:
            try:
                torch.onnx.export(m, (x,), prefix + ".onnx", dynamo=True, verbose=False)
                r2 = from_onnx(prefix + ".onnx", prefix + "_onnx", dialect=dialect,
                               example_inputs=[x.numpy()])
                onnx_col = f"{r2.layers}, {r2.worst:.1e}"
            except Exception as e:  # noqa: BLE001  (a row, not the end of the table)
                onnx_col = f"fails: {str(e).splitlines()[0][:120]}"
        rows.append((name, res))
        print(f"| {label} | {res.dialect} | {res.layers} | {res.worst:.1e} | {cv:.1e} | {res.seconds:.1f} "
              f"| {onnx_col} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
