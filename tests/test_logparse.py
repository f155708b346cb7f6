"""Caffe training logs: glog-format lines, Caffe's parse_log.py rows and CSVs, the plot."""
from __future__ import annotations

import datetime
import logging
import os
import re

import numpy as np
import pytest

from brewnet.analysis.glog import GlogFormatter, setup_logging
from brewnet.analysis.logparse import glog_time, learning_rates, parse_lines, parse_log, plot_log, write_csv
from brewnet.cli import main

# A LeNet run as the real `caffe train` logs it (glog header, multi-line solver dump before
# "Solving", the test at iteration 0 and 500, display every 100, lr policy inv).
CAFFE_LOG = """\
Log file created at: 2016/02/10 13:39:22
Running on machine: box
Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg
I0210 13:39:22.381027 25210 caffe.cpp:185] Using GPUs 0
I0210 13:39:22.542307 25210 solver.cpp:48] Initializing solver from parameters:\x20
test_iter: 100
test_interval: 500
base_lr: 0.01
display: 100
max_iter: 10000
lr_policy: "inv"
gamma: 0.0001
power: 0.75
momentum: 0.9
weight_decay: 0.0005
snapshot: 5000
snapshot_prefix: "examples/mnist/lenet"
solver_mode: GPU
net: "examples/mnist/lenet_train_test.prototxt"
I0210 13:39:22.542430 25210 solver.cpp:91] Creating training net from net file: examples/mnist/lenet_train_test.prototxt
I0210 13:39:22.672180 25210 solver.cpp:60] Solver scaffolding done.
I0210 13:39:22.672428 25210 caffe.cpp:219] Starting Optimization
I0210 13:39:22.672443 25210 solver.cpp:280] Solving LeNet
I0210 13:39:22.672446 25210 solver.cpp:281] Learning Rate Policy: inv
I0210 13:39:22.673140 25210 solver.cpp:338] Iteration 0, Testing net (#0)
I0210 13:39:24.213374 25210 solver.cpp:406]     Test net output #0: accuracy = 0.0856
I0210 13:39:24.213419 25210 solver.cpp:406]     Test net output #1: loss = 2.36926 (* 1 = 2.36926 loss)
I0210 13:39:24.237622 25210 solver.cpp:229] Iteration 0, loss = 2.38493
I0210 13:39:24.237669 25210 solver.cpp:245]     Train net output #0: loss = 2.38493 (* 1 = 2.38493 loss)
I0210 13:39:24.237690 25210 sgd_solver.cpp:106] Iteration 0, lr = 0.01
I0210 13:39:25.882417 25210 solver.cpp:229] Iteration 100 (61.0 iter/s, 1.64473s/100 iters), loss = 0.234513
I0210 13:39:25.882457 25210 solver.cpp:245]     Train net output #0: loss = 0.234513 (* 1 = 0.234513 loss)
I0210 13:39:25.882469 25210 sgd_solver.cpp:106] Iteration 100, lr = 0.00992565
I0210 13:39:27.512000 25210 solver.cpp:229] Iteration 200 (61.4 iter/s, 1.62958s/100 iters), loss = 0.164213
I0210 13:39:27.512040 25210 solver.cpp:245]     Train net output #0: loss = 0.164213 (* 1 = 0.164213 loss)
I0210 13:39:27.512052 25210 sgd_solver.cpp:106] Iteration 200, lr = 0.00985258
I0210 13:39:29.141000 25210 solver.cpp:229] Iteration 300 (61.4 iter/s, 1.629s/100 iters), loss = 0.179001
I0210 13:39:29.141040 25210 solver.cpp:245]     Train net output #0: loss = 0.179001 (* 1 = 0.179001 loss)
I0210 13:39:29.141052 25210 sgd_solver.cpp:106] Iteration 300, lr = 0.00978075
I0210 13:39:30.770000 25210 solver.cpp:229] Iteration 400 (61.4 iter/s, 1.629s/100 iters), loss = 0.0985231
I0210 13:39:30.770040 25210 solver.cpp:245]     Train net output #0: loss = 0.0985231 (* 1 = 0.0985231 loss)
I0210 13:39:30.770052 25210 sgd_solver.cpp:106] Iteration 400, lr = 0.00971013
I0210 13:39:30.801000 25210 solver.cpp:338] Iteration 500, Testing net (#0)
I0210 13:39:31.902500 25210 solver.cpp:406]     Test net output #0: accuracy = 0.9719
I0210 13:39:31.902540 25210 solver.cpp:406]     Test net output #1: loss = 0.0868139 (* 1 = 0.0868139 loss)
I0210 13:39:31.915000 25210 solver.cpp:229] Iteration 500 (87.3 iter/s, 1.145s/100 iters), loss = 0.0991583
I0210 13:39:31.915040 25210 solver.cpp:245]     Train net output #0: loss = 0.0991583 (* 1 = 0.0991583 loss)
I0210 13:39:31.915052 25210 sgd_solver.cpp:106] Iteration 500, lr = 0.00964069
"""

