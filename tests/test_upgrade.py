"""brewnet.proto.upgrade: Caffe's legacy-format upgrades (V0, data transforms, V1, inputs,
BatchNorm, solver_type) plus the ceil_mode mapping, and the upgrade-net/-solver commands."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from brewnet.cli import main as cli_main
from brewnet.proto import (
    ProtoError,
    blob_to_array,
    needs_upgrade,
    parse_text,
    read_binary,
    read_net,
    read_solver,
    read_text,
    upgrade_net,
    upgrade_solver,
)
from brewnet.proto import caffe_pb2 as pb
from tests.helpers import GOLDEN_NETS, MODELS, have, need

EVERPEACE = MODELS / "trained" / "everpeace_caffe_2014_v1format" / "examples"
V1_TEXT = sorted(EVERPEACE.rglob("*.prototxt"))
V1_NETS = [p for p in V1_TEXT if "solver" not in p.name]
V1_MODELS = sorted(EVERPEACE.rglob("*.caffemodel")) or [EVERPEACE / "*.caffemodel"]  # none vendored: need() skips


def _net(text):
    return parse_text(text, pb.NetParameter())


def _check_v1_to_v2(old, new):
    """Every V1 layer became the V2 layer Caffe's UpgradeV1LayerParameter gives."""
    assert len(new.layer) == len(old.layers) and not new.layers
    for v1, v2 in zip(old.layers, new.layer):
        assert v2.name == v1.name and v2.type
        assert list(v2.bottom) == list(v1.bottom) and list(v2.top) == list(v1.top)
        assert [p.lr_mult for p in v2.param][:len(v1.blobs_lr)] == list(v1.blobs_lr)
        assert [p.decay_mult for p in v2.param][:len(v1.weight_decay)] == list(v1.weight_decay)
        assert len(v2.param) == max(len(v1.blobs_lr), len(v1.weight_decay), len(v1.param))
        assert list(v2.include) == list(v1.include) and list(v2.exclude) == list(v1.exclude)
        assert list(v2.blobs) == list(v1.blobs)
        for f in ("convolution_param", "pooling_param", "inner_product_param", "lrn_param"):
            assert getattr(v2, f) == getattr(v1, f)


@pytest.mark.parametrize("path", V1_NETS, ids=lambda p: p.name)
def test_v1_prototxts_upgrade(path):
    old = read_text(path, pb.NetParameter())
    assert old.layers and needs_upgrade(old)
    new = read_net(path)
    body = [l for l in new.layer if l.type != "Input"]
    _check_v1_to_v2(old, pb.NetParameter(layer=body))
    assert not needs_upgrade(new)


def test_v1_lenet_types_and_multipliers():
    net = read_net(EVERPEACE / "mnist" / "lenet_train_test.prototxt")
    assert [l.type for l in net.layer] == ["Data", "Data", "Convolution", "Pooling",
                                          "Convolution", "Pooling", "InnerProduct", "ReLU",
                                          "InnerProduct", "Accuracy", "SoftmaxWithLoss"]
    conv1 = net.layer[2]
    assert [(p.lr_mult, p.decay_mult) for p in conv1.param] == [(1, 1), (2, 1)]
    assert net.layer[0].include[0].phase == pb.TRAIN and net.layer[1].include[0].phase == pb.TEST


def test_v1_cifar_weight_decay():
    old = read_text(EVERPEACE / "cifar10" / "cifar10_full_train_test.prototxt", pb.NetParameter())
    net = read_net(EVERPEACE / "cifar10" / "cifar10_full_train_test.prototxt")
    ip1 = next(l for l in net.layer if l.name == "ip1")
    v1 = next(l for l in old.layers if l.name == "ip1")
    assert [p.lr_mult for p in ip1.param] == list(v1.blobs_lr) == [1, 2]
    assert [p.decay_mult for p in ip1.param] == list(v1.weight_decay) == [250, 0]
    assert [l.type for l in net.layer if l.name.startswith("norm")] == ["LRN", "LRN"]


@pytest.mark.parametrize("path", V1_MODELS, ids=lambda p: p.name)
def test_v1_caffemodels_upgrade(path):
    old = read_binary(need(path), pb.NetParameter())
    new = read_net(path)
    _check_v1_to_v2(old, new)
    conv1 = next(l for l in new.layer if l.name == "conv1")
    assert conv1.type == "Convolution" and len(conv1.blobs) == 2
    ips = [l for l in new.layer if l.type == "InnerProduct"]
    assert ips and all(blob_to_array(l.blobs[0]).ndim == 4 for l in ips)   # legacy (1,1,N,K)
    assert new.layer[-1].type == "SoftmaxWithLoss"


