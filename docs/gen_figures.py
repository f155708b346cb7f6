"""Regenerate the pictures of the documentation (docs/figures/) with the commands the pages show.

    python docs/gen_figures.py [--log examples/mnist/lenet_train.log] [--work DIR] [--only NAME,...]

Every picture is drawn by a brewnet command from the shared models and data (``$BREWNET_SHARED``,
default ``../shared`` beside the checkout):

- ``lenet_train.png``: ``brewnet plot`` of the main job's log (``bash examples/mnist/train_lenet.sh``
  writes ``examples/mnist/lenet_train.log``); without that log, a 1,000-iteration run of Caffe's
  LeNet recipe on the shared MNIST t10k images is trained and plotted instead (the caption says so).
- ``lenet_net.png``: ``brewnet draw`` of ``examples/mnist/lenet_train_test.prototxt``.
- ``filters_conv1.png``, ``filters_conv2.png``: ``brewnet filters`` of the trained LeNet over 2,000
  t10k images.
- ``heatmap_chelsea.png``: ``brewnet heatmap`` of open_nsfw's last residual block on a cat.
- ``video_frame.png``: ``brewnet video --annotate`` of CIFAR-10 full made fully convolutional, on a
  camera pan over the astronaut image (24 frames written here), keyframes every 3 frames.
- ``search_history.png``, ``search_intermediate.png``: Optuna's optimisation history and
  intermediate values of ``brewnet search``'s LeNet study, copied from a finished
  ``python benchmarks/search_mnist.py --mnist DATA --out DIR`` run (about an hour on 2 cores, so
  not run here): ``--search DIR``; without it these two are left as they are.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "figures"
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
TRAINED = SHARED / "caffe-models" / "trained"
MNIST = TRAINED / "mnist_t10k" / "data" / "mnist"
LENET = TRAINED / "lenet_mnist_ethereon" / "examples" / "mnist" / "lenet_iter_10000.caffemodel"
NSFW = TRAINED / "open_nsfw"
C10 = TRAINED / "everpeace_caffe_2014_v1format" / "examples" / "cifar10"
IMAGES = SHARED / "caffe-models" / "images"
FIGURES = ("train", "draw", "filters", "heatmap", "video", "search")
SEARCH_PLOTS = {"optimization_history.png": "search_history.png",
                "intermediate_values.png": "search_intermediate.png"}


def brewnet(*args: str) -> None:
    """Run one brewnet command, echoing it; a failure stops the script with its exit status."""
    cmd = [sys.executable, "-m", "brewnet", *map(str, args)]
    print("$ brewnet " + " ".join(map(str, args)), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def mnist_lmdb(work: Path) -> Path:
    db = work / "t10k_lmdb"
    if not db.exists():
        brewnet("convert-mnist", MNIST / "t10k-images-idx3-ubyte.gz", MNIST / "t10k-labels-idx1-ubyte.gz", db)
    return db


def lenet_on(db: Path, work: Path, batch: int = 100) -> Path:
    """Caffe's LeNet train/test prototxt with both data layers reading ``db``."""
    text = (ROOT / "examples/mnist/lenet_train_test.prototxt").read_text()
    text = re.sub(r'source: "[^"]*"', f'source: "{db}"', text)
    path = work / "lenet_train_test.prototxt"
    path.write_text(text)
    return path


def training_curve(log: Path | None, work: Path) -> None:
    if log is None:   # no main-job log: a short run of the same recipe on the t10k images
        net = lenet_on(mnist_lmdb(work), work)
        solver = (ROOT / "examples/mnist/lenet_solver.prototxt").read_text()
        solver = re.sub(r'net: "[^"]*"', f'net: "{net}"', solver)
        solver = re.sub(r"max_iter: \d+", "max_iter: 1000", solver)
        solver = re.sub(r"snapshot: \d+", "snapshot: 1000", solver)
        solver = re.sub(r"test_iter: \d+", "test_iter: 20", solver)
        solver = re.sub(r'snapshot_prefix: "[^"]*"', f'snapshot_prefix: "{work}/lenet"', solver)
        (work / "solver.prototxt").write_text(solver)
        log = work / "lenet_train.log"
        print(f"$ brewnet train --solver {work}/solver.prototxt 2> {log}", flush=True)
        with open(log, "w") as f:
            subprocess.run([sys.executable, "-m", "brewnet", "train", "--solver", str(work / "solver.prototxt")],
                           check=True, cwd=ROOT, stderr=f)
    brewnet("plot", log, "-o", OUT / "lenet_train.png", "--title", "LeNet on MNIST (brewnet train)")


