"""Where a training iteration of the SSD example's 96 x 96 MobileNet-SSD goes, per part.

    python benchmarks/ssd_step.py [--size 96] [--batch 8] [--width 1] [--rounds 5]
    python benchmarks/ab.py --base COMMIT --rounds 3 -- benchmarks/ssd_step.py   # before/after

Builds examples/ssd/shapes.py's data (64 training, 20 test images) and its adapted prototxts
in a temporary folder (data layers without a prefetch thread, so loading is timed where it
runs), then times each part once per round, in turn (the machine is shared and noisy), and
prints the medians in ms:

- ``data full`` / ``data light``: one AnnotatedData batch with SSD's whole augmentation
  (distortion, expansion, six batch samplers, mirror) / with ``--augment light`` (mirror, resize);
- ``forward`` / ``forward+backward``: the train net from the layer after its data layer (on the
  batch the data blobs hold), MultiBoxLoss included;
- ``MultiBoxLoss fwd+bwd``: the loss layer alone on that batch's bottoms;
- ``step (light)``: ``solver.step(1)`` (Adam): data, forward, backward, update;
- ``test batch``: the test net's forward on a batch of 10 (DetectionOutput + DetectionEvaluate),
  and ``DetectionOutput`` alone.

Run under ``benchmarks/ab.py`` it imports the tree that ``PYTHONPATH`` names (the base commit's
or this checkout's); alone, this checkout's.
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
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "ssd"))

import shapes  # noqa: E402  (imports brewnet before torch: a user's order, brewnet/execution/threads.py)
import torch  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import brewnet  # noqa: E402
from brewnet.proto.io import read_net  # noqa: E402


def build(folder: Path, size: int, batch: int, width: float = 1.0) -> dict[str, Path]:
    """The example's LMDBs (64 train, 20 test images) and its prototxts, prefetch off."""
    lm = folder / "labelmap.prototxt"
    for split, n, seed in (("train", 64, 1), ("test", 20, 2)):
        csv = shapes.make_dataset(folder, split, n, 128, seed)
        shapes.brewnet("create-annoset", csv, folder / f"{split}_lmdb", "--label-map", lm,
                       "--root-folder", f"{folder}/")
    out = {}
    for name, light in (("full", False), ("light", True)):
        out[name] = folder / f"train_{name}.prototxt"
        shapes.adapt(shapes.MODELS / "train.prototxt", out[name], 4, str(folder / "train_lmdb"),
                     batch, size, str(lm), light, width=width)
    out["test"] = folder / "test.prototxt"
    shapes.adapt(shapes.MODELS / "voc" / "MobileNetSSD_test.prototxt", out["test"], 4,
                 str(folder / "test_lmdb"), 10, size, str(lm), width=width)
    for path in out.values():           # batches loaded in the forward: timed in the thread
        net = read_net(str(path))
        for layer in net.layer:
            if layer.type == "AnnotatedData":
                layer.data_param.prefetch = 0
        path.write_text(text_format.MessageToString(net))
    return out


def solver_for(folder: Path, net: Path, name: str):
    path = folder / f"{name}_solver.prototxt"
    path.write_text(f'train_net: "{net}"\nbase_lr: 0.001\nlr_policy: "fixed"\ntype: "Adam"\n'
                    'momentum: 0.9\nmomentum2: 0.999\nweight_decay: 0.00005\nmax_iter: 100000\n'
                    'display: 0\nrandom_seed: 1\n')
    return brewnet.get_solver(str(path))


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=float, default=1.0, help="examples/ssd/shapes.py --width")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        protos = build(folder, a.size, a.batch, a.width)
        full = solver_for(folder, protos["full"], "full")
        light = solver_for(folder, protos["light"], "light")
        net = light.net
        data_full, data_light = full.net.layer_list[0], net.layer_list[0]
        loss_i = net.layer_index("mbox_loss")
        test = brewnet.Net(str(protos["test"]), brewnet.TEST, weights=None)
        test.share_with(net)
        det_i = test.layer_index("detection_out")
        light.step(2)                       # warm-up: thread choice, kernel checks
        test.forward()

        def forward():
            net.forward_tensors(start=1)

        def fwd_bwd():
            net.forward_tensors(start=1)
            net.backward_tensors(blob_diffs=False)

        def loss_layer():
            layer = net.layer_list[loss_i]
            bottoms = [net.blobs[b].tensor.detach().clone() for b in net.bottom_lists[loss_i]]
            for b in bottoms[:2]:
                b.requires_grad_(True)
            layer.forward(bottoms)[0].backward()

        det_bottoms = None

        def detection_output():
            test.layer_list[det_i].forward(det_bottoms)

        parts = {
            "data full": lambda: data_full.forward([]),
            "data light": lambda: data_light.forward([]),
            "forward": forward,
            "forward+backward": fwd_bwd,
            "MultiBoxLoss fwd+bwd": loss_layer,
            "step (light)": lambda: light.step(1),
            "test batch": lambda: test.forward(),
            "DetectionOutput": detection_output,
        }
        times: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(a.rounds):
            test.forward()
            det_bottoms = [test.blobs[b].tensor for b in test.bottom_lists[det_i]]
            for name, fn in parts.items():
                times[name].append(ms(fn))
        print(f"MobileNet-SSD {a.size} x {a.size} width {a.width:g}, batch {a.batch}, median of "
              f"{a.rounds} rounds (torch threads at the end: {torch.get_num_threads()})")
        for name, ts in times.items():      # name, then the number: benchmarks/ab.py's keys
            print(f"{name:<24} {statistics.median(ts):.1f} ms")


if __name__ == "__main__":
    main()