def test_matches_caffes_own_upgrade_of_every_golden_net():
    """Layer names/types after upgrade agree with the nets real Caffe built (nets/shapes.json;
    V1 nets there went through Caffe's upgrade_net_proto_text)."""
    nets = json.loads((GOLDEN_NETS / "shapes.json").read_text())["nets"]
    checked = 0
    for rel, built in nets.items():
        if any("stage" in n for n in built["notes"]) or not have(MODELS / rel):   # vgg without shared data
            continue
        net = read_net(MODELS / rel)
        mine = [l for l in net.layer if _in_test_phase(l)]
        gold = [l for l in built["layers"] if l["type"] != "Split"]
        assert [l.name for l in mine] == [g["name"] for g in gold], rel
        for l, g in zip(mine, gold):   # Caffe's run swapped data layers for Input layers
            assert l.type == g["type"] or g["type"] == "Input", (rel, l.name)
        checked += 1
    assert checked >= 50


def _in_test_phase(layer):
    def met(rule):
        return (not rule.HasField("phase") or rule.phase == pb.TEST) and not rule.stage
    if layer.include:
        return any(met(r) for r in layer.include)
    return not any(met(r) for r in layer.exclude)


def test_input_dim_becomes_first_input_layer():
    net = read_net(MODELS / "resnet" / "prototxt" / "ResNet-50-deploy.prototxt")
    first = net.layer[0]
    assert (first.name, first.type, list(first.top)) == ("input", "Input", ["data"])
    assert [list(s.dim) for s in first.input_param.shape] == [[1, 3, 224, 224]]
    assert net.layer[1].name == "conv1"
    assert not net.input and not net.input_dim and not net.input_shape


def test_input_shape_and_shapeless_inputs():
    net = upgrade_net(_net('input: "a" input: "b" input_shape { dim: 2 dim: 3 } '
                           'input_shape { dim: 4 } layer { name: "x" type: "Concat" }'))
    assert [l.name for l in net.layer] == ["input", "x"]
    assert list(net.layer[0].top) == ["a", "b"]
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[2, 3], [4]]
    # inputs without shapes (old caffemodels) are dropped
    net = upgrade_net(_net('input: "data" layer { name: "x" type: "ReLU" }'))
    assert [l.name for l in net.layer] == ["x"] and not net.input
    with pytest.raises(ProtoError, match="need 8 input_dim"):
        upgrade_net(_net('input: "a" input: "b" input_dim: 1 input_dim: 2 input_dim: 3 '
                         'input_dim: 4'))


def test_batchnorm_param_specs_zeroed():
    text = ('layer { name: "bn" type: "BatchNorm" param { lr_mult: 1 decay_mult: 1 } '
            'param { lr_mult: 1 } param { lr_mult: 1 name: "keep" } }'
            'layer { name: "bn2" type: "BatchNorm" param { lr_mult: 1 } }')
    old = _net(text)
    assert needs_upgrade(old)
    net = upgrade_net(old)
    assert [(p.lr_mult, p.decay_mult) for p in net.layer[0].param] == [(0, 0)] * 3
    assert net.layer[0].param[2].name == "keep"
    assert net.layer[1].param[0].lr_mult == 1   # only 3-spec definitions are touched
    assert old.layer[0].param[0].lr_mult == 1   # the input message is left alone


def test_ceil_mode_maps_to_round_mode():
    net = read_net(need(MODELS / "densenet" / "DenseNet_121.prototxt"))
    pools = [l.pooling_param for l in net.layer if l.type == "Pooling"]
    raw = read_text(MODELS / "densenet" / "DenseNet_121.prototxt", pb.NetParameter())
    n_floor = sum(l.pooling_param.HasField("ceil_mode") and not l.pooling_param.ceil_mode
                  for l in raw.layer)
    assert n_floor >= 1
    assert sum(p.round_mode == pb.PoolingParameter.FLOOR for p in pools) == n_floor
    assert not any(p.HasField("ceil_mode") for p in pools)
    net = upgrade_net(_net('layer { name: "p" type: "Pooling" pooling_param { ceil_mode: true } }'))
    assert net.layer[0].pooling_param.round_mode == pb.PoolingParameter.CEIL
    with pytest.raises(ProtoError, match="contradicts round_mode"):
        upgrade_net(_net('layer { name: "p" type: "Pooling" '
                         'pooling_param { ceil_mode: false round_mode: CEIL } }'))


