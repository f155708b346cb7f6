"""brewnet.proto: the schema against real Caffe files, text/binary I/O, errors, blob conversion."""
from __future__ import annotations

import os

import numpy as np
import pytest
from google.protobuf import text_format

from brewnet.proto import (
    TEST,
    TRAIN,
    ProtoError,
    array_to_blob,
    blob_to_array,
    parse_text,
    read_binary,
    read_binaryproto,
    read_net,
    read_solver,
    read_text,
    write_binary,
    write_binaryproto,
    write_text,
)
from brewnet.proto import caffe_pb2 as pb
from tests.helpers import GOLDEN, GOLDEN_LAYERS, GOLDEN_SOLVERS, MODELS, need

TRAINED = MODELS / "trained"
EVERPEACE = TRAINED / "everpeace_caffe_2014_v1format" / "examples"


def _message_for(path):
    if "solver" in path.name:
        return pb.SolverParameter()
    if "labelmap" in path.name:
        return pb.LabelMap()
    return pb.NetParameter()


PROTOTXTS = sorted(MODELS.rglob("*.prototxt"))
# none vendored: need() skips
CAFFEMODELS = sorted(MODELS.rglob("*.caffemodel")) or [MODELS / "trained" / "*.caffemodel"]


def _rel(p):
    return str(p.relative_to(MODELS))


def test_models_are_there():
    assert len(PROTOTXTS) >= 100
    assert len([need(p) for p in CAFFEMODELS]) >= 5


@pytest.mark.parametrize("path", PROTOTXTS, ids=_rel)
def test_every_prototxt_parses(path):
    msg = read_text(path, _message_for(path))
    assert msg.ByteSize() > 0
    if isinstance(msg, pb.NetParameter):
        net = read_net(path)   # upgraded: only current-format layers remain
        assert len(net.layer) > 0 and not net.layers and not net.input and not net.input_dim
        assert all(l.type for l in net.layer)
    elif isinstance(msg, pb.SolverParameter):
        assert read_solver(path).type


@pytest.mark.parametrize("path", CAFFEMODELS, ids=_rel)
def test_every_caffemodel_reads_with_blobs_matching_shapes(path):
    net = read_net(need(path))
    blobs = [b for l in net.layer for b in l.blobs]
    assert blobs and not net.layers
    for b in blobs:
        assert blob_to_array(b).dtype == np.float32


def test_schema_facts():
    # numbers and defaults other code relies on (Caffe's caffe.proto)
    f = pb.LayerParameter.DESCRIPTOR.fields_by_name
    assert (f["convolution_param"].number, f["pooling_param"].number, f["clip_param"].number,
            f["swish_param"].number, f["norm_param"].number, f["prior_box_param"].number) == \
        (106, 121, 148, 147, 206, 203)
    assert pb.NetParameter.DESCRIPTOR.fields_by_name["layer"].number == 100
    assert pb.V1LayerParameter.SOFTMAX_LOSS == 21 and pb.V1LayerParameter.DECONVOLUTION == 39
    p = pb.PoolingParameter()
    assert (p.round_mode, p.ceil_mode, p.stride) == (pb.PoolingParameter.CEIL, True, 1)
    s = pb.SolverParameter()
    assert (s.type, s.delta, s.momentum2, s.rms_decay, s.random_seed, s.average_loss,
            s.snapshot_format, s.solver_mode) == \
        ("SGD", pytest.approx(1e-8), pytest.approx(0.999), pytest.approx(0.99), -1, 1,
         pb.SolverParameter.BINARYPROTO, pb.SolverParameter.GPU)
    assert (pb.NetState().phase, TRAIN, TEST) == (TEST, 0, 1)
    assert pb.FillerParameter().type == "constant" and pb.FillerParameter().std == 1
    assert pb.BatchNormParameter().eps == pytest.approx(1e-5)
    assert pb.LRNParameter().beta == pytest.approx(0.75)


