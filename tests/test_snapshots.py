"""Snapshots: snapshot -> restore -> continue equals the uninterrupted run bit for bit (every
solver type, both formats); the real Caffe's solver states restore; bad states fail clearly;
writes are atomic."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.errors import ProtoError
from brewnet.proto.io import read_net, read_solver
from brewnet.solvers import SGDSolver, SolverError
from brewnet.solvers.snapshot import read_solverstate
from helpers import MODELS, need, swap_data_layers
from test_solvers import SOLVER_DIR, golden_solver

TYPES = ["sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam"]
FORMATS = {"binary": ("", ".solverstate"), "hdf5": ("snapshot_format: HDF5", ".solverstate.h5")}
TRAINED = MODELS / "trained"


def _state(solver):
    return ([t.detach().clone() for t in solver.net.learnable],
            [h.clone() for h in solver.history], solver.iter, solver.current_step)


def _assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    assert a[2:] == b[2:]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", TYPES)
def test_restore_continues_bitwise(tmp_path, kind, fmt):
    extra = f'{FORMATS[fmt][0]} snapshot_prefix: "{tmp_path / "run"}"'
    if kind == "sgd":       # current_step and the batch position must come back too
        extra += ' lr_policy: "multistep" gamma: 0.5 stepvalue: 2 stepvalue: 4 iter_size: 2'
    whole, _ = golden_solver(f"type_{kind}", extra)
    whole.step(6)
    first, _ = golden_solver(f"type_{kind}", extra)
    first.step(3)
    path = first.snapshot()
    assert path == f"{tmp_path / 'run'}_iter_3{FORMATS[fmt][1]}"
    resumed, _ = golden_solver(f"type_{kind}", extra)     # at the initial weights: restore must load
    resumed.restore(path)
    _assert_same(_state(resumed), _state(first))
    resumed.step(3)
    _assert_same(_state(resumed), _state(whole))


def test_solve_with_resume_file(tmp_path):
    extra = f'snapshot_prefix: "{tmp_path / "r"}" snapshot: 4 max_iter: 8'
    whole, _ = golden_solver("type_adam", extra)
    whole.solve()
    resumed, _ = golden_solver("type_adam", extra)
    resumed.solve(resume_file=str(tmp_path / "r_iter_4.solverstate"))
    _assert_same(_state(resumed), _state(whole))


def test_snapshot_files_match_caffe_layout(tmp_path):
    s, _ = golden_solver("type_adam", f'snapshot_prefix: "{tmp_path / "a"}" snapshot_diff: true')
    s.step(2)
    s.snapshot()
    msg = pb.SolverState.FromString((tmp_path / "a_iter_2.solverstate").read_bytes())
    assert (msg.iter, msg.current_step, msg.learned_net) == (2, 0, f"{tmp_path / 'a'}_iter_2.caffemodel")
    assert len(msg.history) == 16 and list(msg.history[4].shape.dim) == [32, 32]
    model = pb.NetParameter.FromString((tmp_path / "a_iter_2.caffemodel").read_bytes())
    ip1 = next(l for l in model.layer if l.name == "ip1")
    assert len(ip1.blobs[0].data) == len(ip1.blobs[0].diff) == 32 * 32      # snapshot_diff
    import h5py
    s.param.snapshot_format = pb.SolverParameter.HDF5
    s.snapshot()
    with h5py.File(tmp_path / "a_iter_2.solverstate.h5") as f:
        assert f["iter"][0] == 2 and f["current_step"][0] == 0 and len(f["history"]) == 16
        assert f["learned_net"][()].decode() == f"{tmp_path / 'a'}_iter_2.caffemodel.h5"
    with h5py.File(tmp_path / "a_iter_2.caffemodel.h5") as f:
        assert f["data/conv1/0"].shape == (6, 1, 5, 5) and "diff" in f


def test_snapshot_is_atomic(tmp_path, monkeypatch):
    for fmt in ("", "snapshot_format: HDF5"):
        s, _ = golden_solver("type_sgd", f'snapshot_prefix: "{tmp_path / "x"}" {fmt}')
        s.step(1)
        real = os.replace

        def crash(src, dst):
            if str(dst).endswith((".solverstate", ".solverstate.h5")):
                raise OSError("disk full")
            real(src, dst)

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(OSError, match="disk full"):
            s.snapshot()
        monkeypatch.setattr(os, "replace", real)
        assert not any(p.name.endswith((".solverstate", ".solverstate.h5")) for p in tmp_path.iterdir())
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


# -- the real Caffe's states ----------------------------------------------------------------
def test_restore_golden_caffe_solverstate(tmp_path, monkeypatch):
    # Caffe wrote learned_net "run_iter_10.caffemodel", relative to its working directory.
    shutil.copy(SOLVER_DIR / "type_sgd_iter_10.caffemodel", tmp_path / "run_iter_10.caffemodel")
    shutil.copy(SOLVER_DIR / "type_sgd_iter_10.solverstate", tmp_path / "s.solverstate")
    monkeypatch.chdir(tmp_path)
    s, z = golden_solver("type_sgd")
    s.restore("s.solverstate")
    assert (s.iter, s.current_step) == (10, 0)
    for j, h in enumerate(s.history):
        np.testing.assert_array_equal(h.numpy(), z[f"history/{j}"])
    for layer in s.net.layer_list:
        for i, t in enumerate(layer.blobs):
            np.testing.assert_array_equal(t.detach().numpy(), z[f"final/{layer.name}/{i}"])
    # continuing equals our own 11-step run to float32 rounding of Caffe vs us
    s.step(1)
    ours, _ = golden_solver("type_sgd")
    ours.step(11)
    for a, b in zip(s.net.learnable, ours.net.learnable):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-4, atol=1e-5)


def _solver_with_inputs(solver_file, shapes, **kw):
    param = read_solver(solver_file)
    net_path = next(p / param.net for p in solver_file.parents if (p / param.net).exists())
    param.ClearField("net")
    param.net_param.CopyFrom(swap_data_layers(read_net(net_path), shapes))
    param.solver_mode = pb.SolverParameter.CPU
    param.snapshot = 0
    del param.test_iter[:]      # no test nets: a restored iter 5000 would test 100 batches first
    param.test_interval = 0
    return SGDSolver(param, **kw)


def _mnist(n):
    from brewnet.data.idx import read_idx
    d = need(TRAINED / "mnist_t10k") / "data" / "mnist"
    x = read_idx(d / "t10k-images-idx3-ubyte.gz")[:n].astype(np.float32)[:, None] * np.float32(1 / 256)
    return x, read_idx(d / "t10k-labels-idx1-ubyte.gz")[:n].astype(np.float32)


def test_restore_2014_lenet_solverstate(monkeypatch):
    root = TRAINED / "everpeace_caffe_2014_v1format"
    x, y = _mnist(64)
    s = _solver_with_inputs(root / "examples/mnist/lenet_solver.prototxt",
                            [[(64, 1, 28, 28), (64,)], [(100, 1, 28, 28), (100,)]],
                            train_feed=lambda i: {"data": x, "label": y})
    monkeypatch.chdir(root)       # learned_net is "examples/mnist/lenet_iter_10000.caffemodel"
    s.restore("examples/mnist/lenet_iter_10000.solverstate")
    assert s.iter == 10000 and len(s.history) == 8
    st = read_solverstate(root / "examples/mnist/lenet_iter_10000.solverstate")
    np.testing.assert_array_equal(s.history[4].numpy(), st.history[4].reshape(500, 800))
    assert s.lr == pytest.approx(0.01 * 2 ** -0.75, rel=1e-6)       # inv at iter 10000
    s.step(1)
    assert s.loss < 0.1            # the trained LeNet on real digits
    assert s.iter == 10001


@pytest.mark.parametrize("root, state, model", [
    ("everpeace_caffe_2014_v1format", "cifar10_quick_iter_5000.solverstate", "cifar10_quick_iter_5000.caffemodel"),
    ("cifar10_hdf5_siegfriedgreg", "cifar10_quick_iter_5000.solverstate.h5", None),
    ("cifar10_hdf5_siegfriedgreg", "cifar10_full_iter_100000.solverstate.h5", None),
])
def test_restore_2014_cifar_solverstates(tmp_path, monkeypatch, root, state, model):
    src = TRAINED / root / "examples" / "cifar10"
    st = read_solverstate(need(src / state))
    if model:      # the state names cifar10_quick_lr1_iter_5000.caffemodel; only this copy exists
        dst = tmp_path / st.learned_net
        dst.parent.mkdir(parents=True)
        shutil.copy(src / model, dst)
        monkeypatch.chdir(tmp_path)
    else:
        monkeypatch.chdir(TRAINED / root)
    solver_file = src / ("cifar10_full_solver.prototxt" if "full" in state else "cifar10_quick_solver.prototxt")
    rng = np.random.default_rng(0)
    batch = {"data": rng.normal(0, 30, (100, 3, 32, 32)).astype(np.float32),
             "label": rng.integers(0, 10, 100).astype(np.float32)}
    s = _solver_with_inputs(solver_file, [[(100, 3, 32, 32), (100,)]] * 2, train_feed=lambda i: batch)
    s.restore(src / state)
    assert s.iter == st.iter and len(s.history) == len(st.history)
    for h, ref in zip(s.history, st.history):
        np.testing.assert_array_equal(h.numpy().reshape(-1), ref.reshape(-1))
    from brewnet import Net
    ref_net = Net(s.net.param, pb.TRAIN, weights=st.learned_net)
    for a, b in zip(s.net.learnable, ref_net.learnable):
        assert torch.equal(a.detach(), b.detach())
    s.step(1)
    assert np.isfinite(s.loss)


# -- bad states -----------------------------------------------------------------------------
def test_corrupt_and_mismatched_states(tmp_path):
    s, _ = golden_solver("type_sgd", f'snapshot_prefix: "{tmp_path / "g"}"')
    good = s.snapshot()
    data = open(good, "rb").read()
    (tmp_path / "cut.solverstate").write_bytes(data[: len(data) // 2])
    with pytest.raises(ProtoError, match=r"cut.solverstate: truncated or corrupt binary SolverState"):
        s.restore(tmp_path / "cut.solverstate")
    (tmp_path / "junk.solverstate.h5").write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(ProtoError, match="junk.solverstate.h5: truncated or corrupt HDF5"):
        s.restore(tmp_path / "junk.solverstate.h5")
    with pytest.raises(FileNotFoundError, match="solver state file not found"):
        s.restore(tmp_path / "nope.solverstate")
    # an SGD state (8 history blobs) into an Adam solver (16)
    adam, _ = golden_solver("type_adam")
    with pytest.raises(SolverError, match="8 history blobs, but this Adam solver needs 16"):
        adam.restore(good)
    # a state from another net: same count, other shapes
    st = pb.SolverState.FromString(data)
    st.history[4].shape.dim[:] = [16, 64]
    st.history[4].ClearField("data")
    st.history[4].data.extend([0.0] * 1024)
    st.history[6].shape.dim[:] = [10, 31]
    del st.history[6].data[310:]
    (tmp_path / "other.solverstate").write_bytes(st.SerializeToString())
    with pytest.raises(SolverError, match=r"history blob 6 has shape \(10, 31\).*\(10, 32\)"):
        s.restore(tmp_path / "other.solverstate")
    # a missing learned_net is named
    st = pb.SolverState.FromString(data)
    st.learned_net = "gone/model_iter_3.caffemodel"
    (tmp_path / "lost.solverstate").write_bytes(st.SerializeToString())
    with pytest.raises(FileNotFoundError, match="learned_net 'gone/model_iter_3.caffemodel' was not found"):
        s.restore(tmp_path / "lost.solverstate")
    # nothing was changed by the failed restores
    assert s.iter == 0 and all(h.abs().sum() == 0 for h in s.history)