def test_data_transform_fields_move_to_transform_param():
    net = upgrade_net(_net('layers { name: "d" type: DATA top: "x" data_param { source: "db" '
                           'scale: 0.5 mean_file: "m" crop_size: 9 mirror: true batch_size: 2 } }'
                           'layers { name: "w" type: WINDOW_DATA top: "y" '
                           'window_data_param { crop_size: 7 } }'))
    d = net.layer[0]
    assert (d.type, d.transform_param.scale, d.transform_param.mean_file,
            d.transform_param.crop_size, d.transform_param.mirror) == ("Data", 0.5, "m", 9, True)
    assert not d.data_param.HasField("scale") and d.data_param.batch_size == 2
    assert net.layer[1].transform_param.crop_size == 7


def test_mixed_layer_and_layers_is_refused():
    with pytest.raises(ProtoError, match="both 'layer' and 'layers'"):
        upgrade_net(_net('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }'))


V0_NET = '''
name: "v0"
layers { layer { name: "data" type: "data" source: "db" meanfile: "mean.bp" batchsize: 16
                 cropsize: 27 mirror: true }
         top: "data" top: "label" }
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 8 kernelsize: 5 stride: 2 group: 2
                 weight_filler { type: "gaussian" std: 0.01 } bias_filler { type: "constant" }
                 blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 }
         bottom: "pad1" top: "conv1" }
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers { layer { name: "pad2" type: "padding" pad: 1 } bottom: "conv1" top: "pad2" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 3 stride: 2 }
         bottom: "pad2" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.001 beta: 0.5 }
         bottom: "pool1" top: "norm1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 biasterm: false }
         bottom: "norm1" top: "fc" }
layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.3 } bottom: "fc" top: "fc" }
layers { layer { name: "loss" type: "softmax_loss" } bottom: "fc" bottom: "label" }
'''


def test_v0_net_with_padding_layers(caplog):
    with caplog.at_level(logging.INFO, logger="brewnet"):
        net = upgrade_net(_net(V0_NET), "v0.prototxt")
    assert "V0LayerParameter" in caplog.text and "v0.prototxt" in caplog.text
    assert [(l.name, l.type) for l in net.layer] == [
        ("data", "Data"), ("conv1", "Convolution"), ("relu1", "ReLU"), ("pool1", "Pooling"),
        ("norm1", "LRN"), ("fc", "InnerProduct"), ("drop", "Dropout"),
        ("loss", "SoftmaxWithLoss")]
    data, conv, _, pool, lrn, fc, drop, _ = net.layer
    assert (data.data_param.source, data.data_param.batch_size) == ("db", 16)
    assert (data.transform_param.mean_file, data.transform_param.crop_size,
            data.transform_param.mirror) == ("mean.bp", 27, True)
    c = conv.convolution_param
    assert list(conv.bottom) == ["data"]   # the padding layer is folded away
    assert (c.num_output, list(c.pad), list(c.kernel_size), list(c.stride), c.group) == \
        (8, [2], [5], [2], 2)
    assert c.weight_filler.type == "gaussian" and c.weight_filler.std == pytest.approx(0.01)
    assert [(p.lr_mult, p.decay_mult) for p in conv.param] == [(1, 1), (2, 0)]
    p = pool.pooling_param
    assert list(pool.bottom) == ["conv1"]
    assert (p.pool, p.pad, p.kernel_size, p.stride) == (pb.PoolingParameter.AVE, 1, 3, 2)
    assert (lrn.lrn_param.local_size, lrn.lrn_param.beta) == (3, 0.5)
    assert (fc.inner_product_param.num_output, fc.inner_product_param.bias_term) == (10, False)
    assert drop.dropout_param.dropout_ratio == pytest.approx(0.3)
    assert not needs_upgrade(net)