# Worked out by hand with Caffe's rules: seconds from 13:39:22.672443 (the "Solving" line);
# a row's rate is the last "lr =" before its first output line; row 0 takes row 1's rate.
TRAIN_CSV = ("NumIters,Seconds,LearningRate,loss\r\n"
             "0.0,1.565226,0.01,2.38493\r\n"
             "100.0,3.210014,0.01,0.234513\r\n"
             "200.0,4.839597,0.00992565,0.164213\r\n"
             "300.0,6.468597,0.00985258,0.179001\r\n"
             "400.0,8.097597,0.00978075,0.0985231\r\n"
             "500.0,9.242597,0.00971013,0.0991583\r\n")
TEST_CSV = ("NumIters,Seconds,LearningRate,accuracy,loss\r\n"
            "0.0,1.540931,0.00971013,0.0856,2.36926\r\n"
            "500.0,9.230057,0.00971013,0.9719,0.0868139\r\n")


@pytest.fixture
def caffe_log(tmp_path):
    path = tmp_path / "caffe.INFO"
    path.write_text(CAFFE_LOG)
    return path


@pytest.fixture(autouse=True)
def _restore_brewnet_logger():
    logger = logging.getLogger("brewnet")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_caffe_log_rows(caffe_log):
    train, test = parse_log(caffe_log)
    assert [list(r) for r in train] == [["NumIters", "Seconds", "LearningRate", "loss"]] * 6
    assert [r["NumIters"] for r in train] == [0, 100, 200, 300, 400, 500]
    assert [r["loss"] for r in train] == [2.38493, 0.234513, 0.164213, 0.179001, 0.0985231, 0.0991583]
    assert [r["accuracy"] for r in test] == [0.0856, 0.9719]
    assert test[1]["Seconds"] == pytest.approx(31.9025 - 22.672443, abs=1e-9)


def test_parse_log_command_writes_caffe_csvs(caffe_log, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["parse-log", str(caffe_log), str(out)]) == 0
    assert (out / "caffe.INFO.train").read_bytes().decode() == TRAIN_CSV
    assert (out / "caffe.INFO.test").read_bytes().decode() == TEST_CSV
    # default folder: beside the log; Caffe's single-dash flag spelling; another delimiter
    assert main(["parse-log", str(caffe_log), "-delimiter", "\t"]) == 0
    assert (tmp_path / "caffe.INFO.test").read_text().splitlines()[1] == "0.0\t1.540931\t0.00971013\t0.0856\t2.36926"


def test_rules_kept_and_crashes_avoided():
    lines = CAFFE_LOG.splitlines(keepends=True)
    # An interrupted run: the last test row is incomplete and is dropped, as Caffe drops it.
    cut = lines[:-6] + ["I0210 13:39:31.902500 25210 solver.cpp:406]     Test net output #0: accuracy = 0.97\n"]
    train, test = parse_lines(cut, 2016)
    assert [r["NumIters"] for r in test] == [0.0]          # the lone complete row is kept
    assert [r["NumIters"] for r in train] == [0, 100, 200, 300, 400]
    # Output lines before the first "Iteration" line and everything before "Solving" are ignored.
    early = ["I0210 13:39:22.000000 1 solver.cpp:1]     Train net output #0: loss = 9\n"]
    train2, _ = parse_lines(early + lines, 2016)
    assert [r["loss"] for r in train2][:1] == [2.38493]
    # No "Solving" line (a log cut at the start): timed from its first timestamp.
    tail = lines[[i for i, l in enumerate(lines) if "Iteration 100 (" in l][0]:]
    train3, _ = parse_lines(tail, 2016)
    assert [r["NumIters"] for r in train3] == [100, 200, 300, 400, 500]
    assert train3[0]["Seconds"] == pytest.approx(0.00004) and train3[1]["Seconds"] == pytest.approx(1.629623)


