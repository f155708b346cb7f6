"""brewnet.convert / ``brewnet import``: PyTorch and ONNX models to Caffe, proven.

The architectures are small hand-written modules (ResNet, MobileNet, ShuffleNet, SE blocks in
miniature), not torchvision's: torchvision 0.28 is not importable beside the CPU torch (its
compiled ops are CUDA builds), CI does not install it, and the full-size models take seconds each.
The torchvision table is benchmarks/from_torch.py's."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from brewnet.convert import ConversionError, check_torch, from_onnx, from_torch


def _prime(m: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d | nn.BatchNorm1d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
    return m.eval()


class Fn(nn.Module):
    def __init__(self, fn, *mods):
        super().__init__()
        self.fn, self.mods = fn, nn.ModuleList(mods)

    def forward(self, x):
        return self.fn(x, *self.mods)


class SE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 2, 1), nn.Conv2d(c // 2, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class Block(nn.Module):    # a ResNet basic block
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)


class Shuffle(nn.Module):  # ShuffleNet v2's unit: chunk, branch, concat, channel shuffle
    def __init__(self, c):
        super().__init__()
        self.branch = nn.Sequential(nn.Conv2d(c // 2, c // 2, 1), nn.BatchNorm2d(c // 2), nn.ReLU(),
                                    nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2))

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        y = torch.cat((a, self.branch(b)), 1)
        n, c, h, w = y.shape
        return y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


def seq(*m):
    return nn.Sequential(*m)


X = (1, 4, 9, 9)
# (id, module factory, input shape, dialect)
ROWS = [
    ("conv_groups_dilation", lambda: nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2), X, "bvlc"),
    ("conv_stride_rect", lambda: nn.Conv2d(4, 6, (3, 5), stride=(2, 1), padding=(1, 2)), X, "bvlc"),
    ("conv_asym_same", lambda: nn.Conv2d(4, 4, 4, padding="same"), X, "bvlc"),
    ("conv_explicit_pad", lambda: Fn(lambda x, c: c(F.pad(x, (0, 1, 0, 1))), nn.Conv2d(4, 4, 3, 2)), X, "bvlc"),
    ("depthwise", lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), X, "bvlc"),
    ("deconv", lambda: nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1, groups=2), X, "bvlc"),
    ("linear_2d", lambda: seq(nn.Flatten(), nn.Linear(4 * 81, 5)), X, "bvlc"),
    ("linear_3d", lambda: nn.Linear(9, 3), X, "bvlc"),
    ("batchnorm", lambda: seq(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)), X, "bvlc"),
    ("batchnorm1d", lambda: seq(nn.Flatten(), nn.Linear(324, 6), nn.BatchNorm1d(6)), X, "bvlc"),
    ("relu_leaky_elu", lambda: seq(nn.ReLU(), nn.LeakyReLU(0.2), nn.ELU(0.7)), X, "bvlc"),
    ("prelu", lambda: seq(nn.PReLU(4), nn.PReLU()), X, "bvlc"),
    ("sigmoid_tanh", lambda: seq(nn.Sigmoid(), nn.Tanh()), X, "bvlc"),
    ("relu6_bvlc", lambda: Fn(lambda x: F.relu6(x * 5)), X, "bvlc"),
    ("relu6_forks", lambda: Fn(lambda x: F.relu6(x * 5)), X, "forks"),
    ("hardtanh_clamp", lambda: Fn(lambda x: F.hardtanh(x * 3, -2, 1) + x.clamp(min=0.1) + x.clamp(max=0.2)),
     X, "bvlc"),
    ("silu", lambda: nn.SiLU(), X, "bvlc"),
    ("silu_forks", lambda: nn.SiLU(), X, "forks"),
    ("hardswish_hardsigmoid", lambda: Fn(lambda x: F.hardswish(4 * x) + F.hardsigmoid(4 * x)), X, "bvlc"),
    ("avgpool_pad", lambda: nn.AvgPool2d(3, 2, 1), X, "bvlc"),
    ("adaptive_global", lambda: seq(nn.AdaptiveAvgPool2d(1), nn.Flatten()), X, "bvlc"),
    ("adaptive_divisor", lambda: nn.AdaptiveAvgPool2d(3), X, "bvlc"),
    ("adaptive_max", lambda: nn.AdaptiveMaxPool2d(1), X, "bvlc"),
    ("mean", lambda: Fn(lambda x: x.mean((2, 3)) + x.mean((-1, -2), keepdim=True).flatten(1)), X, "bvlc"),
    ("scalars", lambda: Fn(lambda x: ((x + 1) * 2 - 0.5) / 4 + (1 - x)), X, "bvlc"),
    ("eltwise", lambda: Fn(lambda x: x * x + x - x.sigmoid() - 2 * x / (x.abs() + 1)), X, "bvlc"),
    ("const_tensors", lambda: Fn(lambda x: x * torch.linspace(0.5, 2, 4).view(1, 4, 1, 1)
                                 + torch.arange(9.0)), X, "bvlc"),
    ("broadcast_se", lambda: SE(4), X, "bvlc"),
    ("broadcast_spatial", lambda: Fn(lambda x: x * x.mean(1, keepdim=True).sigmoid()
                                     ), X, "bvlc"),
    ("broadcast_tile", lambda: Fn(lambda x: x * torch.sigmoid(x[:, :1])), X, "bvlc"),
    ("concat_flatten_reshape", lambda: Fn(lambda x: torch.cat([x, x * 2], 1).reshape(1, 8, 81)
                                          .flatten(1).view(-1, 81, 8)), X, "bvlc"),
    ("channel_shuffle", lambda: Shuffle(4), X, "bvlc"),
    ("channel_shuffle_forks", lambda: Shuffle(4), X, "forks"),
    ("permute_ssd", lambda: Fn(lambda x: x.permute(0, 2, 3, 1).flatten(1)), X, "ssd"),
    ("slice_split_select", lambda: Fn(lambda x: torch.cat([x[:, 1:3], x[:, :, 2:-2].split([2, 3], 2)[1]
                                                           .mean((2, 3), True).expand(1, 4, 9, 9)[:, :2],
                                                           x.select(1, 3).unsqueeze(1)], 1)),
     X, "bvlc"),
    ("softmax", lambda: Fn(lambda x: x.softmax(1) + F.log_softmax(x, -1)), X, "bvlc"),
    ("upsample_nearest", lambda: nn.Upsample(scale_factor=2), X, "bvlc"),
    ("upsample_nearest_forks", lambda: nn.Upsample(scale_factor=3), X, "forks"),
    ("upsample_bilinear2", lambda: nn.Upsample(scale_factor=2, mode="bilinear"), X, "bvlc"),
    ("upsample_bilinear3", lambda: nn.Upsample(scale_factor=3, mode="bilinear"), (1, 2, 2, 5), "bvlc"),
    ("bilinear_corners_forks", lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
     X, "forks"),
    ("bilinear_corners_bvlc", lambda: Fn(lambda x: F.interpolate(x, size=(13, 20), mode="bilinear",
                                                                 align_corners=True)), X, "bvlc"),
    ("bilinear_to_size", lambda: Fn(lambda x: F.interpolate(x, size=(20, 31), mode="bilinear")), X, "bvlc"),
    ("bilinear_down", lambda: Fn(lambda x: F.interpolate(x, size=(4, 7), mode="bilinear")), X, "bvlc"),
    ("bilinear_given_scale", lambda: Fn(lambda x: F.interpolate(x, scale_factor=2.05, mode="bilinear")),
     X, "bvlc"),           # 9 -> 18, an integer ratio, but PyTorch maps positions back by 1/2.05
    ("nearest_fraction", lambda: Fn(lambda x: F.interpolate(x, scale_factor=1.5)), X, "bvlc"),
    ("dropout", lambda: seq(nn.Dropout(0.5), nn.Dropout2d(0.3), nn.ReLU()), X, "bvlc"),
    ("resnet_block", lambda: seq(nn.Conv2d(4, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.MaxPool2d(3, 2, 1), Block(8), Block(8)), (1, 4, 17, 17), "bvlc"),
    ("mobilenet_block", lambda: seq(nn.Conv2d(4, 16, 1), nn.BatchNorm2d(16), nn.ReLU6(),
                                    nn.Conv2d(16, 16, 3, 2, 1, groups=16), nn.BatchNorm2d(16), nn.Hardswish(),
                                    SE(16), nn.Conv2d(16, 4, 1)), X, "bvlc"),
]


@pytest.mark.parametrize("name,factory,shape,dialect", ROWS, ids=[r[0] for r in ROWS])
def test_op_rows(tmp_path, name, factory, shape, dialect):
    torch.manual_seed(1)
    m = _prime(factory())
    x = torch.randn(shape)
    res = from_torch(m, (x,), tmp_path / name, dialect=dialect, compare="layers")
    assert res.passed and res.worst < 1e-5, str(res)
    assert res.intermediates


def test_fold_bn(tmp_path):
    m = _prime(seq(nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6), nn.ReLU()))
    res = from_torch(m, torch.randn(X), tmp_path / "f", fold_bn=True)
    text = open(res.prototxt).read()
    assert "BatchNorm" not in text and "Scale" not in text and res.worst < 1e-5


POOLS = [  # (H, kernel, stride, pad, ceil_mode, max): PyTorch floors, Caffe ceils
    (9, 2, 2, 0, False, True), (10, 3, 2, 0, False, True), (112, 3, 2, 1, False, True),
    (7, 3, 2, 1, True, True), (8, 3, 3, 1, True, True), (13, 3, 2, 0, True, True),
    (9, 2, 2, 0, False, False), (10, 3, 2, 1, False, False), (7, 3, 2, 1, True, False), (11, 4, 3, 2, True, False),
]


@pytest.mark.parametrize("h,k,s,p,ceil,is_max", POOLS)
def test_pool_rounding(tmp_path, h, k, s, p, ceil, is_max):
    cls = nn.MaxPool2d if is_max else nn.AvgPool2d
    m = cls(k, s, p, ceil_mode=ceil)
    x = torch.randn(1, 2, h, h + 1)
    res = from_torch(m, (x,), tmp_path / "p", compare="layers")
    want = m(x).shape
    caffe = -(-(h + 2 * p - k) // s) + 1
    if p and (caffe - 1) * s >= h + p:
        caffe -= 1
    text = open(res.prototxt).read()
    assert ('type: "Slice"' in text) == (caffe != want[2] or want[3] != -(-(h + 1 + 2 * p - k) // s) + 1
                                         - int(bool(p) and (-(-(h + 1 + 2 * p - k) // s)) * s >= h + 1 + p))
    assert res.worst < 1e-6


def test_unsupported_is_one_line_naming_op_line_and_dialects(tmp_path):
    m = Fn(lambda x: x.permute(0, 2, 3, 1))
    with pytest.raises(ConversionError) as e:
        from_torch(m, torch.randn(X), tmp_path / "u")
    msg = str(e.value)
    assert "\n" not in msg and "permute" in msg and "test_convert.py:" in msg and "ssd/forks" in msg
    assert not (tmp_path / "u.prototxt").exists()
    with pytest.raises(ConversionError, match=r"gelu.*no dialect writes it"):
        from_torch(Fn(lambda x: F.gelu(x)), torch.randn(X), tmp_path / "g", dialect="forks")


def test_check_lists_ops_counts_and_lines(tmp_path, monkeypatch, capsys):
    (tmp_path / "netdef.py").write_text(
        "import torch.nn as nn, torch.nn.functional as F\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.c = nn.Conv2d(3, 4, 3)\n"
        "    def forward(self, x):\n"
        "        y = F.gelu(self.c(x))\n"
        "        return F.gelu(y).permute(0, 2, 3, 1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = check_torch(sys.modules.get("netdef") or __import__("netdef").Net(), torch.randn(1, 3, 8, 8))
    assert [(r[0], r[1]) for r in rows] == [("aten.gelu.default", 2), ("aten.permute.default", 1)]
    from brewnet.cli import main

    rc = main(["import", "--torch", "netdef:Net", "--input-shape", "1,3,8,8", "--out", "o", "--check"])
    out = capsys.readouterr().out
    assert rc == 1 and "aten.gelu.default x2" in out and "netdef.py:7" in out and "netdef.py:8" in out
    assert "--dialect ssd/forks can" in out and not list(tmp_path.glob("o.*"))
    rc = main(["import", "--torch", "netdef:Net", "--input-shape", "1,3,8,8", "--check", "--dialect", "forks"])
    assert rc == 1 and "aten.permute" not in capsys.readouterr().out


def test_bvlc_schema_reads_the_files(tmp_path):
    """The written caffemodel and prototxt parse in a schema of BVLC Caffe 1.0's fields (compiled
    by protoc) with no unknown field; the forks dialect's ReLU6 would not be BVLC."""
    from google.protobuf import text_format
    from google.protobuf.unknown_fields import UnknownFieldSet

    from brewnet.convert.dialects import bvlc_proto
    from brewnet.proto import schema

    proto = tmp_path / "bvlc.proto"
    proto.write_text(bvlc_proto())
    pytest.importorskip("grpc_tools")
    sch = schema.Schema(proto)
    from brewnet.proto import caffe_pb2

    Net = sch.fork_class(caffe_pb2.NetParameter())
    m = _prime(seq(nn.Conv2d(3, 4, 3, 2), nn.BatchNorm2d(4), nn.ReLU6(), nn.MaxPool2d(2), SE(4),
                   nn.Upsample(scale_factor=2, mode="bilinear"), nn.Flatten(), nn.Linear(4 * 144, 3),
                   nn.Softmax(1)))
    res = from_torch(m, torch.randn(1, 3, 27, 27), tmp_path / "n")

    def unknown(msg):
        n = len(UnknownFieldSet(msg))
        for fd, v in msg.ListFields():
            if fd.message_type is not None:
                n += sum(unknown(x) for x in (v if fd.is_repeated else [v]))
        return n

    net = Net()
    net.ParseFromString(open(res.caffemodel, "rb").read())
    assert len(net.layer) == res.layers and unknown(net) == 0
    assert any(len(lp.blobs) for lp in net.layer)
    text_format.Parse(open(res.prototxt).read(), Net())       # unknown names would raise
    forks = from_torch(m, torch.randn(1, 3, 27, 27), tmp_path / "f", dialect="forks")
    with pytest.raises(text_format.ParseError):
        text_format.Parse(open(forks.prototxt).read(), Net())


