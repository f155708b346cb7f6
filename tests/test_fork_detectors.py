"""Issue 38: detector forks whose files brewnet's SSD/R-FCN reading refused.

* PriorBox layouts of TextBoxes (MhLiao/TextBoxes), TextBoxes++ (MhLiao/TextBoxes_plusplus) and
  FaceBoxes (sfzhang15/FaceBoxes): priors against loops written from each fork's
  src/caffe/layers/prior_box_layer.cpp (commits in tests/data/forks/PROVENANCE.md), and each
  fork's real deploy prototxt building and running forward through DetectionOutput.
* py-R-FCN's Caffe (Microsoft/caffe 1a2be8e) stores psroi_pooling_param at 149, brewnet's
  reorg_param: a caffemodel written in that schema (the vendored excerpt, compiled here) loads
  with the same outputs as brewnet's own file.
"""
from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pytest

import brewnet as caffe
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import read_net
from tests.helpers import VENDORED

FORKS = VENDORED / "forks"
F32 = np.float32


# -- py-R-FCN's psroi_pooling_param at 149 ---------------------------------------------------
@pytest.fixture(scope="module")
def rfcn_pb2(tmp_path_factory):
    pytest.importorskip("grpc_tools")
    out = tmp_path_factory.mktemp("rfcn_proto")
    (out / "rfcn_caffe.proto").write_text((FORKS / "rfcn_caffe_excerpt.proto").read_text())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{out}", f"--python_out={out}",
                    str(out / "rfcn_caffe.proto")], check=True)
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("rfcn_caffe_pb2")
    finally:
        sys.path.remove(str(out))


RFCN_NET = """name: "rfcn"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 4 dim: 9 dim: 11 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 3 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 45 kernel_size: 1 } }
layer { name: "ps" type: "PSROIPooling" bottom: "c" bottom: "rois" top: "p"
        psroi_pooling_param { spatial_scale: 0.0625 output_dim: 5 group_size: 3 } }
"""


def test_a_py_rfcn_schema_caffemodel_loads_with_the_same_outputs(rfcn_pb2, tmp_path):
    rng = np.random.default_rng(38)
    ref = caffe.Net(RFCN_NET, caffe.TEST)
    for b in ref.params["conv"]:
        b.data[...] = rng.standard_normal(b.data.shape)
    x = rng.standard_normal((1, 4, 9, 11)).astype(F32)
    rois = np.array([[0, 0, 0, 150, 120], [0, 16, 40, 90, 100], [0, 33.5, 7.25, 170, 140]], F32)
    ref.forward(x=x, rois=rois)
    ref.save(str(tmp_path / "brewnet.caffemodel"))
    # py-R-FCN's own file: psroi_pooling_param at 149 (output_dim 5: a bool there would read 1)
    fork = rfcn_pb2.NetParameter(name="rfcn")
    for lp in read_net(RFCN_NET).layer[2:]:
        layer = fork.layer.add(name=lp.name, type=lp.type, bottom=lp.bottom, top=lp.top)
        if lp.type == "Convolution":
            layer.convolution_param.num_output = 45
            layer.convolution_param.kernel_size.append(1)
        else:
            layer.psroi_pooling_param.spatial_scale = 0.0625
            layer.psroi_pooling_param.output_dim = 5
            layer.psroi_pooling_param.group_size = 3
        for p in ref.params.get(lp.name, []):
            b = layer.blobs.add()
            b.shape.dim.extend(p.data.shape)
            b.data.extend(p.data.reshape(-1).tolist())
    path = tmp_path / "fork.caffemodel"
    path.write_bytes(fork.SerializeToString())
    read = {lp.name: lp for lp in read_net(str(path)).layer}
    assert not read["ps"].HasField("reorg_param")
    assert read["ps"].psroi_pooling_param == pb.PSROIPoolingParameter(
        spatial_scale=0.0625, output_dim=5, group_size=3)
    assert read["ps"].psroi_pooling_param == {
        lp.name: lp for lp in read_net(str(tmp_path / "brewnet.caffemodel")).layer}["ps"].psroi_pooling_param
    for weights in (path, tmp_path / "brewnet.caffemodel"):
        net = caffe.Net(RFCN_NET, caffe.TEST)
        net.copy_from(str(weights))
        net.forward(x=x, rois=rois)
        np.testing.assert_array_equal(net.blobs["p"].data, ref.blobs["p"].data)


def test_a_yolo_reorg_at_149_still_reads_as_reorg():
    net = read_net('layer { name: "r" type: "Reorg" bottom: "x" top: "y" '
                   'reorg_param { stride: 2 reverse: true } }')
    again = pb.NetParameter.FromString(net.SerializeToString())
    from brewnet.proto.upgrade import upgrade_net

    r = upgrade_net(again).layer[0]
    assert r.reorg_param.stride == 2 and r.reorg_param.reverse
    assert not r.HasField("psroi_pooling_param")