def test_ssd_fields_parse_with_fork_numbers():
    text = ('transform_param { resize_param { height: 300 width: 300 resize_mode: WARP '
            'interp_mode: LINEAR } emit_constraint { emit_type: CENTER } '
            'distort_param { brightness_prob: 0.5 } expand_param { max_expand_ratio: 4 } }'
            'detection_output_param { num_classes: 21 nms_param { nms_threshold: 0.45 '
            'top_k: 400 } code_type: CENTER_SIZE keep_top_k: 200 }')
    layer = parse_text(text, pb.LayerParameter())
    assert layer.transform_param.resize_param.height == 300
    assert layer.detection_output_param.code_type == pb.PriorBoxParameter.CENTER_SIZE
    # wire tag of detection_output_param: field 204, length-delimited -> varint 0xe2 0x0c
    assert b"\xe2\x0c" in layer.SerializeToString()


WRITTEN_BY_CAFFE = [
    (GOLDEN_SOLVERS / "type_sgd_iter_10.caffemodel", pb.NetParameter),
    (GOLDEN_SOLVERS / "type_sgd_iter_10.solverstate", pb.SolverState),
    (GOLDEN / "lmdb" / "fashion_mnist_test_mean.binaryproto", pb.BlobProto),
    (TRAINED / "open_nsfw" / "resnet_50_1by2_nsfw.caffemodel", pb.NetParameter),
    (TRAINED / "everpeace_caffe_2014_v1format" / "examples" / "mnist" /
     "lenet_iter_10000.caffemodel", pb.NetParameter),
    (TRAINED / "imagenet_mean" / "data" / "ilsvrc12" / "imagenet_mean.binaryproto",
     pb.BlobProto),
]


@pytest.mark.parametrize("path,kind", WRITTEN_BY_CAFFE, ids=lambda x: getattr(x, "name", ""))
def test_wire_compatible_byte_for_byte(path, kind):
    """Files written by Caffe's C++ protobuf decode with no unknown fields and re-encode to
    the very same bytes: every field number and wire type matches Caffe's schema."""
    data = need(path).read_bytes()
    msg = read_binary(path, kind())
    assert msg.SerializeToString() == data


def test_every_golden_layer_prototxt_parses():
    n = 0
    for path in sorted(GOLDEN_LAYERS.glob("*.npz")):
        with np.load(path) as z:
            for key in (k for k in z.files if k.endswith("prototxt")):
                parse_text(str(z[key]), pb.NetParameter(), f"{path.name}:{key}")
                n += 1
    assert n >= 100


# ------------------------------------------------------------------------- binary files

def test_lenet_v1_solverstate():
    s = read_binary(need(EVERPEACE / "mnist" / "lenet_iter_10000.solverstate"), pb.SolverState())
    assert s.iter == 10000 and len(s.history) == 8
    assert s.learned_net == "examples/mnist/lenet_iter_10000.caffemodel"
    shapes = [blob_to_array(h).shape for h in s.history]
    assert shapes[0] == (20, 1, 5, 5) and shapes[-1] == (1, 1, 1, 10)


def test_golden_solverstate():
    s = read_binary(GOLDEN_SOLVERS / "type_sgd_iter_10.solverstate", pb.SolverState())
    assert s.iter == 10 and s.learned_net == "run_iter_10.caffemodel" and len(s.history) == 8


def test_imagenet_mean_binaryproto():
    m = read_binaryproto(need(TRAINED / "imagenet_mean") / "data" / "ilsvrc12" /
                         "imagenet_mean.binaryproto")
    assert m.shape == (1, 3, 256, 256) and m.dtype == np.float32
    np.testing.assert_allclose(m.mean(axis=(0, 2, 3)), [103.894, 116.554, 122.581], atol=1e-3)