def test_glog_time_and_new_year():
    assert glog_time("I0210 13:39:22.381027 25210 caffe.cpp:185] x", 2016) == \
        datetime.datetime(2016, 2, 10, 13, 39, 22, 381027)
    assert glog_time("test_iter: 100", 2016) is None
    lines = ["I1231 23:59:59.500000 1 solver.cpp:1] Solving X\n",
             "I1231 23:59:59.600000 1 solver.cpp:1] Iteration 0, loss = 1\n",
             "I1231 23:59:59.600000 1 solver.cpp:1]     Train net output #0: loss = 1\n",
             "I0101 00:00:01.500000 1 solver.cpp:1] Iteration 10, loss = 0.5\n",
             "I0101 00:00:01.500000 1 solver.cpp:1]     Train net output #0: loss = 0.5\n"]
    train, _ = parse_lines(lines, 2016)
    assert [r["Seconds"] for r in train] == [pytest.approx(0.1), pytest.approx(2.0)]


def test_empty_table_is_a_header(tmp_path):
    write_csv(tmp_path / "x.test", [])
    assert (tmp_path / "x.test").read_text() == "NumIters,Seconds,LearningRate\n"


def test_glog_formatter_prefix_reads_back():
    rec = logging.LogRecord("brewnet", logging.WARNING, "/a/b/solver.py", 218, "Iteration %d, loss = %g",
                            (100, 0.3), None)
    rec.created = datetime.datetime(2024, 11, 30, 13, 14, 15, 123456).timestamp()
    line = GlogFormatter().format(rec)
    m = re.fullmatch(r"W1130 13:14:15\.123456 ( *\d+) solver\.py:218\] Iteration 100, loss = 0\.3", line)
    assert m and len(m.group(1)) >= 5 and m.group(1) == m.group(1).strip().rjust(len(m.group(1)))
    # Caffe's extract_seconds reads the first two whitespace fields
    assert glog_time(line, 2024) == datetime.datetime(2024, 11, 30, 13, 14, 15, 123456)
    for level, letter in [(logging.INFO, "I"), (logging.DEBUG, "I"), (logging.ERROR, "E"),
                          (logging.CRITICAL, "F")]:
        rec.levelno = level
        assert GlogFormatter().format(rec)[0] == letter


def test_setup_logging(monkeypatch):
    import io

    buf = io.StringIO()
    monkeypatch.setenv("GLOG_minloglevel", "1")
    logger = setup_logging(stream=buf)
    setup_logging(stream=buf)                         # idempotent: still one handler
    logger.info("hidden")
    logger.warning("shown %d", 1)
    assert buf.getvalue().count("shown 1") == 1 and "hidden" not in buf.getvalue()
    assert setup_logging("DEBUG", buf).level == logging.DEBUG
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging("LOUD", buf)


def test_plot_writes_png(caffe_log, tmp_path):
    from PIL import Image

    out = tmp_path / "curves.png"
    assert plot_log(caffe_log, out) == str(out)
    img = np.asarray(Image.open(out).convert("L"), dtype=np.float32)
    assert img.shape[0] > 600 and img.std() > 5          # three panels with lines on them
    assert learning_rates(caffe_log) == ([0.0, 100.0, 200.0, 300.0, 400.0, 500.0],
                                         [0.01, 0.00992565, 0.00985258, 0.00978075, 0.00971013, 0.00964069])
    assert main(["plot", str(caffe_log)]) == 0
    assert os.path.getsize(str(caffe_log) + ".png") > 10_000


def test_plot_rejects_a_non_training_log(tmp_path, capsys):
    p = tmp_path / "x.log"
    p.write_text("I0210 13:39:22.381027 25210 caffe.cpp:185] Use CPU.\n")
    assert main(["plot", str(p)]) == 1
    assert "is it a training log?" in capsys.readouterr().err
