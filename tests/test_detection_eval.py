"""SSD's solver under ``eval_type: "detection"`` (weiliu89/caffe ``Solver::TestDetection``): a
tiny SSD trained a few iterations logs ``Test net output #0: detection_eval = mAP`` at its test,
the value ``brewnet test --ap-version`` reports on the same weights and batches, in lines that
Caffe's log parser reads; a bad eval_type, ap_version or test net output is a clear error."""
from __future__ import annotations

import logging

import cv2
import numpy as np
import pytest

from brewnet import Net, cli
from brewnet.analysis.logparse import parse_lines
from brewnet.data.annoset import annotated_datum
from brewnet.data.db import open_writer
from brewnet.solvers import SolverError, get_solver
from brewnet.solvers.detection_eval import DetectionMAP


def _boxes_lmdb(path, n=8, side=48):
    """Black images with one white rectangle each, labels 1 and 2 in turn."""
    rng = np.random.default_rng(7)
    with open_writer(str(path)) as w:
        for i in range(n):
            img = np.zeros((side, side, 3), np.uint8)
            x0, y0 = (int(v) for v in rng.integers(0, side // 2, 2))
            x1, y1 = x0 + int(rng.integers(10, side // 2)), y0 + int(rng.integers(10, side // 2))
            img[y0:y1, x0:x1] = 255
            ad = annotated_datum(cv2.imencode(".png", img)[1].tobytes(), (side, side),
                                 [("ab"[i % 2], x0, y0, x1, y1, False)], {"a": 1, "b": 2}, f"image {i}")
            w.put(f"{i:08d}_image{i}", ad.SerializeToString())
    return str(path)


def _data(phase, source):
    return f"""layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label"
  include {{ phase: {phase} }}
  transform_param {{ scale: 0.0078125 mean_value: 128 resize_param {{ height: 32 width: 32 }} }}
  data_param {{ source: "{source}" batch_size: 4 }} }}"""


HEAD = """layer { name: "f" type: "Convolution" bottom: "data" top: "f"
  convolution_param { num_output: 8 kernel_size: 8 stride: 8 weight_filler { type: "xavier" } } }
layer { name: "loc" type: "Convolution" bottom: "f" top: "loc"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loc_p" type: "Permute" bottom: "loc" top: "loc_p"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "loc_f" type: "Flatten" bottom: "loc_p" top: "loc_f" }
layer { name: "conf" type: "Convolution" bottom: "f" top: "conf"
  convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "conf_p" type: "Permute" bottom: "conf" top: "conf_p"
  permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conf_f" type: "Flatten" bottom: "conf_p" top: "conf_f" }
layer { name: "prior" type: "PriorBox" bottom: "f" bottom: "data" top: "prior"
  prior_box_param { min_size: 12 clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "mbox_loss" type: "MultiBoxLoss" bottom: "loc_f" bottom: "conf_f" bottom: "prior"
  bottom: "label" top: "mbox_loss" include { phase: TRAIN }
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  multibox_loss_param { num_classes: 3 overlap_threshold: 0.5 neg_pos_ratio: 3 code_type: CENTER_SIZE } }
layer { name: "conf_r" type: "Reshape" bottom: "conf_f" top: "conf_r" include { phase: TEST }
  reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "conf_s" type: "Softmax" bottom: "conf_r" top: "conf_s" include { phase: TEST }
  softmax_param { axis: 2 } }
layer { name: "conf_sf" type: "Flatten" bottom: "conf_s" top: "conf_sf" include { phase: TEST } }
layer { name: "det" type: "DetectionOutput" bottom: "loc_f" bottom: "conf_sf" bottom: "prior"
  top: "det" include { phase: TEST }
  detection_output_param { num_classes: 3 background_label_id: 0 code_type: CENTER_SIZE
    nms_param { nms_threshold: 0.45 top_k: 50 } keep_top_k: 20 confidence_threshold: 0.01 } }
layer { name: "detection_eval" type: "DetectionEvaluate" bottom: "det" bottom: "label"
  top: "detection_eval" include { phase: TEST }
  detection_evaluate_param { num_classes: 3 background_label_id: 0 overlap_threshold: 0.1 } }
"""


def _ssd(tmp_path, eval_lines: str, test_iter=2, max_iter=3):
    db = _boxes_lmdb(tmp_path / "boxes_lmdb")
    net = tmp_path / "ssd.prototxt"
    net.write_text(f'name: "tiny_ssd"\n{_data("TRAIN", db)}\n{_data("TEST", db)}\n{HEAD}')
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}"\ntest_iter: {test_iter}\ntest_interval: {max_iter}\n'
                      'test_initialization: false\nbase_lr: 0.01\nmomentum: 0.9\n'
                      f'lr_policy: "fixed"\nmax_iter: {max_iter}\ndisplay: 1\nrandom_seed: 3\n'
                      f'snapshot_prefix: "{tmp_path}/ssd"\nsolver_mode: CPU\n{eval_lines}\n')
    return net, solver


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("version", ["11point", "MaxIntegral", "Integral"])
def test_training_logs_the_map_brewnet_test_reports(tmp_path, caplog, version):
    net, solver = _ssd(tmp_path, f'eval_type: "detection"\nap_version: "{version}"\n'
                                 "show_per_class_result: true")
    with caplog.at_level(logging.INFO, logger="brewnet"):
        assert cli.main(["train", "--solver", str(solver)]) == 0
    trained = _messages(caplog)
    caplog.clear()
    weights = tmp_path / "ssd_iter_3.caffemodel"
    with caplog.at_level(logging.INFO, logger="brewnet"):
        assert cli.main(["test", "--model", str(net), "--weights", str(weights), "--iterations",
                         "2", "--ap-version", version, "--per-class"]) == 0
    tested = _messages(caplog)

    evals = [m for m in trained if "Test net output" in m]
    mine = [m for m in tested if m.startswith("detection_eval = ")]
    assert len(evals) == 1 and len(mine) == 1
    value = mine[0].split()[2]
    assert evals[0] == f"    Test net output #0: detection_eval = {value}"
    assert float(value) > 0                     # the batches hold detections that hit boxes
    # the per-class lines come before the output's, as the fork's; the same in both commands
    classes = [m for m in trained if m.startswith("class")]
    assert classes and classes == [m for m in tested if m.startswith("class")]
    assert trained.index(classes[-1]) < trained.index(evals[0])
    # Caffe's parse_log reads the test row
    _, test_rows = parse_lines(trained)
    assert len(test_rows) == 1 and test_rows[0]["NumIters"] == 3
    assert test_rows[0]["detection_eval"] == pytest.approx(float(value))


def test_solver_scores_outputs_with_detection_map(tmp_path):
    """``Solver.test`` returns the mAP per output: DetectionMAP over the DetectionEvaluate rows
    of the test batches (a fresh test net on the trained weights reads the same ones)."""
    net_path, solver_path = _ssd(tmp_path, 'eval_type: "detection"\nap_version: "11point"')
    solver = get_solver(str(solver_path))
    solver.step(2)
    scores = solver.test(0)
    solver.net.save(str(tmp_path / "w.caffemodel"))
    net = Net(str(net_path), phase=1, weights=str(tmp_path / "w.caffemodel"))
    m = DetectionMAP()
    for _ in range(2):
        net.forward()
        m.add(net.blobs["detection_eval"].data)
    assert sum(m.num_pos.values()) == 8 and m.dets
    assert scores == {"detection_eval": m.mean_ap("11point")}


@pytest.mark.parametrize("lines, words", [
    ('eval_type: "detect"', "Unknown evaluation type: eval_type 'detect' (known: classification, detection)"),
    ('eval_type: "detection"\nap_version: "VOC"', "Unknown ap_version 'VOC'"),
])
def test_bad_eval_settings_are_clear_errors(tmp_path, capsys, lines, words):
    _, solver = _ssd(tmp_path, lines)
    with pytest.raises(SolverError, match=words.replace("(", r"\(").replace(")", r"\)")):
        get_solver(str(solver))
    capsys.readouterr()
    assert cli.main(["train", "--solver", str(solver)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("brewnet train:")]
    assert len(err) == 1 and words in err[0]


def test_detection_needs_detection_evaluate_outputs(tmp_path):
    net, solver = _ssd(tmp_path, 'eval_type: "detection"')
    text = net.read_text() + \
        'layer { name: "n" type: "Reduction" bottom: "det" top: "n" include { phase: TEST } }\n'
    net.write_text(text)
    with pytest.raises(SolverError, match=r"test net #0 output 'n' comes from a Reduction layer"):
        get_solver(str(solver))
