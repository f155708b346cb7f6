"""Train MobileNet-SSD's own train.prototxt on boxes you made: a worked example.

    python examples/ssd/shapes.py --out /tmp/ssd_shapes [--size 96] [--iters N] [--augment ssd]

1. draws a small detection dataset (circles, squares and triangles of random colours, sizes
   and places on a noisy background; the boxes written to a CSV);
2. builds AnnotatedDatum LMDBs with ``brewnet create-annoset`` (and the label map);
3. writes copies of MobileNet-SSD's train.prototxt and test prototxt (from
   ../shared/caffe-models/mobilenet-ssd/, see its SOURCES.txt) with num_classes 4 (background
   + 3 shapes), the LMDB sources and, for ``--size`` other than 300, the input size (resize_param)
   and the PriorBox sizes scaled to it. Two more changes, because it trains from scratch for
   minutes rather than fine-tuning an ImageNet MobileNet for 120000 iterations: the backbone's
   lr_mult/decay_mult 0.1 (0.2 for the Scale biases) become 1 (2), and every BatchNorm's
   moving_average_fraction 0.999 becomes ``--bn-fraction`` (0.99): the test net normalises
   with the running averages, and over a run of a thousand iterations 0.999 keeps the first
   iterations' statistics, including those of channels that died since (measured: the same
   weights score a 10x lower mAP with those averages than with averages of the final weights);
4. trains it with ``brewnet train`` (optionally scoring the test set every ``--test-interval``
   iterations) and scores it with ``brewnet test``, which reports the detection mAP
   (DetectionEvaluate accumulated as SSD's solver does).
"""
from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
from google.protobuf import text_format

from brewnet.proto.io import read_net

HERE = Path(__file__).resolve().parent
MODELS = HERE.parents[1].parent / "shared" / "caffe-models" / "mobilenet-ssd"
SHAPES = ("circle", "square", "triangle")
VOC_CLASSES = 21


