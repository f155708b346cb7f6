"""Issue 8: no silent corruption, no crash at exit, every bad input a clear error.

Every input here is made in tmp_path (tiny LMDBs, caffemodels, HDF5 files), so the tests run
without ../shared.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet import Net
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def write_lmdb(path, datums, keys=None):
    with open_writer(str(path)) as w:
        for i, d in enumerate(datums):
            w.put(keys[i] if keys else f"{i:08d}", d.SerializeToString())
    return path


def data_net(tmp_path, source, batch=2, extra="", prefetch=None):
    pf = f" prefetch: {prefetch}" if prefetch is not None else ""
    text = f"""name: "t"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB{pf} }} }}
{extra}"""
    p = tmp_path / "net.prototxt"
    p.write_text(text)
    return p


# ---------------------------------------------------------------- 1. silent data corruption

def test_float_datum_after_byte_datum_keeps_its_floats(tmp_path):
    first = chw_to_datum(np.full((1, 2, 2), 7, np.uint8), 0)
    second = chw_to_datum(np.full((1, 2, 2), 1000.0, np.float32), 1)
    assert second.float_data and not second.data
    db = write_lmdb(tmp_path / "db", [first, second])
    net = Net(str(data_net(tmp_path, db)), brewnet.TEST)
    out = net.forward()
    assert out["data"][0].ravel().tolist() == [7.0] * 4
    assert out["data"][1].ravel().tolist() == [1000.0] * 4    # not 232 (1000 mod 256)


# ---------------------------------------------------------------------- 2. crash at exit

EXIT_SCRIPT = """
import sys
import brewnet as caffe
net = caffe.Net(sys.argv[1], caffe.TEST)
net.forward()
"""


def test_script_with_data_layer_exits_cleanly_30_times(tmp_path):
    db = write_lmdb(tmp_path / "db", [chw_to_datum(np.full((1, 8, 8), i, np.uint8), i % 2)
                                      for i in range(8)])
    proto = data_net(tmp_path, db, batch=4, extra="""layer { name: "ip" type: "InnerProduct"
  bottom: "data" top: "ip" inner_product_param { num_output: 2 } }""")
    script = tmp_path / "run.py"
    script.write_text(EXIT_SCRIPT)
    codes = []
    for _ in range(10):    # three at a time: 30 fresh interpreters
        procs = [subprocess.Popen([sys.executable, str(script), str(proto)], env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for _ in range(3)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            codes.append((p.returncode, err.decode()[-300:]))
    assert [c for c, _ in codes] == [0] * 30, [c for c in codes if c[0]]


def test_dropping_a_net_joins_its_prefetch_thread(tmp_path):
    import gc
    import threading

    db = write_lmdb(tmp_path / "db", [chw_to_datum(np.zeros((1, 2, 2), np.uint8), 0)] * 4)
    net = Net(str(data_net(tmp_path, db, prefetch=2)), brewnet.TEST)
    net.forward()
    t = net.layer_list[0].prefetcher._thread
    assert t is not None and t.is_alive()
    del net
    gc.collect()
    assert not t.is_alive()
    assert t not in threading.enumerate()


# ------------------------------------------------------- 3. Ctrl-C while the solver is built

GATE = '''
import sys
import brewnet as caffe


class Gate(caffe.Layer):
    """Blocks its setup until the test has sent its signals and writes a line to stdin."""

    def setup(self, bottom, top):
        print("BUILDING", flush=True)
        sys.stdin.readline()

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff
'''

GATED_NET = """name: "gated"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 2 }
                     data_filler { type: "gaussian" } } }
layer { name: "gate" type: "Python" bottom: "data" top: "gated"
  python_param { module: "gate_layer" layer: "Gate" } }
