"""The Caffe forks' layer fields in brewnet's schema (caffe.proto, "Fork layers"): text reads
them by name, binary files at each fork's own number (re-read by layer type where the number is
another field's, proto/upgrade.py FORK_NUMBERS), and a field that needs a reading brewnet does
not apply is one clear error. upgrade-net and text round trips keep the fields."""
from __future__ import annotations

import pytest
from google.protobuf import text_format

from brewnet.cli import main as cli_main
from brewnet.proto import ProtoError, read_net, upgrade_net
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import _varint

FORK_TEXT = """
name: "forks"
layer { name: "d" type: "Dropout" bottom: "x" top: "x"
  dropout_param { dropout_ratio: 0.3 scale_train: false } }
layer { name: "r" type: "ROIPooling" bottom: "x" bottom: "rois" top: "p"
  roi_pooling_param { pooled_h: 7 pooled_w: 6 spatial_scale: 0.0625 } }
layer { name: "ps" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "q"
  psroi_pooling_param { spatial_scale: 0.0625 output_dim: 21 group_size: 7 } }
layer { name: "s" type: "SmoothL1Loss" bottom: "a" bottom: "b" top: "l" smooth_l1_loss_param { sigma: 3 } }
layer { name: "pr" type: "Proposal" bottom: "c" bottom: "d" bottom: "im" top: "rois"
  proposal_param { feat_stride: 16 scale: 4 scale: 8 ratio: 1 } }
layer { name: "i" type: "Interp" bottom: "x" top: "y" interp_param { zoom_factor: 8 pad_beg: 0 pad_end: 0 } }
layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "z"
  upsample_param { scale: 2 upsample_h: 45 upsample_w: 60 } }
layer { name: "bn1" type: "BN" bottom: "x" top: "x"
  bn_param { slope_filler { type: "constant" value: 1 } momentum: 0.95 frozen: true } }
layer { name: "bn2" type: "BN" bottom: "x" top: "x"
  bn_param { scale_filler { type: "constant" value: 1 } bn_mode: INFERENCE } }
layer { name: "sh" type: "ShuffleChannel" bottom: "x" top: "x" shuffle_channel_param { group: 3 } }
layer { name: "ro" type: "Reorg" bottom: "x" top: "o" reorg_param { stride: 2 } }
layer { name: "r6" type: "ReLU6" bottom: "x" top: "x" relu6_param { negative_slope: 0.1 } }
layer { name: "rg" type: "Region" bottom: "o" top: "det"
  region_param { classes: 20 num: 5 anchors: 1.08 anchors: 1.19 } }
"""


