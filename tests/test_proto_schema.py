"""A fork's own caffe.proto at run time (brewnet/proto/schema.py): ``proto=``, ``--proto``,
``BREWNET_PROTO`` and ``use_proto`` read text and binary files in the fork's schema, map them onto
brewnet's by name, keep the fields brewnet lacks through round trips, and resolve a field-number
clash by the given schema. Also the one-line errors for an unknown field and an unknown type,
``brewnet doctor`` and ``brewnet shapes --allow-unknown``, and a last in-place layer's output."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import brewnet as caffe
from brewnet.cli import main
from brewnet.layers.base import LayerError
from brewnet.proto import ProtoError, schema

pytest.importorskip("grpc_tools", reason='a fork\'s schema needs protoc: pip install "brewnet[forks]"')

F32 = np.float32
OURS = Path(caffe.__file__).parent / "proto" / "caffe.proto"

# The fork: brewnet's schema where (as R-FCN's caffe.proto does) psroi_pooling_param is field
# 149, which brewnet gives the YOLO ports' reorg_param, plus two fields brewnet does not have,
# one of them (wide_param) at a number brewnet uses for another field (upsample_param's 150).
FANCY = "message FancyParameter { optional int32 k = 1 [default = 3]; repeated float w = 2; }\n"


def fork_proto(path: Path) -> Path:
    src = OURS.read_text()
    src = re.sub(r"\n\s*optional ReorgParameter reorg_param = 149;[^\n]*", "", src)
    src, n = re.subn(r"optional PSROIPoolingParameter psroi_pooling_param = \d+;",
                     "optional PSROIPoolingParameter psroi_pooling_param = 149;", src)
    assert n == 1
    src, n = re.subn(r"\n\s*optional UpsampleParameter upsample_param = 150;[^\n]*", "", src)
    assert n == 1
    src = src.replace("message LayerParameter {",
                      "message LayerParameter {\n  optional FancyParameter fancy_param = 9123457;\n"
                      "  optional FancyParameter wide_param = 150;", 1)
    path.write_text(src + FANCY)
    return path


NET = """name: "f"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 8 dim: 6 dim: 6 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 2 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 1 } fancy_param { k: 7 w: 1.5 w: 2 } wide_param { k: 9 } }
layer { name: "ps" type: "PSROIPooling" bottom: "conv" bottom: "rois" top: "ps"
  psroi_pooling_param { spatial_scale: 1 output_dim: 2 group_size: 2 } }
"""
X = np.random.default_rng(0).standard_normal((1, 8, 6, 6)).astype(F32)
ROIS = np.array([[0, 0, 0, 5, 5], [0, 1, 1, 4, 4]], F32)


@pytest.fixture
def fork(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    return fork_proto(tmp_path / "fork.proto")


def fork_module(fork: Path) -> str:
    """The fork's classes as protoc generates them, importable from a child process."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{fork.parent}",
                    f"--python_out={fork.parent}", fork.name], check=True)
    return fork.stem + "_pb2"


