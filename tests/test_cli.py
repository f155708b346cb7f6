"""The ``brewnet`` command line: help, flags as Caffe spells them, train/test/time/device-query."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import brewnet as caffe
from brewnet.analysis.logparse import parse_log
from brewnet.cli import COMMANDS, main
from brewnet.layers import LAYERS
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import blob_to_array, read_binary, read_net, write_text
from helpers import GOLDEN, MODELS, need

REPO = Path(__file__).resolve().parents[1]
LENET_DEPLOY = MODELS / "bvlc" / "examples" / "mnist" / "lenet.prototxt"
ETHEREON = MODELS / "trained" / "lenet_mnist_ethereon" / "examples" / "mnist"
NO_CUDA = not torch.cuda.is_available()

TINY_NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 1 dim: 8 dim: 8 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
TINY_SOLVER = """
net: "tiny.prototxt"
test_iter: 2
test_interval: 10
base_lr: 0.1
momentum: 0.9
lr_policy: "step"
gamma: 0.5
stepsize: 10
display: 5
max_iter: {max_iter}
snapshot: 10
snapshot_prefix: "snap/tiny"
solver_mode: CPU
random_seed: 1
"""


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Commands point the 'brewnet' logger at the captured stderr and size torch's threads;
    undo both after each test."""
    logger = logging.getLogger("brewnet")
    handlers, level, threads = list(logger.handlers), logger.level, torch.get_num_threads()
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def log_messages(err: str) -> list[str]:
    """The messages of glog-format lines, prefix checked and removed."""
    out = []
    for line in err.splitlines():
        m = re.match(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] (.*)$", line)
        if m:
            out.append(m.group(1))
    return out


# -- parsing -------------------------------------------------------------------------------
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: brewnet {command}") and COMMANDS[command].HELP.split()[0] in out


def test_version_and_top_level_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"brewnet {caffe.__version__}"
    assert main([]) == 1
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "test", "time", "device-query", "plot", "parse-log"))


@pytest.mark.parametrize("argv, hint", [
    (["train", "-solvr", "s.prototxt"], "--solvr (did you mean --solver?)"),
    (["train", "--solver", "s", "--sigint-effect", "stop"], "did you mean --sigint_effect?"),
    (["time", "--model", "m", "-iteratons=3"], "--iteratons=3 (did you mean --iterations?)"),
    (["test", "-model", "m", "-weigths", "w"], "did you mean --weights?"),
    (["trian"], "did you mean 'train'?"),
    (["device_query"], "did you mean 'device-query'?"),
    (["time", "--model", "m", "--phase", "TST"], "did you mean 'TEST'?"),
])
def test_mistyped_flag_or_command_suggests_the_close_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert hint in err, err


def test_train_needs_a_solver(capsys):
    with pytest.raises(SystemExit):
        main(["train"])
    assert "the following arguments are required: --solver" in capsys.readouterr().err


# -- time ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", [["--model", "{m}", "--iterations", "3"],
                                      ["-model", "{m}", "-iterations", "3"],
                                      ["-model={m}", "-iterations=3"]])
def test_time_lenet_deploy(spelling, capsys):
    argv = ["time"] + [a.format(m=LENET_DEPLOY) for a in spelling]
    assert main(argv) == 0
    msgs = log_messages(capsys.readouterr().err)
    layers = ["data", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "prob"]
    assert [m for m in msgs if m.startswith("Iteration:")] == [
        m for m in msgs if re.fullmatch(r"Iteration: [123] forward-backward time: [\d.e+-]+ ms\.", m)]
    assert sum(m.startswith("Iteration:") for m in msgs) == 3
    per = {}
    for m in msgs:
        r = re.fullmatch(r" *(\w+)\t(forward|backward): ([\d.e+-]+) ms\.", m)
        if r:
            per[r.group(1), r.group(2)] = float(r.group(3))
    assert sorted(per) == sorted((l, d) for l in layers for d in ("forward", "backward"))
    summary = {}
    for key in ("Average Forward pass", "Average Backward pass", "Average Forward-Backward", "Total Time"):
        [line] = [m for m in msgs if m.startswith(key + ":")]
        r = re.fullmatch(re.escape(key) + r": ([\d.e+-]+) ms\.", line)
        assert r, line
        summary[key] = float(r.group(1))
    # Layer intervals nest inside the pass timers, the passes inside the total.
    fw = sum(per[l, "forward"] for l in layers)
    bw = sum(per[l, "backward"] for l in layers)
    assert 0 < fw <= summary["Average Forward pass"] * 1.001
    assert 0 < bw <= summary["Average Backward pass"] * 1.001
    assert (summary["Average Forward pass"] + summary["Average Backward pass"]
            <= summary["Average Forward-Backward"] * 1.001)
    assert summary["Total Time"] == pytest.approx(3 * summary["Average Forward-Backward"], rel=1e-4)
    # A deploy net is timed as it would train: the learnable layers do backward work.
    assert per["conv2", "backward"] > 0 and per["ip1", "backward"] > 0