layer { name: "ip" type: "InnerProduct" bottom: "gated" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_sigint_while_solver_is_built_stops_cleanly(tmp_path, signals):
    import signal

    (tmp_path / "gate_layer.py").write_text(GATE)
    (tmp_path / "net.prototxt").write_text(GATED_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 100000\n'
        'display: 0\nsnapshot_prefix: "snap"\nsolver_mode: CPU\n')
    env = _env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    p = subprocess.Popen([sys.executable, "-m", "brewnet.cli", "train", "--solver", "solver.prototxt"],
                         cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "BUILDING"
        for _ in range(signals):
            p.send_signal(signal.SIGINT)
        p.stdin.write("\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.count("Signal received: stop requested") == 1
    assert "Optimization stopped early." in err
    # Caffe's order: the first iteration runs, the request stops it, the final snapshot is made.
    assert (tmp_path / "snap_iter_1.caffemodel").is_file()
    assert (tmp_path / "snap_iter_1.solverstate").is_file()
    assert not list(tmp_path.glob("*.tmp"))


# --------------------------------------------------- 4. raw internal errors that name no layer

def _input_net(shape, body):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f"""name: "x"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}
{body}"""


@pytest.mark.parametrize("bad", [50, -1])
def test_softmax_loss_label_out_of_range_names_layer_and_value(bad):
    from brewnet.layers import LayerError

    net = Net(_input_net((2, 10), """
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "data" bottom: "label" top: "loss" }"""))
    net.blobs["label"].data[...] = [3, bad]
    with pytest.raises(LayerError, match=rf"Layer 'loss' \(type SoftmaxWithLoss\): label {bad} "
                                         r"at position 1 is out of range.*\[0, 10\)"):
        net.forward()


def test_ignored_label_outside_the_range_is_fine():
    net = Net(_input_net((2, 10), """
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "data" bottom: "label" top: "loss"
  loss_param { ignore_label: -1 } }"""))
    net.blobs["label"].data[...] = [3, -1]
    assert np.isfinite(net.forward()["loss"])


def test_huge_pad_is_a_net_error_naming_layer_and_shape():
    from brewnet.net import NetError

    with pytest.raises(NetError, match=r"Layer 'conv' \(type Convolution\): top 'c' of shape "
                                       r"\(1, 2, 4294967300, 4294967300\) exceeds .*INT_MAX"):
        Net(_input_net((1, 3, 8, 8), """layer { name: "conv" type: "Convolution" bottom: "data"
  top: "c" convolution_param { num_output: 2 kernel_size: 3 pad: 2147483647 } }"""))


@pytest.mark.parametrize("pool, expect", [
    ("MAX", [[9.0, -3.4028234663852886e38], [-3.4028234663852886e38, -3.4028234663852886e38]]),
    ("AVE", [[4.5, 0.0], [0.0, 0.0]]),
])
def test_pooling_stride_far_past_the_image_runs_as_caffe(pool, expect):
    # Caffe: pooled = ceil((8 - 2) / 100000) + 1 = 2 per axis; windows past the image are
    # empty: MAX keeps its -FLT_MAX start (mask -1), AVE sums nothing.
    net = Net(_input_net((1, 1, 8, 8), f"""layer {{ name: "pool" type: "Pooling" bottom: "data"
  top: "p" pooling_param {{ pool: {pool} kernel_size: 2 stride: 100000 }} }}"""))
    net.blobs["data"].data[...] = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)
    out = net.forward()["p"]
    assert out.shape == (1, 1, 2, 2)
    np.testing.assert_array_equal(np.abs(out[0, 0]), np.abs(np.float32(expect)))


def test_batch_of_zero_is_refused_at_build_naming_layer():
    from brewnet.net import NetError

    with pytest.raises(NetError, match=r"Layer 'data' \(type Input\): top 'data' has shape "
                                       r"\(0, 3, 8, 8\)"):
        Net(_input_net((0, 3, 8, 8), """layer { name: "norm" type: "LRN" bottom: "data" top: "n" }"""))


# ------------------------------------------------------------ 5. HDF5 weights and snapshots

TWO_IP = """name: "two"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "a"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "ip2" type: "InnerProduct" bottom: "a" top: "b"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" } } }
"""


def _params(net):
    return [b.detach().clone() for l in net.layer_list for b in l.blobs]


def _h5_case(path, case):
    import h5py

    from brewnet.weights import save_weights_h5

    save_weights_h5(Net(TWO_IP), str(path))
    if case == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        return
    if case == "damaged":
        data = bytearray(path.read_bytes())
        data[200:1400] = b"\xff" * 1200          # the root group's header and B-tree
        path.write_bytes(bytes(data))
        return
    with h5py.File(path, "r+") as f:
        if case == "no /data":
            del f["data"]
            f.create_group("weights")
        elif case == "gap":
            f["data/ip1"].move("1", "2")
        elif case == "string":
            del f["data/ip1/0"]
            f["data/ip1/0"] = "not a number"


@pytest.mark.parametrize("case, message", [
    ("no /data", "no /data group"),
    ("gap", r"layer 'ip1': datasets must be named 0..1, got \['0', '2'\]"),
    ("string", r"layer 'ip1': /data/ip1/0 is not a numeric dataset"),
    ("truncated", "truncated or corrupt HDF5 weights file"),
    ("damaged", "truncated or corrupt HDF5 weights file"),
])
def test_bad_hdf5_weights_are_a_proto_error_naming_the_file(tmp_path, case, message):
    from brewnet.proto.errors import ProtoError

    path = tmp_path / "w.caffemodel.h5"
    _h5_case(path, case)
    net = Net(TWO_IP)
    before = _params(net)
    with pytest.raises(ProtoError, match=message) as e:
        net.copy_from(str(path))
    assert str(path) in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(net)))   # nothing half-loaded


