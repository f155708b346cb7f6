"""The same bits however a net is run, with the environment a user has: nideep's merge and
``brewnet train --solver A --solver B --solver C`` end where each net trained alone ends, whatever
the import order, although the merged/together run uses another torch thread count than the
small nets alone (brewnet/threads.py); the kernels that split sums between threads
(brewnet/determinism.py) give the same bits on 1, 2 and 4 threads.

The flows run as user scripts in fresh processes: this test process imported torch before
brewnet (helpers.py), which would put every solver on one thread and hide the difference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import random_digits_lmdb

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def user_env() -> dict:
    """os.environ without the switches a user does not set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BREWNET_THREADS", "OMP_NUM_THREADS", "MKL_CBWR", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                        "BREWNET_DETERMINISTIC", "BREWNET_TOGETHER_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


MERGE_SCRIPT = r'''
import sys, json, hashlib
if sys.argv[1] == "torch":
    import torch                                # a script that imports torch first
import brewnet as caffe
from google.protobuf import text_format
from brewnet.proto import caffe_pb2 as pb
from test_merge import conv_net, ip_net, mlp_two_losses, params_of, solver
from pathlib import Path

tmp, lmdb = Path(sys.argv[2]), sys.argv[3]
# batch 64; the conv net's 20 5x5 filters do 37 MFLOP (the cores), the other two are tiny
nets = [conv_net(lmdb, 64, 20, 5), mlp_two_losses(lmdb, 64), ip_net(lmdb, 64)]
alone, initial, counts = [], [], []
for i, net in enumerate(nets):
    s, f = solver(tmp, f"n{i}", net, seed=100 + i, momentum=0.9, iters=7)
    initial.append(params_of(s.net))
    s.step(7)
    counts.append(s.threads.choice)
    alone.append(params_of(s.net))
merged_text = caffe.merge_indep_net_spec(nets)
m, _ = solver(tmp, "merged", text_format.Parse(merged_text, pb.NetParameter()), seed=7,
              momentum=0.9, iters=7)
for i, init in enumerate(initial):
    for layer, blobs in init.items():
        for dst, src in zip(m.net.params[f"{layer}_nidx_{i:02d}"], blobs):
            dst.data[...] = src
m.step(7)
merged = [params_of(m.net, f"_nidx_{i:02d}") for i in range(len(nets))]
equal = [all(x.tobytes() == y.tobytes() for k in a for x, y in zip(a[k], b[k]))
         for a, b in zip(alone, merged)]
trained = [any((a[k][0] != i[k][0]).any() for k in a) for a, i in zip(alone, initial)]
digest = hashlib.sha256(b"".join(x.tobytes() for a in alone for k in sorted(a) for x in a[k]))
print(json.dumps({"equal": equal, "trained": trained, "alone_threads": counts,
                  "merged_threads": m.threads.choice, "digest": digest.hexdigest()}))
'''