def test_time_backward_is_the_real_gradient():
    """The per-layer backward that ``time`` measures computes the net's true gradients."""
    from brewnet.analysis.timing import layerwise_gradients

    text = LENET_DEPLOY.read_text().replace("dim: 64", "dim: 3")
    param = text_format.Parse(text, pb.NetParameter())
    del param.layer[-1]                                      # drop the Softmax 'prob'
    label = param.layer.add(name="label", type="Input", top=["label"])
    label.input_param.shape.add().dim.append(3)
    param.layer.add(name="loss", type="SoftmaxWithLoss", bottom=["ip2", "label"], top=["loss"])
    net = caffe.Net(param, caffe.TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal((3, 1, 28, 28)).astype(np.float32)
    net.blobs["label"].data[...] = [1, 7, 3]
    net.forward()
    net.backward()
    diffs, grads = layerwise_gradients(net)
    assert "data" not in diffs and "label" not in diffs      # nothing to learn behind them
    for name in ("conv1", "pool1", "conv2", "pool2", "ip1", "ip2"):
        np.testing.assert_allclose(diffs[name].numpy(), net.blobs[name].diff, rtol=1e-4, atol=1e-7, err_msg=name)
    for lname, blobs in net.params.items():
        for j, b in enumerate(blobs):
            np.testing.assert_allclose(grads[lname, j].numpy(), b.diff, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{lname}[{j}]")


@pytest.mark.skipif("Data" not in LAYERS, reason="the LMDB Data layer has not landed yet")
def test_time_with_a_missing_lmdb_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = MODELS / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt"
    assert main(["time", "--model", str(src), "--iterations", "1"]) == 1
    err = capsys.readouterr().err
    assert "brewnet time:" in err and "mnist_train_lmdb" in err


# -- test ----------------------------------------------------------------------------------
def _lenet_reference(c: float):
    """LeNet on an image of constant value c, in numpy from the caffemodel's blobs: every
    feature map is constant, so conv = c * sum(w) + b and max pooling keeps the value."""
    model = read_binary(need(ETHEREON / "lenet_iter_10000.caffemodel"), pb.NetParameter())
    w = {l.name: [blob_to_array(b).astype(np.float64) for b in l.blobs] for l in model.layer if l.blobs}
    h = c * w["conv1"][0].sum(axis=(1, 2, 3)) + w["conv1"][1]
    h = w["conv2"][0].sum(axis=(2, 3)) @ h + w["conv2"][1]
    x = np.repeat(h, 16)                                   # (50, 4, 4) flattened
    y = np.maximum(w["ip1"][0] @ x + w["ip1"][1], 0)
    z = w["ip2"][0] @ y + w["ip2"][1]
    p = np.exp(z - z.max())
    return p / p.sum()


def _constant_lenet(tmp_path, c: float, label: int) -> Path:
    deploy = read_net(ETHEREON / "lenet.prototxt")
    net = pb.NetParameter(name="LeNetConstant")
    text_format.Parse(f"""
      name: "data" type: "DummyData" top: "data" top: "label"
      dummy_data_param {{ shape {{ dim: 2 dim: 1 dim: 28 dim: 28 }} shape {{ dim: 2 }}
        data_filler {{ type: "constant" value: {c} }} data_filler {{ type: "constant" value: {label} }} }}
    """, net.layer.add())
    net.layer.extend([l for l in deploy.layer if l.type not in ("Input", "Softmax")])
    net.layer.add(name="accuracy", type="Accuracy", bottom=["ip2", "label"], top=["accuracy"])
    net.layer.add(name="loss", type="SoftmaxWithLoss", bottom=["ip2", "label"], top=["loss"])
    path = tmp_path / "lenet_constant.prototxt"
    write_text(path, net)
    return path


@pytest.mark.parametrize("hit", [True, False])
def test_test_command_scores_lenet(hit, tmp_path, capsys):
    p = _lenet_reference(0.5)
    label = int(p.argmax()) if hit else int(p.argmin())
    model = _constant_lenet(tmp_path, 0.5, label)
    argv = ["test", "-model", str(model), "-weights", str(ETHEREON / "lenet_iter_10000.caffemodel"),
            "-iterations", "3"]
    assert main(argv) == 0
    msgs = log_messages(capsys.readouterr().err)
    assert "Running for 3 iterations." in msgs
    batches = [m for m in msgs if m.startswith("Batch ")]
    # outputs in Caffe's order (sorted by name), one line per element per batch
    assert [b.split(" =")[0] for b in batches] == [f"Batch {i}, {n}" for i in range(3) for n in ("accuracy", "loss")]
    loss_ref = -np.log(p[label])
    [loss_line] = [m for m in msgs if m.startswith("Loss: ")]
    assert float(loss_line[6:]) == pytest.approx(loss_ref, rel=2e-5)
    [acc] = [m for m in msgs if m.startswith("accuracy = ")]
    assert acc == f"accuracy = {1 if hit else 0}"
    [loss] = [m for m in msgs if m.startswith("loss = ")]
    r = re.fullmatch(r"loss = ([\d.e+-]+) \(\* 1 = ([\d.e+-]+) loss\)", loss)
    assert r and float(r.group(1)) == pytest.approx(loss_ref, rel=2e-5) and r.group(1) == r.group(2)


def test_test_command_on_mnist_matches_caffe(tmp_path, capsys):
    """256 MNIST test images through HDF5Data: each batch's accuracy and loss from the real
    Caffe's logits for the same images and weights (golden lenet_mnist.npz)."""
    import h5py

    z = np.load(need(GOLDEN / "models" / "lenet_mnist.npz"))
    with h5py.File(tmp_path / "mnist.h5", "w") as f:
        f["data"] = z["input"]
        f["label"] = z["labels"].astype(np.float32)
    (tmp_path / "list.txt").write_text(str(tmp_path / "mnist.h5") + "\n")
    net = pb.NetParameter(name="LeNetH5")
    net.layer.add(name="data", type="HDF5Data", top=["data", "label"],
                  hdf5_data_param=pb.HDF5DataParameter(source=str(tmp_path / "list.txt"), batch_size=64))
    net.layer.extend([l for l in read_net(ETHEREON / "lenet.prototxt").layer if l.type not in ("Input", "Softmax")])
    net.layer.add(name="accuracy", type="Accuracy", bottom=["ip2", "label"], top=["accuracy"])
    net.layer.add(name="loss", type="SoftmaxWithLoss", bottom=["ip2", "label"], top=["loss"])
    write_text(tmp_path / "lenet_h5.prototxt", net)
    assert main(["test", "--model", str(tmp_path / "lenet_h5.prototxt"), "--weights",
                 str(need(ETHEREON / "lenet_iter_10000.caffemodel")), "--iterations", "4"]) == 0
    msgs = log_messages(capsys.readouterr().err)
    logits = z["lenet_ethereon/ip2"].astype(np.float64).reshape(4, 64, 10)
    labels = z["labels"].reshape(4, 64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    acc = (logits.argmax(-1) == labels).mean(1)
    loss = -np.take_along_axis(logp, labels[..., None], -1)[..., 0].mean(1)
    got = {(int(m.split()[1][:-1]), m.split()[2]): float(m.split()[-1]) for m in msgs if m.startswith("Batch ")}
    for i in range(4):
        assert got[i, "accuracy"] == pytest.approx(acc[i], abs=1e-6)
        assert got[i, "loss"] == pytest.approx(loss[i], abs=1e-4)
    assert float([m for m in msgs if m.startswith("accuracy = ")][0].split()[-1]) == pytest.approx(acc.mean(), abs=1e-6)
    assert float([m for m in msgs if m.startswith("Loss: ")][0][6:]) == pytest.approx(loss.mean(), abs=1e-4)


def test_test_command_errors(tmp_path, capsys):
    model = _constant_lenet(tmp_path, 0.5, 1)
    assert main(["test", "--model", str(model), "--weights", str(tmp_path / "none.caffemodel")]) == 1
    assert "none.caffemodel" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["test", "--model", str(model)])
    assert "required: --weights" in capsys.readouterr().err


# -- devices ---------------------------------------------------------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["train", "--solver", "solver20.prototxt"],
                                     ["test", "--model", str(LENET_DEPLOY), "--weights", "w"],
                                     ["time", "--model", str(LENET_DEPLOY)]])