def in_fork(fork: Path, code: str) -> str:
    """Run ``code`` with the fork's generated module as ``f`` (its own process: its messages
    are named caffe.* as brewnet's are)."""
    mod = fork_module(fork)
    out = subprocess.run([sys.executable, "-c", f"import {mod} as f\n{code}"], cwd=fork.parent,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_fork_schema_parses_what_brewnets_refuses_and_says_so_once(fork, caplog):
    path = fork.parent / "net.prototxt"
    with pytest.raises(ProtoError) as e:
        caffe.Net(str(path), caffe.TEST)
    msg = str(e.value)
    assert "\n" not in msg and f"{path}:5:" in msg and "layer 'conv' (type Convolution)" in msg
    assert "unknown field 'fancy_param'" in msg and "--proto" in msg
    schema._warned.clear()
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        net = caffe.Net(str(path), caffe.TEST, proto=str(fork))
        caffe.Net(str(path), caffe.TEST, proto=str(fork))
    named = [r.getMessage() for r in caplog.records if "fancy_param" in r.getMessage()]
    assert named == [f"{path}: layer 'conv' (type Convolution): field fancy_param is parsed but "
                     "no built-in layer reads it"]
    assert net.layer_by_name["ps"].param.psroi_pooling_param.group_size == 2
    assert net.blobs["ps"].data.shape == (2, 2, 2, 2)


def test_a_caffemodel_in_the_forks_numbers_loads_and_is_written_back_in_them(fork):
    path = fork.parent / "net.prototxt"
    ref = caffe.Net(str(path), caffe.TEST, proto=str(fork))
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((8, 8, 1, 1)).astype(F32), rng.standard_normal(8).astype(F32)
    ref.params["conv"][0].data[...] = w
    ref.params["conv"][1].data[...] = b
    want = ref.forward(data=X, rois=ROIS)["ps"].copy()
    # written by the fork's own generated classes: psroi_pooling_param at 149, fancy_param
    in_fork(fork, f"""
import numpy as np
n = f.NetParameter(name="f")
conv = n.layer.add(name="conv", type="Convolution")
conv.convolution_param.num_output = 8
conv.fancy_param.k = 7
for a in (np.array({w.tolist()}, np.float32), np.array({b.tolist()}, np.float32)):
    blob = conv.blobs.add(); blob.shape.dim.extend(a.shape); blob.data.extend(a.ravel().tolist())
ps = n.layer.add(name="ps", type="PSROIPooling")
ps.psroi_pooling_param.output_dim = 2; ps.psroi_pooling_param.group_size = 2
open("theirs.caffemodel", "wb").write(n.SerializeToString())
""")
    theirs = fork.parent / "theirs.caffemodel"
    net = caffe.Net(str(path), caffe.TEST, weights=str(theirs), proto=str(fork))
    np.testing.assert_array_equal(net.forward(data=X, rois=ROIS)["ps"], want)
    # saved with the same schema: the fork reads its own numbers back, fancy_param kept
    net.save(str(fork.parent / "ours.caffemodel"))
    out = in_fork(fork, """
n = f.NetParameter.FromString(open("ours.caffemodel", "rb").read())
by = {l.name: l for l in n.layer}
c = by["conv"]
print(by["ps"].psroi_pooling_param.group_size, c.fancy_param.k, list(c.fancy_param.w), c.wide_param.k)
""")
    # as Caffe's ToProto, the layers' fields come from the net's prototxt; wide_param, at a
    # number brewnet uses for upsample_param, is carried at another number and written back at 150
    assert out.split() == ["2", "7", "[1.5,", "2.0]", "9"]


def test_upgrade_net_with_proto_round_trips_the_forks_fields(fork, tmp_path):
    out = tmp_path / "out.prototxt"
    assert main(["upgrade-net", str(tmp_path / "net.prototxt"), str(out), "--proto", str(fork)]) == 0
    text = out.read_text()
    assert re.search(r"fancy_param \{\s*k: 7\s*w: 1.5\s*w: 2", text)
    assert re.search(r"psroi_pooling_param \{\s*spatial_scale: 1", text)
    # the fork's generated classes read it as their own text
    assert in_fork(fork, 'from google.protobuf import text_format\n'
                         'n = text_format.Parse(open("out.prototxt").read(), f.NetParameter())\n'
                         'print(n.layer[2].fancy_param.k)').strip() == "7"


def test_brewnet_proto_and_use_proto(fork, tmp_path, monkeypatch):
    env = {**os.environ, "BREWNET_PROTO": str(fork)}
    run = subprocess.run([sys.executable, "-m", "brewnet", "shapes", str(tmp_path / "net.prototxt")],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0 and re.search(r"ps\s+PSROIPooling\s+ps \(2, 2, 2, 2\)", run.stdout), run.stderr
    try:
        assert caffe.use_proto(str(fork)) is schema.active()
        assert caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST).schema is schema.active()
    finally:
        caffe.use_proto(None)
    assert schema.active() is None


def test_schema_errors_are_one_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.proto"
    bad.write_text('syntax = "proto2";\npackage caffe;\nmessage NetParameter { optional strin name = 1; }\n')
    with pytest.raises(ProtoError, match=r"bad.proto: protoc cannot compile the schema: .*strin"):
        caffe.Net(NET, caffe.TEST, proto=str(bad))
    other = tmp_path / "other.proto"
    other.write_text('syntax = "proto2";\npackage x;\nmessage Y { optional int32 a = 1; }\n')
    with pytest.raises(ProtoError, match="declares no NetParameter"):
        schema.load(other)
    with pytest.raises(ProtoError, match="cannot read the schema"):
        schema.load(tmp_path / "missing.proto")
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(
        ImportError(name)) if name == "grpc_tools" else real(name, *a, **k))
    schema._compile.cache_clear()
    schema._cached.cache_clear()
    with pytest.raises(ProtoError, match=r'pip install "brewnet\[forks\]"'):
        schema.load(fork_proto(tmp_path / "f2.proto"))