def test_fashion_mnist_mean_matches_reference():
    m = read_binaryproto(need(GOLDEN / "lmdb" / "fashion_mnist_test_mean.binaryproto"))
    ref = np.load(GOLDEN / "lmdb" / "fashion_mnist_test_reference.npz")["mean"]
    assert m.shape == ref.shape
    np.testing.assert_array_equal(m, ref)


def test_truncated_caffemodel_is_a_clear_error(tmp_path):
    data = need(TRAINED / "lenet_mnist_ethereon" / "examples" / "mnist" /
                "lenet_iter_10000.caffemodel").read_bytes()
    for frac in (0.0001, 0.37, 0.5, 0.999):
        bad = tmp_path / f"cut_{frac}.caffemodel"
        bad.write_bytes(data[:int(len(data) * frac)])
        with pytest.raises(ProtoError, match="truncated or corrupt") as e:
            read_net(bad)
        assert str(bad) in str(e.value)


def test_corrupt_and_empty_binaries(tmp_path):
    empty = tmp_path / "empty.caffemodel"
    empty.write_bytes(b"")
    with pytest.raises(ProtoError, match="empty"):
        read_net(empty)
    with pytest.raises(ProtoError, match="looks like a text file"):
        read_binary(MODELS / "bvlc" / "examples" / "mnist" / "lenet.prototxt", pb.NetParameter())
    # decodes, but blob data does not fill the blob's shape
    net = pb.NetParameter()
    layer = net.layer.add(name="ip", type="InnerProduct")
    layer.blobs.add().CopyFrom(array_to_blob(np.ones((4, 5), np.float32)))
    del layer.blobs[0].data[7:]
    odd = tmp_path / "odd.caffemodel"
    odd.write_bytes(net.SerializeToString())
    with pytest.raises(ProtoError, match=r"layer 'ip' blob 0: 7 data values for shape \(4, 5\)"):
        read_net(odd)
    # valid protobuf of another kind: top-level fields the NetParameter does not have
    other = tmp_path / "datum.caffemodel"
    other.write_bytes(pb.SolverState(iter=3).SerializeToString())   # varint where name is a string
    with pytest.raises(ProtoError, match="not part of NetParameter"):
        read_net(other)


def test_binary_round_trip_and_atomic_write(tmp_path):
    net = read_net(need(EVERPEACE / "mnist" / "lenet_iter_5000.caffemodel"))
    out = tmp_path / "copy.caffemodel"
    write_binary(out, net)
    write_binary(out, net)   # overwrite in place
    assert read_binary(out, pb.NetParameter()) == net
    assert os.listdir(tmp_path) == ["copy.caffemodel"]   # no temp files left behind


# ------------------------------------------------------------------------- text files

def test_text_round_trip(tmp_path):
    net = read_text(MODELS / "bvlc" / "models" / "bvlc_googlenet" / "train_val.prototxt",
                    pb.NetParameter())
    out = tmp_path / "g.prototxt"
    write_text(out, net)
    assert read_text(out, pb.NetParameter()) == net


def test_malformed_prototxt_names_file_line_column_and_field(tmp_path):
    bad = tmp_path / "bad.prototxt"
    bad.write_text('name: "n"\nlayer {\n  name: "c"\n  type: "Convolution"\n'
                   '  convolution_param { num_output: twenty }\n}\n')
    with pytest.raises(ProtoError) as e:
        read_net(bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad}:5:35:") and "field 'num_output'" in msg and "twenty" in msg


def test_unknown_field_error_names_it(tmp_path):
    bad = tmp_path / "typo.prototxt"
    bad.write_text('layer {\n  name: "p"\n  type: "Pooling"\n  poolin_param { pool: MAX }\n}\n')
    with pytest.raises(ProtoError, match=r"typo.prototxt:4:3: .*field 'poolin_param'"):
        read_net(bad)
    with pytest.raises(ProtoError, match=r"<string>:1:\d+: .*field 'pool'.*MAXX"):
        parse_text("pooling_param { pool: MAXX }", pb.LayerParameter())