def test_gpu_flag_without_cuda_is_a_clear_error(command, tiny, capsys):
    assert main(command + ["--gpu", "0"]) == 1
    err = capsys.readouterr().err
    assert "--gpu 0: CUDA is not available" in err and "run without --gpu" in err


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_device_query_without_cuda(capsys):
    assert main(["device-query"]) == 1
    [msg] = log_messages(capsys.readouterr().err)
    assert msg.startswith("No CUDA device is available")


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_device_query_with_cuda(capsys):
    assert main(["device-query", "--gpu", "0"]) == 0
    msgs = log_messages(capsys.readouterr().err)
    assert f"Name:{' ' * 26}{torch.cuda.get_device_name(0)}" in msgs


# -- shapes ------------------------------------------------------------------------------------
def test_shapes_lenet(capsys):
    assert main(["shapes", "-phase", "TEST", str(LENET_DEPLOY)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"conv2\s+Convolution\s+conv2 \(64, 50, 8, 8\)\s+14 /2 @0\s+25,050", out)
    assert re.search(r"total\s+431,080", out)


# -- train -------------------------------------------------------------------------------------
@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snap").mkdir()
    (tmp_path / "tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "solver20.prototxt").write_text(TINY_SOLVER.replace("{max_iter}", "20"))
    # max_iter 0 and no periodic snapshot: the snapshot after training is iteration 0's
    (tmp_path / "solver0.prototxt").write_text(TINY_SOLVER.replace("{max_iter}", "0")
                                               .replace("snapshot: 10", "snapshot: 0"))
    return tmp_path


def test_train_end_to_end(tiny, capsys):
    assert main(["train", "-solver", "solver20.prototxt"]) == 0
    err = capsys.readouterr().err
    msgs = log_messages(err)
    assert msgs[0] == "Use CPU." and msgs[-1] == "Optimization Done."
    assert "Solving tiny" in msgs
    assert sorted(os.listdir("snap")) == ["tiny_iter_10.caffemodel", "tiny_iter_10.solverstate",
                                          "tiny_iter_20.caffemodel", "tiny_iter_20.solverstate"]
    # The log reads back as Caffe's parse_log.py would read it.
    (tiny / "train.log").write_text(err)
    train, test = parse_log(tiny / "train.log")
    assert [r["NumIters"] for r in train] == [0, 5, 10, 15]
    assert [r["NumIters"] for r in test] == [0, 10, 20]
    assert [r["LearningRate"] for r in train] == [0.1, 0.1, 0.1, 0.05]
    assert list(test[0]) == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    assert all(0 <= r["accuracy"] <= 1 for r in test)
    assert 0 <= train[0]["Seconds"] <= train[-1]["Seconds"] < 600
    assert main(["plot", "train.log", "-o", "curves.png"]) == 0 and (tiny / "curves.png").stat().st_size > 10_000

    # Resume from the iteration-10 snapshot: training continues at 10 and rewrites the last one.
    os.remove("snap/tiny_iter_20.caffemodel")
    assert main(["train", "--solver", "solver20.prototxt", "--snapshot", "snap/tiny_iter_10.solverstate"]) == 0
    msgs = log_messages(capsys.readouterr().err)
    assert "Resuming from snap/tiny_iter_10.solverstate" in msgs
    assert not any(m.startswith("Iteration 5 ") for m in msgs) and any(m.startswith("Iteration 15 ") for m in msgs)
    assert (tiny / "snap" / "tiny_iter_20.caffemodel").exists()


def test_train_weights_override_and_exclusions(tiny, capsys):
    # Finetuning with max_iter 0: the snapshot written after "training" holds the given weights.
    src = caffe.Net(str(tiny / "tiny.prototxt"), caffe.TRAIN)
    src.params["ip"][0].data[...] = np.arange(640, dtype=np.float32).reshape(10, 64) / 640
    src.save(str(tiny / "given.caffemodel"))
    with open("solver0.prototxt", "a") as f:
        f.write('weights: "missing.caffemodel"\n')            # overridden by --weights
    assert main(["train", "--solver", "solver0.prototxt", "--weights", "given.caffemodel"]) == 0
    assert "Finetuning from given.caffemodel" in log_messages(capsys.readouterr().err)
    out = caffe.Net(str(tiny / "tiny.prototxt"), caffe.TRAIN, weights=str(tiny / "snap" / "tiny_iter_0.caffemodel"))
    np.testing.assert_array_equal(out.params["ip"][0].data, src.params["ip"][0].data)
    # Without the override the solver's own (missing) weights are used, and named.
    assert main(["train", "--solver", "solver0.prototxt"]) == 1
    assert "missing.caffemodel" in capsys.readouterr().err
    assert main(["train", "--solver", "solver0.prototxt", "--weights", "a", "--snapshot", "b"]) == 1
    assert "not both" in capsys.readouterr().err
    assert main(["train", "--solver", "nope.prototxt"]) == 1
    assert "nope.prototxt" in capsys.readouterr().err


def test_train_sigint_stops_with_a_snapshot(tiny):
    """Caffe's default --sigint_effect stop: Ctrl-C ends the run cleanly, snapshot written."""
    (tiny / "long.prototxt").write_text(TINY_SOLVER.replace("{max_iter}", "100000")
                                        .replace("display: 5", "display: 1").replace("snapshot: 10", "snapshot: 0"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "brewnet.cli", "train", "-solver", "long.prototxt"],
                            cwd=tiny, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "Iteration 3 " in line:
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=60)
    lines.append(rest)
    assert proc.returncode == 0, "".join(lines)
    log = "".join(lines)
    assert "Optimization stopped early." in log
    [state] = [f for f in os.listdir(tiny / "snap") if f.endswith(".solverstate")]
    stopped = int(re.fullmatch(r"tiny_iter_(\d+)\.solverstate", state).group(1))
    assert 3 < stopped < 100000


FASHION_LMDB = GOLDEN / "lmdb" / "fashion_mnist_test_lmdb"


@pytest.mark.skipif("Data" not in LAYERS, reason="the LMDB Data layer has not landed yet")
def test_train_lenet_from_caffes_lmdb_then_test_agrees(tmp_path, capsys, monkeypatch):
    """Caffe's LeNet train_test net over the LMDB the real convert_mnist_data wrote: training
    lowers the loss, and `brewnet test` on the snapshot prints what the solver's test printed."""
    monkeypatch.chdir(tmp_path)
    text = (MODELS / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt").read_text()
    for old in ("examples/mnist/mnist_train_lmdb", "examples/mnist/mnist_test_lmdb"):
        text = text.replace(old, str(need(FASHION_LMDB)))
    text = text.replace("batch_size: 64", "batch_size: 16").replace("batch_size: 100", "batch_size: 16")
    (tmp_path / "net.prototxt").write_text(text)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" test_iter: 2 test_interval: 30 test_initialization: false base_lr: 0.01 '
        'momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75 display: 10 '
        'max_iter: 30 snapshot_prefix: "lenet" random_seed: 7 solver_mode: CPU')
    assert main(["train", "--solver", "solver.prototxt"]) == 0
    (tmp_path / "train.log").write_text(capsys.readouterr().err)
    train, test = parse_log(tmp_path / "train.log")
    assert [r["NumIters"] for r in train] == [0, 10, 20] and len(test) == 1
    assert train[-1]["loss"] < train[0]["loss"]
    assert main(["test", "--model", "net.prototxt", "--weights", "lenet_iter_30.caffemodel",
                 "--iterations", "2"]) == 0
    msgs = log_messages(capsys.readouterr().err)
    for name in ("accuracy", "loss"):
        [line] = [m for m in msgs if m.startswith(f"{name} = ")]
        assert float(line.split()[2]) == pytest.approx(test[0][name], rel=1e-5)