def _ld(number, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _vi(number, value) -> bytes:
    return _varint(number << 3) + _varint(value)


def _layer_with(name, type, number, payload) -> "pb.LayerParameter":
    raw = pb.LayerParameter(name=name, type=type).SerializeToString() + _ld(number, payload)
    return pb.LayerParameter.FromString(raw)


def test_fork_fields_parse_by_name_and_round_trip_as_text_and_binary():
    net = read_net(FORK_TEXT)
    by = {l.name: l for l in net.layer}
    assert by["d"].dropout_param.scale_train is False
    assert (by["r"].roi_pooling_param.pooled_h, by["r"].roi_pooling_param.pooled_w) == (7, 6)
    assert by["ps"].psroi_pooling_param.group_size == 7
    assert list(by["pr"].proposal_param.scale) == [4, 8]
    assert by["i"].interp_param.zoom_factor == 8
    assert by["bn2"].bn_param.bn_mode == pb.BNParameter.INFERENCE
    assert by["rg"].region_param.anchors[:] == pytest.approx([1.08, 1.19])
    again = text_format.Parse(text_format.MessageToString(net), pb.NetParameter())
    assert again == net
    binary = upgrade_net(pb.NetParameter.FromString(net.SerializeToString()))
    assert binary == net


def test_fork_numbers_in_binary_are_read_by_layer_type():
    interp = _vi(1, 65) + _vi(2, 33) + _vi(3, 8)      # PSPNet InterpParameter at 143
    segnet_bn = _ld(1, pb.FillerParameter(type="constant", value=1).SerializeToString()) + _vi(3, 1)
    segnet_up = _vi(1, 2) + _vi(6, 45) + _vi(7, 60)   # SegNet UpsampleParameter at 137
    psroi = pb.PSROIPoolingParameter(spatial_scale=0.0625, output_dim=21, group_size=7)
    net = pb.NetParameter()
    net.layer.extend([
        _layer_with("i", "Interp", 143, interp),
        _layer_with("bn", "BN", 45, segnet_bn),
        _layer_with("u", "Upsample", 137, segnet_up),
        _layer_with("ps1", "PSROIPooling", 10001, psroi.SerializeToString()),
        _layer_with("ps2", "PSROIPooling", 10002, psroi.SerializeToString()),
        _layer_with("s", "SmoothL1Loss", 148, pb.SmoothL1LossParameter(sigma=3).SerializeToString()),
        _layer_with("p", "Proposal", 201, pb.ProposalParameter(feat_stride=8).SerializeToString()),
    ])
    out = {l.name: l for l in upgrade_net(net).layer}
    p = out["i"].interp_param
    assert (p.height, p.width, p.zoom_factor) == (65, 33, 8) and not out["i"].HasField("input_param")
    bn = out["bn"].bn_param
    assert bn.slope_filler.value == 1 and bn.bn_mode == pb.BNParameter.INFERENCE
    assert (out["u"].upsample_param.upsample_h, out["u"].upsample_param.upsample_w) == (45, 60)
    assert out["ps1"].psroi_pooling_param == psroi == out["ps2"].psroi_pooling_param
    assert out["s"].smooth_l1_loss_param.sigma == 3 and not out["s"].HasField("clip_param")
    assert out["p"].proposal_param.feat_stride == 8
    # brewnet writes its own numbers: written back and read again, nothing moves.
    again = upgrade_net(pb.NetParameter.FromString(upgrade_net(net).SerializeToString()))
    assert again == upgrade_net(net)


def test_a_field_that_needs_the_other_reading_is_one_clear_error():
    net = pb.NetParameter()
    net.layer.append(_layer_with("x", "Input", 143, _vi(1, 65)))   # interp_param in an Input layer
    with pytest.raises(ProtoError, match=r"layer 'x' \(type Input\): field 143 does not decode "
                                         r"as input_param; DeepLab v2 / PSPNet store interp_param"):
        upgrade_net(net)
    bad = pb.NetParameter()
    bad.layer.append(_layer_with("i", "Interp", 143, _ld(9, b"zz")))   # neither reading
    with pytest.raises(ProtoError, match="field 143 does not decode as DeepLab v2 / PSPNet's interp_param"):
        upgrade_net(bad)


def test_upgrade_net_keeps_fork_fields(tmp_path):
    src = tmp_path / "in.prototxt"
    src.write_text(FORK_TEXT)
    out = tmp_path / "out.prototxt"
    assert cli_main(["upgrade-net", str(src), str(out)]) == 0
    assert read_net(str(out)) == read_net(FORK_TEXT)
    # binary: a SegNet-numbered file comes out in brewnet's numbering, fields kept
    net = pb.NetParameter(name="segnet")
    net.layer.append(_layer_with("u", "Upsample", 137, _vi(1, 2)))
    bsrc, bout = tmp_path / "in.caffemodel", tmp_path / "out.caffemodel"
    bsrc.write_bytes(net.SerializeToString())
    assert cli_main(["upgrade-net", "-binary", str(bsrc), str(bout)]) == 0
    got = pb.NetParameter.FromString(bout.read_bytes())
    assert got.layer[0].upsample_param.scale == 2 and not got.layer[0].HasField("embed_param")