def test_unknown_type_is_one_line_naming_file_layer_and_the_ways_forward(tmp_path, capsys):
    path = tmp_path / "u.prototxt"
    path.write_text(NET.replace('"PSROIPooling"', '"PSROIPoolingX"').replace(
        "fancy_param { k: 7 w: 1.5 w: 2 } wide_param { k: 9 }", ""))
    with pytest.raises(LayerError) as e:
        caffe.Net(str(path), caffe.TEST)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: Layer 'ps': unknown layer type 'PSROIPoolingX'")
    assert "did you mean 'PSROIPooling'" in msg and "register_layer" in msg
    assert "docs/writing-a-layer.md" in msg and "Python layer" in msg
    assert main(["shapes", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown layer type 'PSROIPoolingX'" in err
    # --allow-unknown: the shapes up to it
    assert main(["shapes", str(path), "--allow-unknown"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"conv\s+Convolution\s+conv \(1, 8, 6, 6\)", out) and "PSROIPoolingX" not in out
    assert "layer 'ps' (type PSROIPoolingX)" in err
    # doctor: before anything is built, every type and whether brewnet runs it
    assert main(["doctor", str(path)]) == 1
    out, err = capsys.readouterr()
    assert re.search(r"ps\s+PSROIPoolingX\s+unknown\s+brewnet has no layer of this type", out)
    assert re.search(r"conv\s+Convolution\s+built-in", out)
    assert "brewnet does not know PSROIPoolingX" in err
    assert main(["doctor", str(tmp_path / "missing.prototxt")]) == 1          # one line, no traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.prototxt: cannot read" in err


def test_doctor_names_fields_no_layer_reads_and_the_weights(fork, tmp_path, capsys):
    path = tmp_path / "d.prototxt"
    path.write_text(NET.replace("fancy_param { k: 7 w: 1.5 w: 2 } wide_param { k: 9 }", "pooling_param { pool: AVE }"))
    net = caffe.Net(str(path), caffe.TEST)
    net.save(str(tmp_path / "d.caffemodel"))
    assert main(["doctor", str(path), str(tmp_path / "d.caffemodel")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"conv\s+Convolution\s+built-in\s+pooling_param: no built-in Convolution layer "
                     r"reads it; weights: 2 blobs", out)
    assert main(["doctor", str(tmp_path / "net.prototxt"), "--proto", str(fork)]) == 0
    out = capsys.readouterr().out
    assert "fancy_param: parsed in the fork's schema, no built-in layer reads it" in out
    assert "wide_param: parsed in the fork's schema, no built-in layer reads it" in out
    assert schema.active() is None and "BREWNET_PROTO" not in os.environ   # --proto ends with the command


def test_a_last_layer_in_place_is_an_output():
    net = caffe.Net("""name: "t"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 3 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
""", caffe.TEST)
    assert net.outputs == ["conv"]          # as the real pycaffe lists it
    out = net.forward(x=np.ones((1, 2, 3, 3), F32))
    assert list(out) == ["conv"] and out["conv"].shape == (1, 2, 3, 3)