def draw(rng, side: int) -> tuple[np.ndarray, list[tuple]]:
    """One image with 1-3 shapes that do not overlap much, and their boxes."""
    img = rng.integers(20, 90, (side, side, 3), dtype=np.uint8)
    img = cv2.GaussianBlur(img, (5, 5), 0)
    boxes: list[tuple] = []
    for _ in range(int(rng.integers(1, 4))):
        for _try in range(20):
            s = int(rng.integers(side // 5, side // 2))
            x, y = int(rng.integers(0, side - s)), int(rng.integers(0, side - s))
            if all(x + s <= bx or bx2 <= x or y + s <= by or by2 <= y for _, bx, by, bx2, by2 in boxes):
                break
        else:
            continue
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        color = tuple(int(c) for c in rng.integers(120, 256, 3))
        if kind == "circle":
            cv2.circle(img, (x + s // 2, y + s // 2), s // 2, color, -1)
        elif kind == "square":
            cv2.rectangle(img, (x, y), (x + s - 1, y + s - 1), color, -1)
        else:
            pts = np.array([[x + s // 2, y], [x, y + s - 1], [x + s - 1, y + s - 1]], np.int32)
            cv2.fillPoly(img, [pts], color)
        boxes.append((kind, x, y, x + s, y + s))
    return img, boxes


def make_dataset(out: Path, split: str, n: int, side: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    (out / split).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        img, boxes = draw(rng, side)
        name = f"{split}/{i:05d}.png"
        cv2.imwrite(str(out / name), img)
        rows += [(name, *b) for b in boxes]
    path = out / f"{split}.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "label", "xmin", "ymin", "xmax", "ymax"])
        w.writerows(rows)
    return path


def adapt(src: Path, dst: Path, classes: int, source: str, batch: int, size: int, label_map: str,
          light: bool = False, bn_fraction: float | None = None, scratch: bool = False,
          width: float = 1.0):
    """A copy of a MobileNet-SSD prototxt for ``classes`` classes, ``source``, ``batch`` and a
    ``size`` x ``size`` input (PriorBox min/max sizes scaled by size / 300); ``light``: no
    expansion, distortion or sampled crops; ``bn_fraction``: every BatchNorm's
    moving_average_fraction; ``scratch``: the fine-tuning multipliers 0.1/0.2 set to 1/2;
    ``width``: every backbone and extra-layer convolution's num_output (and a depthwise one's
    group) times this (MobileNet's width multiplier; the box heads keep theirs)."""
    net = read_net(str(src))
    for layer in net.layer:
        cp = layer.convolution_param
        if layer.name.endswith("_mbox_conf"):
            cp.num_output = cp.num_output // VOC_CLASSES * classes
        elif layer.type in ("Convolution", "DepthwiseConvolution") and width != 1 \
                and not layer.name.endswith("_mbox_loc"):
            depthwise = cp.group == cp.num_output > 1
            cp.num_output = max(1, round(cp.num_output * width))
            if depthwise:
                cp.group = cp.num_output
        for field in ("multibox_loss_param", "detection_output_param", "detection_evaluate_param"):
            if layer.HasField(field):
                getattr(layer, field).num_classes = classes
        if layer.type == "Reshape" and layer.name == "mbox_conf_reshape":
            dims = layer.reshape_param.shape.dim
            dims[:] = [classes if d == VOC_CLASSES else d for d in dims]
        if layer.type == "AnnotatedData":
            layer.data_param.source, layer.data_param.batch_size = source, batch
            layer.annotated_data_param.label_map_file = label_map
            rp = layer.transform_param.resize_param
            rp.height = rp.width = size
            if light:       # no expansion, distortion or sampled crops
                for field in ("expand_param", "distort_param"):
                    layer.transform_param.ClearField(field)
                layer.annotated_data_param.ClearField("batch_sampler")
        if layer.type == "PriorBox" and size != 300:
            p = layer.prior_box_param
            p.min_size[:] = [v * size / 300 for v in p.min_size]
            p.max_size[:] = [v * size / 300 for v in p.max_size]
        if layer.type == "BatchNorm" and bn_fraction is not None:
            layer.batch_norm_param.moving_average_fraction = bn_fraction
        if scratch:         # the backbone's fine-tuning multipliers (0.1, Scale biases 0.2)
            for ps in layer.param:
                if ps.lr_mult in (np.float32(0.1), np.float32(0.2)):
                    ps.lr_mult = round(ps.lr_mult * 10)
                if ps.decay_mult == np.float32(0.1):
                    ps.decay_mult = 1
        if layer.type == "DetectionOutput":
            layer.detection_output_param.ClearField("save_output_param")
        if layer.type == "DetectionEvaluate":
            layer.detection_evaluate_param.ClearField("name_size_file")
    dst.write_text(text_format.MessageToString(net))


def brewnet(*args, log: Path | None = None) -> str:
    cmd = [sys.executable, "-m", "brewnet", *map(str, args)]
    print("$", " ".join(cmd[2:]), flush=True)
    if log is None:
        p = subprocess.run(cmd, capture_output=True, text=True)
        text = p.stdout + p.stderr
    else:                                   # streamed: follow a long run with tail -f
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        text = log.read_text()
    if p.returncode:
        sys.exit(f"failed ({p.returncode}):\n{text[-3000:]}")
    return text


SOLVERS = {"SGD": "momentum: 0.9", "Adam": "momentum: 0.9\nmomentum2: 0.999"}


def solver_text(out: Path, a, prefix: str) -> str:
    """The solver: ``--solver`` at ``--base-lr``, divided by 10 after ``--step`` of the
    iterations; with ``--test-interval``, the test net scored as SSD's solver does."""
    test = ""
    if a.test_interval:
        test = (f'test_net: "{out}/test.prototxt"\ntest_iter: {a.test // 10}\n'
                f'test_interval: {a.test_interval}\ntest_initialization: false\n'
                f'eval_type: "detection"\nap_version: "{a.ap_version}"\n')
    return f"""train_net: "{out}/train.prototxt"
{test}base_lr: {a.base_lr}
lr_policy: "multistep"
stepvalue: {max(1, int(a.iters * a.step))}
gamma: 0.1
type: "{a.solver}"
{SOLVERS[a.solver]}
weight_decay: 0.00005
max_iter: {a.iters}
display: 20
average_loss: 20
snapshot: {a.iters}
snapshot_prefix: "{out}/{prefix}"
random_seed: 1
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="working folder")
    ap.add_argument("--models", type=Path, default=MODELS,
                    help="the folder of MobileNet-SSD's train.prototxt and voc/MobileNetSSD_test.prototxt")
    ap.add_argument("--size", type=int, default=96, help="network input side (MobileNet-SSD: 300)")
    ap.add_argument("--image-side", type=int, default=128, help="side of the generated images")
    ap.add_argument("--train", type=int, default=800, help="training images")
    ap.add_argument("--test", type=int, default=100, help="test images (a multiple of 10)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--solver", choices=sorted(SOLVERS), default="SGD")
    ap.add_argument("--base-lr", type=float, default=0.02)
    ap.add_argument("--step", type=float, default=0.8,
                    help="the rate drops 10x after this share of the iterations")
    ap.add_argument("--augment", choices=["light", "ssd"], default="light",
                    help="light: mirror and resize only; ssd: also MobileNet-SSD's distortion, "
                         "expansion and sampled crops")
    ap.add_argument("--bn-fraction", type=float, default=0.99,
                    help="BatchNorm moving_average_fraction (the prototxt's: 0.999)")
    ap.add_argument("--width", type=float, default=1.0,
                    help="MobileNet width multiplier on the backbone and extra layers (the prototxt's: 1)")
    ap.add_argument("--finetune-mults", action="store_true",
                    help="keep the backbone's lr_mult/decay_mult 0.1 (for an ImageNet-trained backbone)")
    ap.add_argument("--test-interval", type=int, default=500,
                    help="score the test set every N iterations (0: only at the end)")
    ap.add_argument("--ap-version", default="11point", choices=["11point", "MaxIntegral", "Integral"])
    ap.add_argument("--weights", type=Path, help="fine-tune from these weights (a previous run's)")
    a = ap.parse_args(argv)
    if a.test % 10:
        ap.error("--test must be a multiple of 10 (the test batch)")
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lm = out / "labelmap.prototxt"
    for split, n, seed in (("train", a.train, 1), ("test", a.test, 2)):
        if not (out / f"{split}_lmdb").exists():
            csv_path = make_dataset(out, split, n, a.image_side, seed)
            brewnet("create-annoset", csv_path, out / f"{split}_lmdb", "--label-map", lm,
                    "--root-folder", f"{out}/")
    classes = len(SHAPES) + 1
    models = a.models.resolve()
    adapt(models / "train.prototxt", out / "train.prototxt", classes, str(out / "train_lmdb"),
          a.batch, a.size, str(lm), a.augment == "light", a.bn_fraction, not a.finetune_mults,
          a.width)
    adapt(models / "voc" / "MobileNetSSD_test.prototxt", out / "test.prototxt", classes,
          str(out / "test_lmdb"), 10, a.size, str(lm), bn_fraction=a.bn_fraction, width=a.width)
    prefix = ("ssd_shapes_ft" if a.weights else "ssd_shapes") + ("_ssdaug" if a.augment == "ssd" else "")
    (out / "solver.prototxt").write_text(solver_text(out, a, prefix))
    t0 = time.time()
    more = ["--weights", a.weights.resolve()] if a.weights else []
    log = out / f"{prefix}_train.log"
    text = brewnet("train", "--solver", out / "solver.prototxt", *more, log=log)
    train_s = time.time() - t0
    curve = [ln.split("] ", 1)[-1] for ln in text.splitlines() if "detection_eval =" in ln]
    losses = [ln.rsplit("loss = ", 1)[1] for ln in text.splitlines() if "Iteration" in ln and "loss = " in ln]
    weights = out / f"{prefix}_iter_{a.iters}.caffemodel"
    t0 = time.time()
    text = brewnet("test", "--model", out / "test.prototxt", "--weights", weights,
                   "--iterations", a.test // 10, "--ap-version", a.ap_version, "--per-class",
                   log=out / f"{prefix}_test.log")
    maps = [ln.split("] ", 1)[-1] for ln in text.splitlines() if "detection_eval" in ln or "class" in ln]
    if curve:
        print("test mAP during training:", ", ".join(c.rsplit("= ", 1)[-1] for c in curve))
    print("\n".join(maps[-5:]))
    print(f"train: {a.iters} iterations of batch {a.batch} at {a.size}x{a.size} in {train_s:.0f} s, "
          f"final loss (average of 20) {losses[-1] if losses else '?'}; test: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