def test_onnx_path_and_cli(tmp_path, capsys):
    from brewnet.cli import main

    m = _prime(seq(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU6(), nn.MaxPool2d(3, 2),
                   Shuffle(8), SE(8), nn.Upsample(scale_factor=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                   nn.Linear(8, 5), nn.Softmax(1)))
    x = torch.randn(1, 3, 20, 20)
    torch.onnx.export(m, (x,), tmp_path / "m.onnx", dynamo=True, verbose=False)
    res = from_onnx(tmp_path / "m.onnx", tmp_path / "a", example_inputs=[x.numpy()], compare="layers")
    assert res.worst < 1e-5
    with torch.no_grad():
        want = m(x).numpy()
    from brewnet.net import Net

    net = Net(res.prototxt, weights=res.caffemodel)
    net.blobs["data"].tensor.copy_(x)
    net.forward_tensors()
    got = net.blobs[net.outputs[0]].tensor.numpy()
    assert np.abs(got - want).max() < 1e-5
    rc = main(["import", str(tmp_path / "m.onnx"), "--out", str(tmp_path / "b")])
    assert rc == 0 and "output" in capsys.readouterr().out


def test_round_trip_caffe_to_torch_to_caffe(tmp_path):
    from brewnet import to_torch
    from brewnet.net import Net

    proto = tmp_path / "orig.prototxt"
    proto.write_text("""name: "rt"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 15 dim: 15 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 6 kernel_size: 3 stride: 2 weight_filler { type: "gaussian" std: 0.3 }
  bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
""")
    torch.manual_seed(3)
    net = Net(str(proto))
    x = torch.randn(1, 3, 15, 15)
    net.blobs["data"].tensor.copy_(x)
    net.forward_tensors()
    want = net.blobs["prob"].tensor.numpy().copy()
    res = from_torch(to_torch(net), (x,), tmp_path / "back")
    back = Net(res.prototxt, weights=res.caffemodel)
    back.blobs["data"].tensor.copy_(x)
    back.forward_tensors()
    assert np.abs(back.blobs[back.outputs[0]].tensor.numpy() - want).max() < 1e-6
    assert 'ceil' not in open(res.prototxt).read() or 'Slice' in open(res.prototxt).read()


def _opencv_rel(res, x, want: list) -> list:
    cv2 = pytest.importorskip("cv2")
    net = cv2.dnn.readNetFromCaffe(res.prototxt, res.caffemodel)
    net.setInput(x.numpy())
    got = net.forward([row[0] for row in res.outputs])
    return [float(np.abs(g.reshape(t.shape) - t.numpy()).max() / np.abs(t.numpy()).max())
            for g, t in zip(got, want)]


class FCN(nn.Module):
    """An FCN-8s-like decoder: a stride-8 backbone, 1x1 classifiers on two scales, the coarse
    scores upsampled by 2 (bilinear) and added to the stride-4 skip, then resized to the input's
    size (not an integer multiple here) as torchvision's segmentation heads do."""

    def __init__(self, classes=5):
        super().__init__()
        self.s4 = seq(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 12, 3, 2, 1),
                      nn.BatchNorm2d(12), nn.ReLU())
        self.s8 = seq(nn.Conv2d(12, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.score8, self.score4 = nn.Conv2d(16, classes, 1), nn.Conv2d(12, classes, 1)

    def forward(self, x):
        f4 = self.s4(x)
        y = F.interpolate(self.score8(self.s8(f4)), scale_factor=2, mode="bilinear", align_corners=False)
        y = y + self.score4(f4)
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


@pytest.mark.parametrize("size", [32, 38])
def test_fcn_decoder_bvlc_matches_in_brewnet_and_opencv(tmp_path, size):
    """32: x8 overall (Deconvolution by 2, then by 4); 38: 19 -> 38 after 5 -> 10 (not integer
    scales: the InnerProduct/Convolution pair of fixed resize matrices)."""
    m = _prime(FCN())
    torch.manual_seed(4)
    x = torch.randn(1, 3, size, size)
    res = from_torch(m, (x,), tmp_path / "fcn", compare="layers")
    text = open(res.prototxt).read()
    assert "Interp" not in text and ('type: "Deconvolution"' in text)
    assert ('type: "InnerProduct"' in text) == (size == 38)
    assert res.worst < 1e-5, str(res)
    with torch.no_grad():
        want = m(x)
    assert _opencv_rel(res, x, [want])[0] < 1e-5


class SSDHead(nn.Module):
    """An SSD head: loc and conf 3x3 convolutions over two feature maps, permute(0, 2, 3, 1),
    flatten (loc) and view to (N, -1, classes) (conf), concatenated over the maps."""

    def __init__(self, classes=3, anchors=(4, 6)):
        super().__init__()
        self.f1 = seq(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.f2 = seq(nn.Conv2d(8, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.loc = nn.ModuleList([nn.Conv2d(8, a * 4, 3, padding=1) for a in anchors])
        self.conf = nn.ModuleList([nn.Conv2d(8, a * classes, 3, padding=1) for a in anchors])
        self.classes = classes

    def forward(self, x):
        f1 = self.f1(x)
        locs, confs = [], []
        for f, loc, conf in zip((f1, self.f2(f1)), self.loc, self.conf):
            locs.append(loc(f).permute(0, 2, 3, 1).flatten(1))
            confs.append(conf(f).permute(0, 2, 3, 1).reshape(x.shape[0], -1, self.classes))
        return torch.cat(locs, 1), torch.cat(confs, 1).softmax(-1)


def test_ssd_head_in_ssd_dialect(tmp_path):
    m = _prime(SSDHead())
    torch.manual_seed(5)
    x = torch.randn(2, 3, 16, 16)
    res = from_torch(m, (x,), tmp_path / "ssd", dialect="ssd", compare="layers")
    text = open(res.prototxt).read()
    assert all(f'type: "{t}"' in text for t in ("Permute", "Flatten", "Concat", "Reshape"))
    assert res.worst < 1e-5 and len(res.outputs) == 2
    with torch.no_grad():
        want = m(x)
    assert max(_opencv_rel(res, x, list(want))) < 1e-5
    with pytest.raises(ConversionError, match="permute.*--dialect ssd"):
        from_torch(m, (x,), tmp_path / "bvlc")


def test_batch_override(tmp_path, capsys):
    from brewnet.cli import main
    from brewnet.net import Net

    m = _prime(seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5)))
    res = from_torch(m, torch.randn(1, 3, 8, 8), tmp_path / "b3", batch=3)
    net = Net(res.prototxt)
    assert tuple(net.blobs["data"].shape) == (3, 3, 8, 8) and res.worst < 1e-5
    x = torch.randn(1, 3, 8, 8)
    torch.onnx.export(m, (x,), tmp_path / "m.onnx", dynamo=True, verbose=False,
                      dynamic_shapes=({0: torch.export.Dim("n")},))
    rc = main(["import", str(tmp_path / "m.onnx"), "--out", str(tmp_path / "o"), "--batch", "4"])
    assert rc == 0 and tuple(Net(str(tmp_path / "o.prototxt")).blobs["data"].shape) == (4, 3, 8, 8)
    capsys.readouterr()


def test_conv_on_a_1x1_map_keeps_the_taps_that_read_it(tmp_path):
    """SSDLite's last maps are 1x1: a padded 3x3 (depthwise) convolution there reads the input at
    its centre tap only; written as that 1x1 kernel (OpenCV's depthwise 3x3 on a 1x1 map is wrong)."""
    m = seq(nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Conv2d(4, 6, 5, padding=4, dilation=2))
    x = torch.randn(1, 4, 1, 1)
    res = from_torch(m, (x,), tmp_path / "c")
    assert "kernel_size: 3" not in open(res.prototxt).read() and res.worst < 1e-6
    with torch.no_grad():
        want = m(x)
    assert _opencv_rel(res, x, [want])[0] < 1e-6


def test_import_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    """A missing or corrupt ONNX file, an unimportable factory or one that is no Module: one
    line naming it, exit 1, no files."""
    from brewnet.cli import main

    (tmp_path / "bad.onnx").write_text("garbage")
    cases = [([str(tmp_path / "missing.onnx")], "missing.onnx: not an ONNX model"),
             ([str(tmp_path / "bad.onnx")], "bad.onnx: not an ONNX model"),
             (["--torch", "no_such_module_here:f", "--input-shape", "1,3,8,8"], "No module named"),
             (["--torch", "os:getcwd", "--input-shape", "1,3,8,8"], "not a torch.nn.Module")]
    for args, why in cases:
        assert main(["import", *args, "--out", str(tmp_path / "out" / "m")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("brewnet import: ") and why in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