def run_script(text: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", text, *map(str, args)], capture_output=True,
                         text=True, env=user_env(), cwd=TESTS, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mnist_like(tmp_path_factory):
    return random_digits_lmdb(tmp_path_factory.mktemp("same_bits") / "digits_lmdb", 256, 28, seed=12)


def test_nideep_three_topologies_merged_equal_alone_either_import_order(tmp_path, mnist_like):
    runs = {}
    for first in ("brewnet", "torch"):
        (tmp_path / first).mkdir()
        runs[first] = r = run_script(MERGE_SCRIPT, first, tmp_path / first, mnist_like)
        assert r["equal"] == [True, True, True], r
        assert all(r["trained"]), r
    if os.cpu_count() and len(os.sched_getaffinity(0)) > 1:
        # what made main's merged run differ: it runs on the cores, the small nets on one
        r = runs["brewnet"]
        assert r["merged_threads"] > 1 and r["alone_threads"][1:] == [1, 1], r
    assert runs["brewnet"]["digest"] == runs["torch"]["digest"]    # import order: same bits


LENET = """name: "LeNet"
layer {{ name: "mnist" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 64 backend: LMDB }} }}
layer {{ name: "mnist" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 100 backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1" param {{ lr_mult: 1 }} param {{ lr_mult: 2 }}
  convolution_param {{ num_output: 20 kernel_size: 5 stride: 1 weight_filler {{ type: "xavier" }}
                       bias_filler {{ type: "constant" }} }} }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2" param {{ lr_mult: 1 }} param {{ lr_mult: 2 }}
  convolution_param {{ num_output: 50 kernel_size: 5 stride: 1 weight_filler {{ type: "xavier" }}
                       bias_filler {{ type: "constant" }} }} }}
layer {{ name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1" param {{ lr_mult: 1 }} param {{ lr_mult: 2 }}
  inner_product_param {{ num_output: 500 weight_filler {{ type: "xavier" }} bias_filler {{ type: "constant" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" param {{ lr_mult: 1 }} param {{ lr_mult: 2 }}
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} bias_filler {{ type: "constant" }} }} }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""
SOLVERS = {   # SGD/step, Adam/fixed, Nesterov/inv, as the issue tried them: 30 iterations
    "sgd": 'type: "SGD" base_lr: 0.01 lr_policy: "step" gamma: 0.5 stepsize: 10 momentum: 0.9 '
           'weight_decay: 0.0005 random_seed: 11',
    "adam": 'type: "Adam" base_lr: 0.001 lr_policy: "fixed" momentum: 0.9 momentum2: 0.999 '
            'delta: 1e-8 random_seed: 12',
    "nesterov": 'type: "Nesterov" base_lr: 0.01 lr_policy: "inv" gamma: 0.0001 power: 0.75 '
                'momentum: 0.9 weight_decay: 0.0005 random_seed: 13',
}


def brewnet_cli(cwd: Path, *args) -> str:
    out = subprocess.run([sys.executable, "-m", "brewnet", *args], capture_output=True, text=True,
                         env=user_env(), cwd=cwd, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_cli_three_solver_types_together_byte_identical_to_alone(tmp_path, mnist_like):
    for run in ("alone", "together"):
        d = tmp_path / run
        d.mkdir()
        (d / "lenet.prototxt").write_text(LENET.format(lmdb=mnist_like))
        for name, text in SOLVERS.items():
            (d / f"{name}_solver.prototxt").write_text(
                text + ' net: "lenet.prototxt" max_iter: 30 display: 10 test_iter: 2 '
                f'test_interval: 15 snapshot: 30 snapshot_prefix: "{name}" solver_mode: CPU')
    logs = {name: brewnet_cli(tmp_path / "alone", "train", "--solver", f"{name}_solver.prototxt")
            for name in SOLVERS}
    together = brewnet_cli(tmp_path / "together", "train",
                           *[a for n in SOLVERS for a in ("--solver", f"{n}_solver.prototxt")])
    files = sorted(p.name for p in (tmp_path / "alone").glob("*_iter_30.*"))
    assert len(files) >= 6                       # .caffemodel and .solverstate per solver
    for f in files:
        assert (tmp_path / "together" / f).read_bytes() == (tmp_path / "alone" / f).read_bytes(), f
    for k, name in enumerate(SOLVERS):          # the test outputs and losses logged, too
        assert values(logs[name]) == values(together, f"[s{k}] ") != []


def values(log: str, prefix: str = "") -> list[str]:
    """The logged losses and net outputs (not the timings) of one solver's lines."""
    out = []
    for line in log.splitlines():
        if prefix in line and ("Test net output" in line or "Train net output" in line):
            out.append(line.split("output #", 1)[1])
        elif prefix in line and "Iteration" in line and "loss = " in line:
            out.append(line.split("Iteration", 1)[1].split(" ")[1] + line.split("loss = ", 1)[1])
    return out


LAYER_SCRIPT = r'''
import json, sys
import brewnet
import torch
sys.path.insert(0, sys.argv[1])
from thread_bits import layer_rows, nets
rows = []
for name in ("lenet", "ip", "cifar10_quick"):
    rows += layer_rows(name, *nets()[name], [1, 2, 4])
print(json.dumps(rows))
'''


def test_every_layer_of_lenet_cifar_and_ip_same_bits_on_1_2_4_threads():
    """Each layer alone, forward and backward, at 1, 2 and 4 threads (benchmarks/thread_bits.py's
    per-layer table). 4 threads oversubscribe a 2-core machine: MKL's matrix products in
    LeNet conv1's per-image weight gradient then differ (measured), so with fewer than 4 cores
    that run is checked in deterministic mode, which computes it on one thread."""
    env_det = len(os.sched_getaffinity(0)) < 4
    script = LAYER_SCRIPT.replace("import brewnet\n", "import brewnet\nbrewnet.set_deterministic("
                                  f"{env_det})\n")
    rows = run_script(script, ROOT / "benchmarks")
    assert rows == []


def test_cli_deterministic_same_files_on_one_and_two_threads(tmp_path, mnist_like):
    """``brewnet train --deterministic``: the thread count (here forced, 1 and 2) leaves every
    byte of the snapshot as it is."""
    for n in ("1", "2"):
        d = tmp_path / n
        d.mkdir()
        (d / "lenet.prototxt").write_text(LENET.format(lmdb=mnist_like))
        (d / "solver.prototxt").write_text(
            SOLVERS["sgd"] + ' net: "lenet.prototxt" max_iter: 10 snapshot: 10 '
            'snapshot_prefix: "lenet" solver_mode: CPU')
        out = subprocess.run([sys.executable, "-m", "brewnet", "train", "--deterministic",
                              "--solver", "solver.prototxt"], capture_output=True, text=True,
                             env=dict(user_env(), BREWNET_THREADS=n), cwd=d, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    for f in ("lenet_iter_10.caffemodel", "lenet_iter_10.solverstate"):
        assert (tmp_path / "1" / f).read_bytes() == (tmp_path / "2" / f).read_bytes(), f


def fused_setup(folder: Path, lmdb: str, names=("sgd", "nesterov")) -> list[str]:
    folder.mkdir()
    (folder / "lenet.prototxt").write_text(LENET.format(lmdb=lmdb))
    files = []
    for name in names:
        (folder / f"{name}_solver.prototxt").write_text(
            SOLVERS[name] + ' net: "lenet.prototxt" max_iter: 20 snapshot: 20 test_iter: 1 '
            f'test_interval: 10 snapshot_prefix: "{name}" solver_mode: CPU')
        files.append(f"{name}_solver.prototxt")
    return files


def test_cli_fuse_exact_byte_identical_to_alone(tmp_path, mnist_like):
    """``brewnet train --fuse exact``: each net's snapshot is the one it writes alone."""
    files = fused_setup(tmp_path / "alone", mnist_like)
    fused_setup(tmp_path / "fused", mnist_like)
    for f in files:
        brewnet_cli(tmp_path / "alone", "train", "--solver", f)
    brewnet_cli(tmp_path / "fused", "train", "--fuse", "exact",
                *[a for f in files for a in ("--solver", f)])
    names = sorted(p.name for p in (tmp_path / "alone").glob("*_iter_20.*"))
    assert len(names) >= 4
    for n in names:
        assert (tmp_path / "fused" / n).read_bytes() == (tmp_path / "alone" / n).read_bytes(), n


def test_cli_fuse_float64_equals_each_net_alone_to_1e_10(tmp_path, mnist_like):
    """``brewnet train --fuse --dtype float64`` (the wide formulation): the snapshots, in
    Caffe's double_data, equal each solver trained alone in float64 to 1e-10 relative."""
    from brewnet.many.fused import as_dtype
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import read_binary
    from brewnet.solvers import get_solver

    files = fused_setup(tmp_path / "fused", mnist_like)
    brewnet_cli(tmp_path / "fused", "train", "--fuse", "--dtype", "float64",
                *[a for f in files for a in ("--solver", f)])
    cwd = os.getcwd()
    os.chdir(tmp_path / "fused")
    try:
        for f, name in zip(files, ("sgd", "nesterov")):
            net = read_binary(f"{name}_iter_20.caffemodel", pb.NetParameter())
            got = [torch.tensor(list(b.double_data), dtype=torch.float64) for layer in net.layer for b in layer.blobs]
            s = get_solver(f)
            as_dtype(s, torch.float64)
            s.step(20)
            want = [t.detach().reshape(-1) for t in s.net.learnable]
            assert len(got) == len(want) == 8 and all(g.numel() for g in got)
            for g, w in zip(got, want):
                assert float((g - w).abs().max() / w.abs().max()) <= 1e-10
    finally:
        os.chdir(cwd)


def test_cli_fuse_same_files_on_one_and_two_threads(tmp_path, mnist_like):
    """The wide fused net's run does not depend on the thread count either (its batched
    products run MKL on torch's threads when large: brewnet.many.fused_layers)."""
    for n in ("1", "2"):
        files = fused_setup(tmp_path / n, mnist_like)
        out = subprocess.run([sys.executable, "-m", "brewnet", "train", "--fuse",
                              *[a for f in files for a in ("--solver", f)]], capture_output=True,
                             text=True, env=dict(user_env(), BREWNET_THREADS=n), cwd=tmp_path / n,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "1").glob("*_iter_20.*"))
    assert len(names) >= 4
    for f in names:
        assert (tmp_path / "1" / f).read_bytes() == (tmp_path / "2" / f).read_bytes(), f


def test_new_switches_refuse_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    """``--dtype`` without ``--fuse``, an unknown ``--fuse`` formulation and a bad
    ``BREWNET_DETERMINISTIC`` are one clear line each, no traceback."""
    from brewnet import determinism
    from brewnet.cli import main

    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "missing.prototxt" base_lr: 0.01 max_iter: 1')
    assert main(["train", "--solver", str(solver), "--dtype", "float64"]) == 1
    err = capsys.readouterr().err
    assert "--dtype float64 trains fused nets (--fuse)" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["train", "--fuse", "fastest", "--solver", str(solver), "--solver", str(solver)])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
    monkeypatch.setenv("BREWNET_DETERMINISTIC", "yes")
    monkeypatch.setitem(determinism._state, "on", None)
    with pytest.raises(ValueError, match="BREWNET_DETERMINISTIC='yes'"):
        determinism.is_deterministic()
