"""owl's heatmaps (brewnet.analysis.heatmap, brewnet heatmap): the weighting rule against numpy,
the data layer's transform undone, the pictures written, and the errors."""
from __future__ import annotations

import numpy as np

from brewnet.analysis.heatmap import heatmap, undo_transform
from brewnet.cli import main
from brewnet.proto import caffe_pb2 as pb
from test_extract import model  # noqa: F401  (a tiny LMDB, a Data-layer net and its weights)


def test_owl_rule_against_numpy():
    rng = np.random.default_rng(0)
    f = rng.standard_normal((4, 3, 5)).astype(np.float32)
    f[2] += 5 * (np.arange(15).reshape(3, 5) == 7)          # one channel with a strong peak
    w = [(c.max() - c.mean()) ** 2 for c in f.astype(np.float64)]
    want = sum(wc * c for wc, c in zip(w, f.astype(np.float64)))
    np.testing.assert_allclose(heatmap(f, (3, 5)), want, rtol=1e-5)
    big = heatmap(f, (6, 10))                                # resized to the input
    assert big.shape == (6, 10) and np.unravel_index(big.argmax(), big.shape)[0] in (2, 3)


def test_undo_transform_scale_and_mean_values():
    tp = pb.TransformationParameter(scale=0.5)
    tp.mean_value.extend([10, 20, 30])
    img = np.array([[[100.0]], [[150.0]], [[200.0]]])       # B, G, R after the transform
    rgb = undo_transform(img, tp)
    assert rgb.shape == (1, 1, 3) and rgb.dtype == np.uint8
    # data / scale + mean = B 210, G 320, R 430 -> clipped to [0, 255], shown as RGB
    np.testing.assert_array_equal(rgb[0, 0], [255, 255, 210])


def test_cli_writes_one_picture_per_image_and_a_sheet(model, tmp_path):
    net_file, weights = model
    out = tmp_path / "hm"
    assert main(["heatmap", "--model", str(net_file), "--weights", str(weights), "--blob", "conv",
                 "--out", str(out), "--iterations", "2"]) == 0
    names = sorted(p.name for p in out.iterdir())           # 2 batches of 4 images
    assert names == sorted([f"heatmap_{k:04d}.png" for k in range(8)] + ["contact_sheet.png"])
    assert (out / "contact_sheet.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_errors(model, tmp_path, capsys):
    net_file, weights = model
    args = ["heatmap", "--model", str(net_file), "--weights", str(weights), "--out", str(tmp_path)]
    assert main(args + ["--blob", "ip"]) == 1
    assert "needs an N x C x H x W blob" in capsys.readouterr().err
    assert main(args + ["--blob", "nope"]) == 1
    assert "no blob 'nope'" in capsys.readouterr().err
    assert main(args + ["--blob", "conv", "--images", "a.png"]) == 1
    assert "needs a net with an Input layer" in capsys.readouterr().err
