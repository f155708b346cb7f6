"""``brewnet sweep``: the product of the --set lists, each variant's files equal to training it
alone, a table, a plot and a log per variant; bad keys and values say what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

from brewnet.analysis.logparse import parse_log
from brewnet.cli import main
from brewnet.many.sweep import SweepError, parse_sets, variants
from brewnet.solvers import get_solver
from helpers import random_digits_lmdb

NET = """name: "tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 8 backend: LMDB }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 10 backend: LMDB }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


@pytest.fixture
def solver_file(tmp_path):
    lmdb = random_digits_lmdb(tmp_path / "lmdb", 40, 6, seed=8)
    (tmp_path / "tiny.prototxt").write_text(NET.format(lmdb=lmdb))
    f = tmp_path / "tiny_solver.prototxt"
    f.write_text('net: "tiny.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 '
                 'max_iter: 6 display: 2 test_iter: 2 test_interval: 3 snapshot: 3 '
                 'random_seed: 5 solver_mode: CPU')
    return f


def test_product_of_the_lists(solver_file, tmp_path):
    vs = variants(str(solver_file), parse_sets(["base_lr=0.001,0.01,0.1", "random_seed=1,2"]),
                  str(tmp_path / "out"))
    assert [n for n, _ in vs] == ["s0_base_lr-0.001_random_seed-1", "s1_base_lr-0.001_random_seed-2",
                                  "s2_base_lr-0.01_random_seed-1", "s3_base_lr-0.01_random_seed-2",
                                  "s4_base_lr-0.1_random_seed-1", "s5_base_lr-0.1_random_seed-2"]
    p = vs[3][1]
    assert (np.float32(p.base_lr), p.random_seed, p.momentum) == (np.float32(0.01), 2, np.float32(0.9))
    assert p.snapshot_prefix == str(tmp_path / "out" / vs[3][0] / "tiny_solver")
    assert p.net == str(solver_file.parent / "tiny.prototxt")


def test_bad_keys_and_values():
    with pytest.raises(SweepError, match=r"--set basee_lr: not a SolverParameter field; did you mean 'base_lr'\?"):
        parse_sets(["basee_lr=0.1"])
    with pytest.raises(SweepError, match="--set max_iter: max_iter takes an integer, got '1.5'"):
        parse_sets(["max_iter=100,1.5"])
    with pytest.raises(SweepError, match="base_lr takes a number, got 'fast'"):
        parse_sets(["base_lr=fast"])
    with pytest.raises(SweepError, match="solver_mode takes one of CPU, GPU, got 'TPU'"):
        parse_sets(["solver_mode=TPU"])
    with pytest.raises(SweepError, match="expected KEY=V1,V2"):
        parse_sets(["base_lr"])


def test_cli_bad_input_is_one_line(solver_file, capsys):
    assert main(["sweep", "--solver", str(solver_file), "--set", "momentun=0.8,0.9"]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'momentum'?" in err and "Traceback" not in err
    assert main(["sweep", "--solver", str(solver_file), "--set", "test_interval=two"]) == 1
    assert "test_interval takes an integer, got 'two'" in capsys.readouterr().err


def test_sweep_together_equals_each_variant_alone(solver_file, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--solver", str(solver_file), "--set", "base_lr=0.01,0.1",
            "--set", "random_seed=1,2", "--out", str(out), "--no-fuse"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "(together)" in text and "acc best/final" in text and "final loss" in text
    names = [n for n, _ in variants(str(solver_file), parse_sets(argv[4:8:2]), str(tmp_path / "alone"))]
    assert all(n in text for n in names) and len(names) == 4
    assert (out / "sweep.png").stat().st_size > 0 and (out / "sweep.txt").read_text() in text
    for name, p in variants(str(solver_file), parse_sets(argv[4:8:2]), str(tmp_path / "alone")):
        files = sorted(x.name for x in (out / name).glob("*_iter_*"))
        assert files == ["tiny_solver_iter_3.caffemodel", "tiny_solver_iter_3.solverstate",
                         "tiny_solver_iter_3.solverstate.cursors.json",
                         "tiny_solver_iter_6.caffemodel", "tiny_solver_iter_6.solverstate",
                         "tiny_solver_iter_6.solverstate.cursors.json"]
        get_solver(p).solve()
        for f in (files[3], files[5]):      # the .solverstate names its own folder
            assert (out / name / f).read_bytes() == (tmp_path / "alone" / name / f).read_bytes(), f
        train, test = parse_log(out / name / "train.log")      # its own log, a plain one
        assert [r["NumIters"] for r in train] == [0, 2, 4]
        assert [r["NumIters"] for r in test] == [0, 3, 6]
    # The curves of an engine without callbacks (the fused one) come from the variant's log.
    from brewnet.many.sweep import Result
    from brewnet.tools.sweep import _curves_from_logs
    r = Result(names[1])
    _curves_from_logs([r], str(out))
    assert [i for i, _ in r.losses] == [0, 2, 4] and [i for i, _ in r.tests] == [0, 3, 6]
    assert set(r.tests[-1][1]) == {"acc", "loss"} and f"{r.best('acc'):.4g}" in text


def test_default_fuses_or_says_why_not(solver_file, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["sweep", "--solver", str(solver_file), "--set", "base_lr=0.01,0.1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "(fused)" in captured.out or (
        "(together)" in captured.out and "trained together, not fused: " in captured.err)
