"""examples/ssd/shapes.py, the worked SSD example: its copies of MobileNet-SSD's prototxts and a
run end to end on a tiny generated set."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from brewnet.proto.io import read_net
from helpers import MODELS, need

f32 = np.float32


def _shapes_example():
    path = Path(__file__).resolve().parents[1] / "examples" / "ssd" / "shapes.py"
    spec = importlib.util.spec_from_file_location("ssd_shapes_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_prototxts_train_from_scratch_with_short_bn_averages(tmp_path):
    """examples/ssd/shapes.py's copies of MobileNet-SSD's prototxts: 4 classes, 96 x 96 with the
    PriorBoxes scaled, and for a run of minutes from scratch the backbone's fine-tuning
    multipliers (0.1) lifted to 1 and every BatchNorm's moving average shortened (0.999 kept
    the first iterations' statistics: the test net's mAP was 10x below the train net's)."""
    ex, src = _shapes_example(), need(MODELS / "mobilenet-ssd")
    ex.adapt(src / "train.prototxt", tmp_path / "t.prototxt", 4, "db", 8, 96, "lm", True, 0.99, True)
    ex.adapt(src / "voc" / "MobileNetSSD_test.prototxt", tmp_path / "e.prototxt", 4, "db", 10, 96,
             "lm", bn_fraction=0.99)
    train, test = read_net(str(tmp_path / "t.prototxt")), read_net(str(tmp_path / "e.prototxt"))
    for net in (train, test):
        bn = [la for la in net.layer if la.type == "BatchNorm"]
        assert len(bn) == 35 and all(f32(la.batch_norm_param.moving_average_fraction) == f32(0.99)
                                     for la in bn)
        priors = {la.name: list(la.prior_box_param.min_size) for la in net.layer if la.type == "PriorBox"}
        assert priors["conv11_mbox_priorbox"] == [pytest.approx(60 * 96 / 300)]
    mults = {(p.lr_mult, p.decay_mult) for la in train.layer for p in la.param}
    assert mults == {(0, 0), (1, 1), (1, 0), (2, 0)}, mults      # no 0.1 or 0.2 left
    data = train.layer[0]
    assert not data.annotated_data_param.batch_sampler and not data.transform_param.HasField("expand_param")
    assert data.transform_param.mirror and data.data_param.batch_size == 8


def test_example_runs_end_to_end(tmp_path, capsys):
    """The worked example on a tiny set: data, LMDBs, prototxts, two iterations, the mAP line."""
    ex = _shapes_example()
    ex.main(["--out", str(tmp_path), "--models", str(need(MODELS / "mobilenet-ssd")),
             "--train", "8", "--test", "10", "--batch", "4", "--iters", "2", "--test-interval", "2"])
    out = capsys.readouterr().out
    assert "test mAP during training:" in out and "detection_eval = " in out, out
    assert (tmp_path / "ssd_shapes_iter_2.caffemodel").is_file()