KILLED_WRITER = """
import sys
import h5py
import brewnet
from brewnet.weights import save_weights_h5

real = h5py.Group.create_dataset


def stall(self, *a, **kw):
    print("WRITING", flush=True)
    sys.stdin.readline()          # the test kills us here, mid-snapshot
    return real(self, *a, **kw)


h5py.Group.create_dataset = stall
save_weights_h5(brewnet.Net(sys.argv[1]), sys.argv[2])
"""


def _solver(tmp_path, fmt="HDF5"):
    from brewnet.solvers import get_solver, load_solver_param

    gate = ('layer { name: "gate" type: "Python" bottom: "data" top: "gated"\n'
            '  python_param { module: "gate_layer" layer: "Gate" } }\n')
    (tmp_path / "net.prototxt").write_text(
        GATED_NET.replace(gate, "").replace('bottom: "gated"', 'bottom: "data"'))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 10\n'
        f'snapshot_prefix: "{tmp_path / "snap"}"\nsolver_mode: CPU\nsnapshot_format: {fmt}\n')
    param, _ = load_solver_param(str(tmp_path / "solver.prototxt"))
    return get_solver(param)


def test_kill_9_during_hdf5_snapshot_leaves_no_final_file_and_next_snapshot_cleans_up(tmp_path):
    import signal

    proto = tmp_path / "two.prototxt"
    proto.write_text(TWO_IP)
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    target = tmp_path / "snap_iter_5.caffemodel.h5"
    p = subprocess.Popen([sys.executable, str(script), str(proto), str(target)], env=_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "WRITING"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert not target.exists()
    left = list(tmp_path.glob(".snap_iter_5.caffemodel.h5.*.tmp"))
    assert len(left) == 1 and f".{p.pid}." in left[0].name      # unique, with the writer's pid
    legacy = tmp_path / "snap_iter_3.caffemodel.h5.tmp"         # older brewnet's fixed name
    legacy.write_bytes(b"partial")
    # A live writer's temporary file is left alone.
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        busy = tmp_path / f".snap_iter_7.caffemodel.h5.{live.pid}.abcdefgh.tmp"
        busy.write_bytes(b"in progress")
        solver = _solver(tmp_path)
        solver.snapshot()
        assert busy.exists()
    finally:
        live.kill()
        live.wait()
    assert not left[0].exists() and not legacy.exists()
    assert (tmp_path / "snap_iter_0.caffemodel.h5").is_file()
    assert (tmp_path / "snap_iter_0.solverstate.h5").is_file()


def test_hdf5_snapshot_fsyncs_file_and_directory(tmp_path, monkeypatch):
    import stat

    synced = []
    real = os.fsync

    def spy(fd):
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        return real(fd)

    solver = _solver(tmp_path)
    monkeypatch.setattr(os, "fsync", spy)
    solver.snapshot()
    # weights and solver state: each file, then the directory holding the rename
    assert synced == ["file", "dir", "file", "dir"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


# ------------------------------------------------------------------- 6. LMDB corruption

def test_damaged_lmdb_page_is_a_layer_error_naming_the_database(tmp_path):
    import struct

    from brewnet.layers import LayerError

    db = write_lmdb(tmp_path / "db", [chw_to_datum(np.full((1, 16, 16), i, np.uint8), 0)
                                      for i in range(40)])
    f = db / "data.mdb"
    data = bytearray(f.read_bytes())
    for page in range(2, len(data) // 4096):    # clear the type of every leaf page
        if struct.unpack_from("<H", data, page * 4096 + 10)[0] == 0x2:
            struct.pack_into("<H", data, page * 4096 + 10, 0)
    f.write_bytes(bytes(data))
    with pytest.raises(LayerError, match=r"Layer 'data' \(type Data\): .*the LMDB is damaged.*"
                                         r"CorruptedError") as e:
        Net(str(data_net(tmp_path, db)), brewnet.TEST)
    assert str(db) in str(e.value)


def test_wrong_shape_datum_names_the_record_and_the_layer_once(tmp_path):
    from brewnet.layers import LayerError

    datums = [chw_to_datum(np.zeros((1, 2, 2), np.uint8), 0),
              chw_to_datum(np.zeros((1, 3, 3), np.uint8), 0)]
    db = write_lmdb(tmp_path / "db", datums, keys=["first", "odd_one"])
    net = Net(str(data_net(tmp_path, db, prefetch=0)), brewnet.TEST)
    with pytest.raises(LayerError) as e:
        net.forward()
    msg = str(e.value)
    assert msg.count("Layer 'data'") == 1
    assert "record 'odd_one' (item 1 of the batch) has shape (1, 3, 3)" in msg


# --------------------------------------------------------------------- 7. partial loads

def test_partial_caffemodel_warns_listing_layers_left_at_fillers(tmp_path, caplog):
    src = Net(TWO_IP)
    src.save(str(tmp_path / "one.caffemodel"))
    other = TWO_IP.replace('name: "ip2"', 'name: "ip2_new"')
    net = Net(other)
    before = _params(net)
    with caplog.at_level("WARNING", logger="brewnet"):
        net.copy_from(str(tmp_path / "one.caffemodel"))
    assert "1 of 2 layers with parameters are not in the file and keep their filler values: " \
           "ip2_new" in caplog.text
    np.testing.assert_array_equal(net.params["ip1"][0].data, src.params["ip1"][0].data)
    assert torch.equal(_params(net)[2], before[2])          # ip2_new kept its filler


def test_caffemodel_of_another_net_is_refused_by_net_and_test(tmp_path, caplog):
    from brewnet.net import NetError

    src = Net(TWO_IP)
    src.save(str(tmp_path / "two.caffemodel"))
    other = TWO_IP.replace('"ip1"', '"fc1"').replace('"ip2"', '"fc2"')
    (tmp_path / "other.prototxt").write_text(other.replace(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }',
        'layer { name: "data" type: "DummyData" top: "data" dummy_data_param { shape { dim: 2 dim: 3 } } }'))
    with pytest.raises(NetError, match=r"two.caffemodel: no layer with parameters of net 'two' is "
                                       r"in this weights file .*fc1, fc2"):
        Net(other, weights=str(tmp_path / "two.caffemodel"))
    # pycaffe's copy_from keeps Caffe's behaviour (copies what matches: nothing), with a warning
    net = Net(other)
    with caplog.at_level("WARNING", logger="brewnet"):
        net.copy_from(str(tmp_path / "two.caffemodel"))
    assert "2 of 2 layers with parameters are not in the file" in caplog.text
    r = subprocess.run([sys.executable, "-m", "brewnet.cli", "test", "--model",
                        str(tmp_path / "other.prototxt"), "--weights",
                        str(tmp_path / "two.caffemodel"), "--iterations", "1"],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "no layer with parameters of net 'two' is in this weights file" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ 8. small

def test_input_dim_count_error_names_the_file(tmp_path):
    from brewnet.proto.errors import ProtoError

    p = tmp_path / "deploy.prototxt"
    p.write_text('name: "x"\ninput: "data"\ninput_dim: 1\ninput_dim: 3\n'
                 'layer { name: "r" type: "ReLU" bottom: "data" top: "data" }\n')
    with pytest.raises(ProtoError, match=rf"{p}: 1 inputs need 4 input_dim values, got 2"):
        Net(str(p))


def test_parse_log_on_a_binary_file_says_so_and_fails(tmp_path):
    log = tmp_path / "model.caffemodel"
    Net(TWO_IP).save(str(log))
    r = subprocess.run([sys.executable, "-m", "brewnet.cli", "parse-log", str(log)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "is not a text log (binary data)" in r.stderr
    assert not (tmp_path / "model.caffemodel.train").exists()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_lmdb_error_mid_epoch_is_a_layer_error_naming_database_and_key(tmp_path, prefetch,
                                                                       monkeypatch):
    # LMDB reports most damage as lmdb.Error subclasses while the cursor moves (some trip its
    # assert() instead, which no library can catch); a stub cursor raises one deterministically.
    # (A small LMDB is read into memory at setup, where such damage would show: stream this one.)
    import lmdb

    from brewnet.data import db as db_module
    from brewnet.layers import LayerError

    monkeypatch.setattr(db_module, "MEMORY_BYTES", 0)

    class Damaged:
        def item(self):
            raise lmdb.CorruptedError("mdb_cursor_get: MDB_CORRUPTED: Located page was wrong type")

        next = first = item

    db = write_lmdb(tmp_path / "db", [chw_to_datum(np.zeros((1, 2, 2), np.uint8), 0)] * 4)
    net = Net(str(data_net(tmp_path, db, prefetch=prefetch)), brewnet.TEST)
    layer = net.layer_list[0]
    assert layer.prefetcher is None or layer.prefetcher._thread is None   # not started yet
    layer.loader.cursor._it.cur = Damaged()   # with prefetch: raised in the thread, re-raised here
    with pytest.raises(LayerError, match=rf"Layer 'data' \(type Data\): {db}: the LMDB is damaged "
                                         r"\(after record '00000000'\): CorruptedError"):
        net.forward()