def test_v0_problems():
    # a parameter the layer type cannot take: logged, the rest still upgraded (as Caffe)
    net = upgrade_net(_net('layers { layer { name: "r" type: "relu" num_output: 3 } '
                           'bottom: "x" top: "y" } input: "x"'))
    assert net.layer[-1].type == "ReLU"
    with pytest.raises(ProtoError, match="padding layer 'p' feeds layer 'r'"):
        upgrade_net(_net('input: "x" layers { layer { name: "p" type: "padding" pad: 1 } '
                         'bottom: "x" top: "px" } '
                         'layers { layer { name: "r" type: "relu" } bottom: "px" top: "y" }'))
    with pytest.raises(ProtoError, match="unknown layer type 'warp'"):
        upgrade_net(_net('layers { layer { name: "w" type: "warp" } }'))


def test_current_nets_are_left_unchanged():
    for rel in ("bvlc/examples/mnist/lenet_train_test.prototxt",
                "squeezenet/SqueezeNet_v1.1/train_val.prototxt"):
        net = read_text(MODELS / rel, pb.NetParameter())
        assert not needs_upgrade(net) and upgrade_net(net) == net


SOLVER_TYPES = [("SGD", "SGD"), ("NESTEROV", "Nesterov"), ("ADAGRAD", "AdaGrad"),
                ("RMSPROP", "RMSProp"), ("ADADELTA", "AdaDelta"), ("ADAM", "Adam")]


@pytest.mark.parametrize("enum,name", SOLVER_TYPES)
def test_solver_type_upgrade(enum, name):
    old = parse_text(f"base_lr: 0.01 solver_type: {enum}", pb.SolverParameter())
    new = upgrade_solver(old)
    assert new.type == name and not new.HasField("solver_type") and new.base_lr == old.base_lr


def test_solver_type_and_type_together_is_refused():
    with pytest.raises(ProtoError, match="cannot both"):
        upgrade_solver(parse_text('solver_type: ADAM type: "Adam"', pb.SolverParameter()))


def test_solver_inline_v1_net_is_upgraded(tmp_path):
    path = tmp_path / "s.prototxt"
    path.write_text('solver_type: NESTEROV net_param { layers { name: "r" type: RELU } }')
    s = read_solver(path)
    assert s.type == "Nesterov" and s.net_param.layer[0].type == "ReLU"


def test_upgrade_net_cli_text(tmp_path, capsys):
    src = EVERPEACE / "mnist" / "lenet.prototxt"
    out = tmp_path / "lenet_v2.prototxt"
    assert cli_main(["upgrade-net", str(src), str(out)]) == 0
    net = read_text(out, pb.NetParameter())
    assert not net.layers and not net.input and net.layer[0].type == "Input"
    assert [l.type for l in net.layer[1:3]] == ["Convolution", "Pooling"]
    assert str(out) in capsys.readouterr().out


def test_upgrade_net_cli_binary(tmp_path):
    src = need(EVERPEACE / "mnist" / "lenet_iter_5000.caffemodel")
    out = tmp_path / "lenet_v2.caffemodel"
    assert cli_main(["upgrade-net", "-binary", str(src), str(out)]) == 0
    new = read_binary(out, pb.NetParameter())
    old = read_binary(src, pb.NetParameter())
    _check_v1_to_v2(old, new)
    ip2 = next(l for l in new.layer if l.name == "ip2")
    np.testing.assert_array_equal(blob_to_array(ip2.blobs[0]).reshape(10, 500),
                                  blob_to_array(next(l for l in old.layers
                                                     if l.name == "ip2").blobs[0])[0, 0])


def test_upgrade_net_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.prototxt"
    bad.write_text("layers { type: NOT_A_TYPE }")
    assert cli_main(["upgrade-net", str(bad), str(tmp_path / "o.prototxt")]) == 1
    err = capsys.readouterr().err
    assert "bad.prototxt:1:" in err and "NOT_A_TYPE" in err
    assert not (tmp_path / "o.prototxt").exists()


def test_upgrade_solver_cli(tmp_path):
    src = tmp_path / "old_solver.prototxt"
    src.write_text('net: "n.prototxt"\nbase_lr: 0.1\nsolver_type: RMSPROP\n')
    out = tmp_path / "new_solver.prototxt"
    assert cli_main(["upgrade-solver", str(src), str(out)]) == 0
    s = read_text(out, pb.SolverParameter())
    assert s.type == "RMSProp" and not s.HasField("solver_type") and s.net == "n.prototxt"