def test_read_net_accepts_text_message_and_sniffs_binary(tmp_path):
    net = read_net('layer { name: "d" type: "Input" top: "x" '
                   'input_param { shape { dim: 1 dim: 2 } } }')
    assert net.layer[0].input_param.shape[0].dim == [1, 2]
    assert read_net(net) == net
    raw = tmp_path / "weights_no_suffix"
    raw.write_bytes(need(EVERPEACE / "mnist" / "lenet_iter_5000.caffemodel").read_bytes())
    assert read_net(raw).layer[1].name == "conv1"
    with pytest.raises(ProtoError, match="cannot read"):
        read_net(tmp_path / "missing.prototxt")


# ------------------------------------------------------------------------- blobs

def test_blob_to_array_shapes():
    legacy = pb.BlobProto(num=1, channels=1, height=10, width=10)
    legacy.data.extend(range(100))
    assert blob_to_array(legacy).shape == (1, 1, 10, 10)
    nd = pb.BlobProto()
    nd.shape.dim.extend([10, 10])
    nd.data.extend(range(100))
    a = blob_to_array(nd)
    assert a.shape == (10, 10) and a.dtype == np.float32 and a[3, 4] == 34
    scalar = pb.BlobProto()
    scalar.data.append(123)
    assert blob_to_array(scalar).shape == () and blob_to_array(scalar) == 123
    no_shape = pb.BlobProto()
    no_shape.data.extend(range(100))
    with pytest.raises(ProtoError, match=r"100 data values .* shape \(\) needs 1"):
        blob_to_array(no_shape)


def test_blob_double_data_and_diff():
    b = pb.BlobProto()
    b.shape.dim.extend([2, 3])
    b.double_data.extend([0.1 * i for i in range(6)])
    a = blob_to_array(b)
    assert a.dtype == np.float32 and a[1, 2] == np.float32(0.5)
    assert blob_to_array(b, dtype=np.float64)[1, 2] == 0.5
    assert not blob_to_array(b, return_diff=True).any()   # no diff stored: zeros


def test_array_to_blob_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    d = rng.standard_normal((3, 4, 5))
    b = array_to_blob(x, diff=d)
    assert list(b.shape.dim) == [3, 4, 5] and not b.HasField("num")
    np.testing.assert_array_equal(blob_to_array(b), x)
    np.testing.assert_array_equal(blob_to_array(b, return_diff=True), d.astype(np.float32))
    b64 = array_to_blob(d, double=True)
    assert len(b64.double_data) == 60 and not b64.data
    np.testing.assert_array_equal(blob_to_array(b64, dtype=np.float64), d)
    # what the fast path writes is what protobuf itself writes
    ref = pb.BlobProto()
    ref.shape.dim.extend([3, 4, 5])
    ref.data.extend(x.ravel().tolist())
    assert array_to_blob(x).SerializeToString() == ref.SerializeToString()
    with pytest.raises(ProtoError, match="diff shape"):
        array_to_blob(x, diff=np.zeros(3))


def test_binaryproto_write_read(tmp_path):
    m = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    write_binaryproto(tmp_path / "m.binaryproto", m)
    np.testing.assert_array_equal(read_binaryproto(tmp_path / "m.binaryproto"), m)
    write_binaryproto(tmp_path / "l.binaryproto", m, legacy=True)
    blob = read_binary(tmp_path / "l.binaryproto", pb.BlobProto())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 2, 2)
    assert read_binaryproto(tmp_path / "l.binaryproto").shape == (1, 3, 2, 2)


def test_text_format_of_generated_module_is_caffes():
    # Caffe's own text spelling of enums and nested messages must round-trip unchanged
    text = 'name: "x"\nstate {\n  phase: TRAIN\n  stage: "s"\n}\n'
    assert text_format.MessageToString(parse_text(text, pb.NetParameter())) == text