def video_frame(work: Path) -> None:
    import cv2  # a dependency of brewnet

    frames = work / "pan"
    frames.mkdir(exist_ok=True)
    image = cv2.imread(str(IMAGES / "astronaut.png"))            # 512 x 512
    for i in range(24):                                          # a slow pan, 320 x 240 frames
        x, y = 8 * i, 4 * i
        cv2.imwrite(str(frames / f"frame_{i:03d}.png"), cv2.resize(image[y:y + 300, x:x + 400], (320, 240)))
    brewnet("video", "--model", C10 / "cifar10_full.prototxt", "--weights", C10 / "cifar10_full_iter_70000.caffemodel",
            "--input", frames, "--split", "norm1", "--fully-convolutional", "--size", "320x240", "--mean", "120",
            "--keyframes", "every:3", "--out", work / "video.npy", "--annotate", work / "annotated")
    shots = sorted((work / "annotated").glob("*.png")) or sorted((work / "annotated").glob("*.jpg"))
    shutil.copy(shots[min(4, len(shots) - 1)], OUT / "video_frame.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, help="the main job's training log (default: "
                    "examples/mnist/lenet_train.log if it exists, else a short run)")
    ap.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    ap.add_argument("--search", type=Path, metavar="DIR",
                    help="the --out folder of a finished benchmarks/search_mnist.py run")
    ap.add_argument("--only", default=",".join(FIGURES), help=f"some of {','.join(FIGURES)} (default: all)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if only - set(FIGURES):
        ap.error(f"--only: unknown {sorted(only - set(FIGURES))}; known: {','.join(FIGURES)}")
    if not MNIST.exists():
        sys.exit(f"gen_figures: the shared data is not at {SHARED} (set BREWNET_SHARED)")
    OUT.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="brewnet-figures-"))
    work.mkdir(parents=True, exist_ok=True)
    log = args.log or (ROOT / "examples/mnist/lenet_train.log")
    if "train" in only:
        training_curve(log if log.exists() else None, work)
    if "draw" in only:
        brewnet("draw", "examples/mnist/lenet_train_test.prototxt", OUT / "lenet_net.png", "--rankdir", "LR")
    if "filters" in only:
        net = lenet_on(mnist_lmdb(work), work)
        for blob in ("conv1", "conv2"):
            brewnet("filters", "--model", net, "--weights", LENET, "--blob", blob, "--images", "2000",
                    "--out", work / f"filters_{blob}")
            shutil.copy(work / f"filters_{blob}" / f"{blob}_overview.png", OUT / f"filters_{blob}.png")
    if "heatmap" in only:
        heatmap(work)
    if "video" in only:
        video_frame(work)
    if "search" in only:
        search_plots(args.search)
    print(f"figures in {OUT}")
    return 0


def search_plots(run: Path | None) -> None:
    if run is None:
        print("search: no --search DIR given, search_history.png and search_intermediate.png kept")
        return
    for src, dst in SEARCH_PLOTS.items():
        if not (run / "search" / src).exists():
            sys.exit(f"gen_figures: {run / 'search' / src} not found (a finished search_mnist.py --out?)")
        shutil.copy(run / "search" / src, OUT / dst)


def heatmap(work: Path) -> None:
    brewnet("heatmap", "--model", NSFW / "deploy.prototxt", "--weights", NSFW / "resnet_50_1by2_nsfw.caffemodel",
            "--blob", "eltwise_stage3_block2", "--images", IMAGES / "chelsea.png", "--mean", "104,117,123",
            "--out", work / "heatmap")
    shutil.copy(work / "heatmap" / "heatmap_0000.png", OUT / "heatmap_chelsea.png")


if __name__ == "__main__":
    sys.exit(main())
