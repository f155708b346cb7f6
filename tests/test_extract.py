"""brewnet extract (Caffe's extract_features): the written features equal the net's blobs for the
same images in every format, the .lmdb reads back through the Data layer, and bad input says so."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet.cli import main
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum

N_IMAGES, BATCH, ITERS = 12, 4, 3


@pytest.fixture
def model(tmp_path):
    rng = np.random.default_rng(5)
    with open_writer(str(tmp_path / "images")) as w:
        for i in range(N_IMAGES):
            d = chw_to_datum(rng.integers(0, 256, (1, 8, 8), dtype=np.uint8), int(i % 10))
            w.put(f"{i:08d}", d.SerializeToString())
    net_file = tmp_path / "net.prototxt"
    net_file.write_text(f"""name: "feat"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{tmp_path / 'images'}" batch_size: {BATCH} backend: LMDB }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 3 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "xavier" }} }} }}""")
    caffe.set_random_seed(3)
    weights = tmp_path / "w.caffemodel"
    caffe.Net(str(net_file), caffe.TEST).save(str(weights))
    return net_file, weights


def reference(net_file, weights):
    net = caffe.Net(str(net_file), caffe.TEST, weights=str(weights))
    out = {"conv": [], "ip": [], "label": []}
    for _ in range(ITERS):
        net.forward()
        for b in out:
            out[b].append(net.blobs[b].data.copy())
    return {b: np.concatenate(v) for b, v in out.items()}


def extract(model, out, blobs="conv,ip"):
    net_file, weights = model
    return main(["extract", "--model", str(net_file), "--weights", str(weights), "--blobs", blobs,
                 "--iterations", str(ITERS), "--out", str(out)])


def test_npy_h5_txt_equal_the_blobs(model, tmp_path):
    ref = reference(*model)
    assert extract(model, tmp_path / "f.npy") == 0
    for b in ("conv", "ip"):
        np.testing.assert_array_equal(np.load(tmp_path / f"f_{b}.npy"), ref[b])
    np.testing.assert_array_equal(np.load(tmp_path / "f_labels.npy"), ref["label"])
    assert extract(model, tmp_path / "f.h5") == 0
    with h5py.File(tmp_path / "f.h5") as f:
        np.testing.assert_array_equal(f["ip"][...], ref["ip"])
        np.testing.assert_array_equal(f["label"][...], ref["label"])
        assert f["conv"].shape == (ITERS * BATCH, 3, 6, 6)
    assert extract(model, tmp_path / "f.txt") == 0
    txt = np.loadtxt(tmp_path / "f_ip.txt")
    assert txt.shape == (ITERS * BATCH, 5)
    np.testing.assert_allclose(txt, ref["ip"], rtol=1e-7)       # %.9g round-trips float32


def test_lmdb_in_caffes_format_reads_back_through_the_data_layer(model, tmp_path):
    ref = reference(*model)
    assert extract(model, tmp_path / "f.lmdb", blobs="ip,conv") == 0
    back = caffe.Net(f"""layer {{ name: "d" type: "Data" top: "x" top: "y"
      data_param {{ source: "{tmp_path / 'f_ip.lmdb'}" batch_size: {ITERS * BATCH} backend: LMDB }} }}""",
                     caffe.TEST)
    out = back.forward()
    assert out["x"].shape == (ITERS * BATCH, 5, 1, 1)          # Caffe's C x H x W of a (N, 5) blob
    np.testing.assert_array_equal(out["x"].reshape(-1, 5), ref["ip"])
    np.testing.assert_array_equal(out["y"], ref["label"])
    import lmdb

    with lmdb.open(str(tmp_path / "f_conv.lmdb"), readonly=True, lock=False) as env:
        keys = [k for k, _ in env.begin().cursor()]
    assert keys[:2] == [b"0000000000", b"0000000001"] and len(keys) == ITERS * BATCH


def test_bad_input(model, tmp_path, capsys):
    assert extract(model, tmp_path / "f.npy", blobs="fc7") == 1
    err = capsys.readouterr().err
    assert "no blob 'fc7' in net 'feat'" in err and "conv, ip" in err
    assert extract(model, tmp_path / "missing" / "f.npy") == 1
    assert "cannot write there" in capsys.readouterr().err
    assert extract(model, tmp_path / "f.csv") == 1
    assert "must end in .npy, .h5, .lmdb, .txt" in capsys.readouterr().err


def test_python_generator_is_flat_per_batch(model):
    from brewnet.analysis.features import batches

    net = caffe.Net(str(model[0]), caffe.TEST, weights=str(model[1]))
    got = list(batches(net, ["ip"], ITERS))
    assert len(got) == ITERS and all(f["ip"].shape == (BATCH, 5) and l.shape == (BATCH,) for f, l in got)


@pytest.mark.parametrize("engine", ["onnxruntime", "opencv", "auto"])
def test_an_engine_runs_the_layers_after_the_data_layers(model, tmp_path, engine):
    """--engine E: the layers after the Data layer as a deploy net on E (channels-last input, as
    a deploy net runs: within float rounding of the net's blobs, engines.RTOL of their scale),
    past the call where the engine switches on; the labels as they were."""
    pytest.importorskip("onnxruntime")
    from brewnet.execution import engines, lean

    net_file, weights = model
    iters = lean.AFTER + 3                    # the Data layer wraps around its 12 records
    net = caffe.Net(str(net_file), caffe.TEST, weights=str(weights))
    ref = {"ip": [], "label": []}
    for _ in range(iters):
        net.forward()
        for b in ref:
            ref[b].append(net.blobs[b].data.copy())
    assert main(["extract", "--model", str(net_file), "--weights", str(weights), "--blobs", "ip",
                 "--iterations", str(iters), "--out", str(tmp_path / "f.npy"), "--engine", engine]) == 0
    got, want = np.load(tmp_path / "f_ip.npy"), np.concatenate(ref["ip"])
    assert np.abs(got - want).max() <= engines.RTOL[torch.float32] * np.abs(want).max()
    np.testing.assert_array_equal(np.load(tmp_path / "f_labels.npy"), np.concatenate(ref["label"]))


def test_a_bad_engine_is_one_line(model, tmp_path, capsys):
    net_file, weights = model
    assert main(["extract", "--model", str(net_file), "--weights", str(weights), "--blobs", "ip",
                 "--out", str(tmp_path / "f.npy"), "--engine", "fastest"]) != 0
    err = capsys.readouterr().err
    assert "--engine='fastest': expected one of auto, eager, compiled, onnxruntime, openvino, opencv" in err
    assert "Traceback" not in err and not (tmp_path / "f_ip.npy").exists()
