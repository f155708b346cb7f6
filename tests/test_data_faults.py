"""Data faults a user meets on disk: a truncated LMDB is a clear error naming the file (it was
a SIGBUS: LMDB maps the file, and a page past its end kills the process), a float record
holding NaN/inf names its key and the database, and a label out of range names the record it
was read from (database and key, list file line, HDF5 file and row), through the prefetch
thread and the step graph's deferred checks, as one line from ``brewnet train``/``test``."""
from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest

from brewnet import Net
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum
from brewnet.layers import LayerError


def _lmdb(path, n=64, side=24, float_at=None, bad=math.nan, backend="lmdb"):
    rng = np.random.default_rng(0)
    with open_writer(str(path), backend) as w:
        for i in range(n):
            img = rng.integers(0, 256, (3, side, side), dtype=np.uint8)
            if float_at is not None:
                img = img.astype(np.float32)
                if i == float_at:
                    img[1, 2, 3] = bad
            w.put(f"{i:08d}", chw_to_datum(img, i % 10).SerializeToString())
    return str(path)


def _data_net(source, batch=8, backend="LMDB", prefetch=0):
    return f"""name: "d"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: {backend} prefetch: {prefetch} }} }}"""


def _in_child(fn) -> tuple[int, str]:
    """Run ``fn`` in a forked child (on the old code the read dies by signal, which must fail
    the test, not pytest): (exit status or -signal, the error message it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        os.close(r)
        code, text = 0, b""
        try:
            fn()
        except BaseException as e:                 # noqa: BLE001  (reported to the parent)
            code, text = 1, f"{type(e).__name__}: {e}".encode()
        os.write(w, text)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung")
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)), text


def test_truncated_lmdb_is_an_error_naming_the_file(tmp_path):
    db = _lmdb(tmp_path / "cut_lmdb")
    data = os.path.join(db, "data.mdb")
    os.truncate(data, os.path.getsize(data) // 2)

    def read():
        net = Net(_data_net(db))
        for _ in range(10):
            net.forward()

    code, text = _in_child(read)
    assert code == 1, f"killed by signal {-code}" if code < 0 else text
    assert text.startswith("LayerError: Layer 'data' (type Data)")
    assert "cut_lmdb/data.mdb: the LMDB is truncated" in text


def test_truncated_single_file_lmdb(tmp_path):
    from brewnet.data.db import DBError, open_db

    db = _lmdb(tmp_path / "whole")
    cut = tmp_path / "single.mdb"
    cut.write_bytes(open(os.path.join(db, "data.mdb"), "rb").read()[:40000])
    with pytest.raises(DBError, match=r"single\.mdb: the LMDB is truncated"):
        open_db(cut)


@pytest.mark.parametrize("bad, backend, prefetch", [(math.nan, "lmdb", 0), (math.inf, "lmdb", 0),
                                                    (math.nan, "lmdb", 2), (math.inf, "leveldb", 0)])
def test_non_finite_float_record_names_key_and_database(tmp_path, bad, backend, prefetch):
    if backend == "leveldb":
        pytest.importorskip("plyvel")
    db = _lmdb(tmp_path / "floats_lmdb", n=24, float_at=13, bad=bad, backend=backend)
    net = Net(_data_net(db, backend=backend.upper(), prefetch=prefetch))
    net.forward()
    with pytest.raises(LayerError) as e:
        net.forward()
    msg = str(e.value)
    assert "Layer 'data' (type Data)" in msg and "floats_lmdb" in msg
    assert "record '00000013'" in msg and "non-finite" in msg and "float_data[" in msg


# -- a label out of range names its record ------------------------------------------------------
CLASSES = 10
BAD = 29                      # the record holding label 12: batch 7 (of 4), item 1


def _labelled_lmdb(path, n=40, bad_at=BAD):
    """Byte records keyed as convert_imageset keys them (index_name); record ``bad_at`` has
    label 12, the others 0..9."""
    rng = np.random.default_rng(1)
    with open_writer(str(path)) as w:
        for i in range(n):
            img = rng.integers(0, 256, (1, 4, 4), dtype=np.uint8)
            w.put(f"{i:08d}_img{i}.png",
                  chw_to_datum(img, 12 if i == bad_at else i % CLASSES).SerializeToString())
    return str(path)


def _classifier(data_layer: str, reshape_label: bool = False) -> str:
    """``data_layer``, an InnerProduct to 10 classes, SoftmaxWithLoss and Accuracy on the label
    (two consumers: the net splits it), optionally through a Reshape first."""
    label = "label"
    extra = ""
    if reshape_label:
        label = "label_r"
        extra = ('layer { name: "lr" type: "Reshape" bottom: "label" top: "label_r" '
                 'reshape_param { shape { dim: -1 dim: 1 } } }')
    return f"""name: "c"
{data_layer}
{extra}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: {CLASSES} weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "{label}" top: "loss" }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "{label}" top: "acc" }}
"""


def _train(tmp_path, data_layer, capsys, iters=12, reshape_label=False) -> str:
    """``brewnet train`` on the classifier; its exit status must be 1: returns stderr."""
    from brewnet import cli

    net = tmp_path / "net.prototxt"
    net.write_text(_classifier(data_layer, reshape_label))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: {iters}\n'
                      'display: 1\nsnapshot_after_train: false\nsolver_mode: CPU\n')
    capsys.readouterr()
    assert cli.main(["train", "--solver", str(solver)]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("brewnet train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("mode", ["eager", "prefetch", "step_graph", "prefetch_step_graph"])
def test_train_names_the_record_of_a_label_out_of_range(tmp_path, capsys, caplog, monkeypatch, mode):
    import logging

    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1" if "step_graph" in mode else "0")
    db = _labelled_lmdb(tmp_path / "bad_lmdb")
    prefetch = 3 if "prefetch" in mode else 0
    layer = (f'layer {{ name: "data" type: "Data" top: "data" top: "label" '
             f'data_param {{ source: "{db}" batch_size: 4 backend: LMDB prefetch: {prefetch} }} }}')
    with caplog.at_level(logging.INFO, logger="brewnet"):
        line = _train(tmp_path, layer, capsys)
    assert line.startswith("brewnet train: Layer 'loss' (type SoftmaxWithLoss): label 12 at "
                           "position 1 is out of range")
    # the batch the loss checks, not one the prefetch thread read ahead
    assert line.endswith(f"read from record '{BAD:08d}_img{BAD}.png' of {db} (item 1 of the "
                         "batch of layer 'data')")
    replayed = any("replayed as one recorded graph" in r.getMessage() for r in caplog.records)
    assert replayed == ("step_graph" in mode)      # the check deferred to before a replay


def test_label_through_split_and_reshape_names_the_record(tmp_path):
    db = _labelled_lmdb(tmp_path / "bad_lmdb", bad_at=6)
    net = Net(_classifier(f'layer {{ name: "data" type: "Data" top: "data" top: "label" '
                          f'data_param {{ source: "{db}" batch_size: 4 backend: LMDB }} }}',
                          reshape_label=True), phase=0)
    net.forward()
    with pytest.raises(LayerError) as e:
        net.forward()
    assert "at position 2 is out of range" in str(e.value)
    assert f"record '00000006_img6.png' of {db} (item 2 of the batch of layer 'data')" in str(e.value)


def test_test_command_names_the_record(tmp_path, capsys):
    from brewnet import cli

    db = _labelled_lmdb(tmp_path / "bad_lmdb", bad_at=9)
    model = tmp_path / "net.prototxt"
    model.write_text(_classifier(f'layer {{ name: "data" type: "Data" top: "data" top: "label" '
                                 f'data_param {{ source: "{db}" batch_size: 4 backend: LMDB }} }}'))
    weights = tmp_path / "w.caffemodel"
    Net(str(model), phase=1).save(str(weights))
    capsys.readouterr()
    assert cli.main(["test", "--model", str(model), "--weights", str(weights), "--iterations", "4"]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("brewnet test:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("brewnet test: Layer 'loss'")
    assert lines[0].endswith(f"record '00000009_img9.png' of {db} (item 1 of the batch of layer 'data')")


def test_image_data_names_the_list_line(tmp_path, capsys):
    import cv2

    rng = np.random.default_rng(2)
    lines = []
    for i in range(8):
        cv2.imwrite(str(tmp_path / f"im{i}.png"), rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
        lines.append(f"im{i}.png {12 if i == 5 else i}")
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(lines) + "\n")
    layer = (f'layer {{ name: "data" type: "ImageData" top: "data" top: "label" image_data_param '
             f'{{ source: "{listing}" root_folder: "{tmp_path}/" batch_size: 4 }} }}')
    line = _train(tmp_path, layer, capsys)
    assert line.endswith(f"read from line 6 of {listing} (image {tmp_path}/im5.png) (item 1 of "
                         "the batch of layer 'data')")


def _h5(path, label, data=None):
    import h5py

    with h5py.File(path, "w") as f:
        f["data"] = np.ones((len(label), 3), np.float32) if data is None else data
        f["label"] = np.asarray(label, np.float32)
    return str(path)


def test_hdf5_data_names_the_file_and_row(tmp_path):
    good = _h5(tmp_path / "a.h5", [1, 2, 3])
    bad = _h5(tmp_path / "b.h5", [4, 5, 6, 12, 7])
    (tmp_path / "list.txt").write_text(f"{good}\n{bad}\n")
    net = Net(_classifier(f'layer {{ name: "data" type: "HDF5Data" top: "data" top: "label" '
                          f'hdf5_data_param {{ source: "{tmp_path / "list.txt"}" batch_size: 4 }} }}'),
              phase=0)
    net.forward()                   # rows a:0-2, b:0
    with pytest.raises(LayerError) as e:
        net.forward()               # rows b:1-4: row 3 of b.h5 is item 2
    assert str(e.value).endswith(f"read from row 3 of {bad} (item 2 of the batch of layer 'data')")


def test_hdf5_non_finite_row_names_file_dataset_and_row(tmp_path):
    data = np.ones((5, 3), np.float32)
    data[3, 1] = math.inf
    bad = _h5(tmp_path / "b.h5", [1, 2, 3, 4, 5], data)
    (tmp_path / "list.txt").write_text(f"{bad}\n")
    with pytest.raises(LayerError, match=rf"HDF5 file {bad}: row 3 of dataset 'data' holds a "
                                         r"non-finite value \(inf at element 1 of the row\)"):
        Net(f'layer {{ name: "data" type: "HDF5Data" top: "data" top: "label" hdf5_data_param '
            f'{{ source: "{tmp_path / "list.txt"}" batch_size: 2 }} }}')


def test_annotated_data_label_names_the_record(tmp_path):
    from brewnet.proto import caffe_pb2 as pb

    rng = np.random.default_rng(3)
    with open_writer(str(tmp_path / "anno_lmdb")) as w:
        for i in range(8):
            datum = chw_to_datum(rng.integers(0, 256, (3, 4, 4), dtype=np.uint8), 12 if i == 2 else 1)
            w.put(f"{i:08d}_a", pb.AnnotatedDatum(datum=datum).SerializeToString())
    net = Net(_classifier(f'layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" '
                          f'data_param {{ source: "{tmp_path / "anno_lmdb"}" batch_size: 4 }} }}'),
              phase=0)
    with pytest.raises(LayerError) as e:
        net.forward()
    assert str(e.value).endswith(f"read from record '00000002_a' of {tmp_path / 'anno_lmdb'} "
                                 "(item 2 of the batch of layer 'data')")
