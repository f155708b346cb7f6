"""More forks' layers against loops written from each fork's own source (the commits below):

- AutoCrop: yun-liu/RCF fc9e0f9f61751e0b2d6d27c4e916a183502fab34, src/caffe/layers/
  auto_crop_layer.cpp and include/caffe/util/coords.hpp (longjon's coordinate maps, BVLC PR
  1639; the V1 CROP of HyeonwooNoh/caffe is the same code).
- BN, Unpooling, V1 BN/UNPOOLING/CROP: HyeonwooNoh/caffe d9e8494a2832d67b25dee37194c7bcb9d52d0e42,
  src/caffe/layers/bn_layer.cpp, unpooling_layer.cpp, src/caffe/proto/caffe.proto (V1 enum CROP
  40, UNPOOLING 42, BN 43; fields unpooling_param 44, bn_param 45).
- Flip, Normalize (normalize_param): happynear/caffe-windows 967eedf25009e334b7f6f933bb5e17aaaff5bef6
  (branch ms), src/caffe/layers/flip_layer.cpp, normalize_layer.cpp, caffe.proto (flip_param 212,
  normalize_param 214).
- ContinuationIndicator: xmfbit/warpctc-caffe 3e47d1f59d6adefb6666a0a1e8bf2777b49839ec,
  src/caffe/layers/continuation_indicator_layer.cpp, caffe.proto (continuation_indicator_param 201).

The real nets: the AMSoftmax face deploy net and the warp-ctc captcha deploy net are vendored
(tests/data/forks/PROVENANCE.md). RCF's and DeconvNet's are not (RCF: CC BY-NC-SA 4.0;
DeconvNet: redistribution needs a licence from POSTECH): the tests write nets of their topology
(RCF's test_vgg16.prototxt at 9ef093531acf94b0100ed1c88732458b20d27e28; DeconvNet's
model/DeconvNet/DeconvNet_inference_deploy.prototxt at 8c37ba3ec56d54069a6de94d523879041bccd09e)
with few channels. OpenCV's dnn has none of these types (nor reads V1 BN/UNPOOLING/CROP, nor
happynear's normalize_param), so no OpenCV comparison is made here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import brewnet as caffe
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.upgrade import upgrade_net
from tests.helpers import gradcheck_layer, make_layer

FORKS = Path(__file__).resolve().parent / "data" / "forks"
F32 = np.float32


def _net(text, phase=caffe.TEST):
    return caffe.Net(text_format.Parse(text, pb.NetParameter()), phase)


def _feed(net, seed=0):
    rng = np.random.default_rng(seed)
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = rng.standard_normal(blob.data.shape).astype(F32)


# ------------------------------------------------------------------------------------ AutoCrop

def rcf_vgg16(c=2, side=64):
    """RCF's test_vgg16.prototxt topology (VGG16 trunk, pool4 stride 1, dilated conv5, side
    outputs, deconvs k4s2 / k8s4 / k16s8 / k16s8 and AutoCrop to data), c channels."""
    L = [f'input: "data" input_shape {{ dim: 1 dim: 3 dim: {side} dim: {side} }}']

    def conv(name, bottom, k=3, pad=1, dil=1, n=c):
        d = f" dilation: {dil}" if dil > 1 else ""
        L.append(f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
                 f'convolution_param {{ num_output: {n} pad: {pad} kernel_size: {k}{d} }} }}')
        L.append(f'layer {{ name: "relu{name}" type: "ReLU" bottom: "{name}" top: "{name}" }}')

    def pool(name, bottom, stride=2):
        L.append(f'layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}" '
                 f'pooling_param {{ pool: MAX kernel_size: 2 stride: {stride} }} }}')

    blocks = [(1, 2), (2, 2), (3, 3), (4, 3), (5, 3)]
    bottom = "data"
    for b, n in blocks:
        for i in range(1, n + 1):
            conv(f"conv{b}_{i}", bottom, pad=2 if b == 5 else 1, dil=2 if b == 5 else 1)
            bottom = f"conv{b}_{i}"
        if b < 5:
            pool(f"pool{b}", bottom, stride=1 if b == 4 else 2)
            bottom = f"pool{b}"
    ups = {2: (4, 2), 3: (8, 4), 4: (16, 8), 5: (16, 8)}
    for b, n in blocks:
        downs = [f"conv{b}_{i}_down" for i in range(1, n + 1)]
        for i, d in enumerate(downs, 1):
            L.append(f'layer {{ name: "{d}" type: "Convolution" bottom: "conv{b}_{i}" top: "{d}" '
                     f'convolution_param {{ num_output: 3 kernel_size: 1 }} }}')
        bottoms = " ".join(f'bottom: "{d}"' for d in downs)
        L.append(f'layer {{ name: "fuse{b}" type: "Eltwise" {bottoms} top: "fuse{b}" }}')
        L.append(f'layer {{ name: "dsn{b}" type: "Convolution" bottom: "fuse{b}" top: "dsn{b}" '
                 'convolution_param { num_output: 1 kernel_size: 1 } }')
        if b == 1:
            continue
        k, s = ups[b]
        L.append(f'layer {{ name: "up{b}" type: "Deconvolution" bottom: "dsn{b}" top: "up{b}" '
                 f'convolution_param {{ kernel_size: {k} stride: {s} num_output: 1 }} }}')
        L.append(f'layer {{ name: "crop{b}" type: "AutoCrop" bottom: "up{b}" bottom: "data" '
                 f'top: "upscore{b}" }}')
    return "\n".join(L)


def autocrop_ref(x, crop, hw):
    """auto_crop_layer.cpp's Forward_cpu: per (n, c, h) a row of width W1 from (crop_h + h, crop_w)."""
    n, c = x.shape[:2]
    out = np.zeros((n, c) + hw, x.dtype)
    for i in range(n):
        for j in range(c):
            for h in range(hw[0]):
                out[i, j, h] = x[i, j, crop[0] + h, crop[1]:crop[1] + hw[1]]
    return out


def test_autocrop_finds_rcfs_offsets_and_crops_as_the_fork():
    # By coords.hpp: pool k2 s2 maps x -> x/2 - 1/4, deconv k4 s2 x -> 2x + 3/2; data -> up2 is
    # x + 1 (crop 1); up3 (k8 s4 after two pools): x + 2; up4 (k16 s8 after three): x + 4; up5
    # (pool4 k2 s1: x - 1/2, dilated conv5 extent 5 pad 2: identity): x + 0.
    net = _net(rcf_vgg16())
    crops = {l.name: l.crop for l in net.layer_list if l.type == "AutoCrop"}
    assert crops == {"crop2": (1, 1), "crop3": (2, 2), "crop4": (4, 4), "crop5": (0, 0)}
    _feed(net)
    net.forward()
    for b in (2, 3, 4, 5):
        up = net.blobs[f"up{b}"].data
        np.testing.assert_array_equal(net.blobs[f"upscore{b}"].data,
                                      autocrop_ref(up, crops[f"crop{b}"], (64, 64)))


def fcn8s_v1(c=2, side=40):
    """FCN-8s (VGG16, conv1_1 pad 100, fc6 7x7) as a V1 net with longjon's CROP, c channels."""
    L = [f'input: "data" input_dim: 1 input_dim: 3 input_dim: {side} input_dim: {side}']

    def lay(name, typ, bottoms, param=""):
        bs = " ".join(f'bottom: "{b}"' for b in bottoms)
        L.append(f'layers {{ name: "{name}" type: {typ} {bs} top: "{name}" {param} }}')

    bottom = "data"
    for b, n in [(1, 2), (2, 2), (3, 3), (4, 3), (5, 3)]:
        for i in range(1, n + 1):
            pad = 100 if (b, i) == (1, 1) else 1
            lay(f"conv{b}_{i}", "CONVOLUTION", [bottom],
                f"convolution_param {{ num_output: {c} pad: {pad} kernel_size: 3 }}")
            bottom = f"conv{b}_{i}"
        lay(f"pool{b}", "POOLING", [bottom], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
        bottom = f"pool{b}"
    lay("fc6", "CONVOLUTION", ["pool5"], f"convolution_param {{ num_output: {c} kernel_size: 7 }}")
    lay("fc7", "CONVOLUTION", ["fc6"], f"convolution_param {{ num_output: {c} kernel_size: 1 }}")
    lay("score59", "CONVOLUTION", ["fc7"], "convolution_param { num_output: 3 kernel_size: 1 }")
    lay("upscore2", "DECONVOLUTION", ["score59"],
        "convolution_param { num_output: 3 kernel_size: 4 stride: 2 bias_term: false }")
    lay("score-pool4", "CONVOLUTION", ["pool4"], "convolution_param { num_output: 3 kernel_size: 1 }")
    lay("score-pool4c", "CROP", ["score-pool4", "upscore2"])
    lay("fuse-pool4", "ELTWISE", ["upscore2", "score-pool4c"])
    lay("upscore4", "DECONVOLUTION", ["fuse-pool4"],
        "convolution_param { num_output: 3 kernel_size: 4 stride: 2 bias_term: false }")
    lay("score-pool3", "CONVOLUTION", ["pool3"], "convolution_param { num_output: 3 kernel_size: 1 }")
    lay("score-pool3c", "CROP", ["score-pool3", "upscore4"])
    lay("fuse-pool3", "ELTWISE", ["upscore4", "score-pool3c"])
    lay("upscore8", "DECONVOLUTION", ["fuse-pool3"],
        "convolution_param { num_output: 3 kernel_size: 16 stride: 8 bias_term: false }")
    lay("score", "CROP", ["upscore8", "data"])
    return "\n".join(L)


def test_v1_crop_is_the_coordinate_map_crop_with_fcn8s_offsets():
    # The offsets BVLC's FCN-8s (fcn.berkeleyvision.org voc-fcn8s) writes into its Crop layers,
    # found here from the V1 net alone: score_pool4c 5, score_pool3c 9, score 31.
    param = upgrade_net(text_format.Parse(fcn8s_v1(), pb.NetParameter()))
    types = {l.name: l.type for l in param.layer}
    assert [types[n] for n in ("score-pool4c", "score-pool3c", "score")] == ["AutoCrop"] * 3
    net = caffe.Net(param, caffe.TEST)
    assert {l.name: l.crop for l in net.layer_list if l.type == "AutoCrop"} == {
        "score-pool4c": (5, 5), "score-pool3c": (9, 9), "score": (31, 31)}
    _feed(net)
    net.forward()
    assert net.blobs["score"].data.shape == (1, 3, 40, 40)
    np.testing.assert_array_equal(net.blobs["score"].data,
                                  autocrop_ref(net.blobs["upscore8"].data, (31, 31), (40, 40)))


CONV = 'layer { name: "v" type: "Convolution" bottom: "data" top: "v" convolution_param { num_output: 1 '
AUTOCROP_BAD = [
    # (layers after the input, what the error says)
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }'
     'layer { name: "c" type: "AutoCrop" bottom: "data" bottom: "p" top: "c" }', "scale mismatch"),
    (CONV + 'kernel_size: 3 } }'
     'layer { name: "c" type: "AutoCrop" bottom: "v" bottom: "data" top: "c" }', "negative crop"),
    ('input: "aux" input_shape { dim: 1 dim: 1 dim: 4 dim: 4 }'
     'layer { name: "c" type: "AutoCrop" bottom: "data" bottom: "aux" top: "c" }', "disconnected"),
    (CONV + 'kernel_size: 2 } }'
     'layer { name: "c" type: "AutoCrop" bottom: "data" bottom: "v" top: "c" }', "not an integer"),
]


@pytest.mark.parametrize("layers,msg", AUTOCROP_BAD)
def test_autocrop_refuses_what_the_fork_checks(layers, msg):
    with pytest.raises(LayerError, match=msg):
        _net('input: "data" input_shape { dim: 1 dim: 1 dim: 8 dim: 8 }' + layers)


def test_autocrop_gradient_goes_to_bottom_0_inside_the_crop():
    net = _net('input: "data" input_shape { dim: 1 dim: 2 dim: 6 dim: 6 }'
               'layer { name: "v" type: "Convolution" bottom: "data" top: "v" '
               'convolution_param { num_output: 2 kernel_size: 3 pad: 2 } }'
               'layer { name: "c" type: "AutoCrop" bottom: "v" bottom: "data" top: "c" }')
    layer = net.layer_by_name["c"]
    assert layer.crop == (1, 1)       # conv k3 pad 2: x -> x + 1
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    assert gradcheck_layer(layer, [x, torch.zeros(1, 2, 6, 6)])


# -------------------------------------------------------------------------------- DeconvNet

def deconvnet_v1(c=2):
    """DeconvNet_inference_deploy.prototxt's pattern at 32 x 32: conv-BN(INFERENCE)-ReLU, pooling
    with mask tops, UNPOOLING with unpool_size, deconv-BN-ReLU, with c channels."""
    bn = ("bn_param { scale_filler { type: 'constant' value: 1 } "
          "shift_filler { type: 'constant' value: 0.001 } bn_mode: INFERENCE }")
    return f"""
input: "data" input_dim: 1 input_dim: 3 input_dim: 32 input_dim: 32
layers {{ bottom: "data" top: "conv1" name: "conv1" type: CONVOLUTION
  blobs_lr: 1 blobs_lr: 2 convolution_param {{ num_output: {c} pad: 1 kernel_size: 3 }} }}
layers {{ bottom: 'conv1' top: 'conv1' name: 'bn1' type: BN {bn} }}
layers {{ bottom: "conv1" top: "conv1" name: "relu1" type: RELU }}
layers {{ bottom: "conv1" top: "pool1" top: "pool1_mask" name: "pool1" type: POOLING
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layers {{ bottom: "pool1" top: "conv2" name: "conv2" type: CONVOLUTION
  convolution_param {{ num_output: {c} pad: 1 kernel_size: 3 }} }}
layers {{ bottom: 'conv2' top: 'conv2' name: 'bn2' type: BN {bn} }}
layers {{ bottom: "conv2" top: "pool2" top: "pool2_mask" name: "pool2" type: POOLING
  pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layers {{ bottom: 'pool2' top: 'fc6' name: 'fc6' type: CONVOLUTION
  convolution_param {{ num_output: {c} kernel_size: 8 }} }}
layers {{ bottom: 'fc6' top: 'fc6-deconv' name: 'fc6-deconv' type: DECONVOLUTION
  convolution_param {{ num_output: {c} kernel_size: 8 }} }}
layers {{ bottom: 'fc6-deconv' top: 'fc6-deconv' name: 'fc6-deconv-bn' type: BN {bn} }}
layers {{ type: UNPOOLING bottom: "fc6-deconv" bottom: "pool2_mask" top: "unpool2" name: "unpool2"
  unpooling_param {{ unpool: MAX kernel_size: 2 stride: 2 unpool_size: 16 }} }}
layers {{ bottom: 'unpool2' top: 'deconv2' name: 'deconv2' type: DECONVOLUTION
  convolution_param {{ num_output: {c} pad: 1 kernel_size: 3 }} }}
layers {{ bottom: 'deconv2' top: 'deconv2' name: 'debn2' type: BN {bn} }}
layers {{ type: UNPOOLING bottom: "deconv2" bottom: "pool1_mask" top: "unpool1" name: "unpool1"
  unpooling_param {{ unpool: MAX kernel_size: 2 stride: 2 unpool_size: 32 }} }}
layers {{ name: 'seg-score' type: CONVOLUTION bottom: 'unpool1' top: 'seg-score'
  convolution_param {{ num_output: 21 kernel_size: 1 }} }}
"""


def test_deconvnet_v1_net_upgrades_builds_and_runs():
    param = upgrade_net(text_format.Parse(deconvnet_v1(), pb.NetParameter()))
    types = {l.name: l.type for l in param.layer}
    assert types["bn1"] == "BN" and types["unpool1"] == "Unpooling"
    assert param.layer[2].bn_param.bn_mode == pb.BNParameter.INFERENCE
    assert param.layer[2].bn_param.shift_filler.value == pytest.approx(0.001)
    unpool = next(l for l in param.layer if l.name == "unpool2")
    assert unpool.unpooling_param.unpool_size == 16 and unpool.unpooling_param.kernel_size == 2
    net = caffe.Net(param, caffe.TEST)
    assert [tuple(b.shape) for b in net.layer_by_name["bn1"].blobs] == [(1, 2, 1, 1)] * 2
    _feed(net)
    net.forward()
    assert net.blobs["seg-score"].data.shape == (1, 21, 32, 32)
    # INFERENCE: scale * x + shift, the blobs as the fillers made them (1 and 0.001)
    conv1 = net.layer_by_name["conv1"]
    x = torch.from_numpy(net.blobs["data"].data)
    ref = torch.nn.functional.conv2d(x, conv1.blobs[0].detach(), conv1.blobs[1].detach(), padding=1)
    ref = torch.relu(ref * 1 + F32(0.001))
    pool, mask = torch.nn.functional.max_pool2d(ref, 2, 2, return_indices=True)
    np.testing.assert_allclose(net.blobs["pool1"].data, pool.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(net.blobs["pool1_mask"].data, mask.numpy().astype(F32))
    # the last unpooling puts deconv2's values where pool1's maxima were
    d = net.blobs["deconv2"].data
    u = net.blobs["unpool1"].data
    np.testing.assert_array_equal(u, unpool_ref(d, net.blobs["pool1_mask"].data, (32, 32), "MAX"))


def _varint(n):
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number, wire, payload):
    tag = _varint(number << 3 | wire)
    return tag + (_varint(len(payload)) + payload if wire == 2 else payload)


def test_deconvnet_binary_v1_bn_reads_its_own_field_numbers():
    # A V1 layer as DeconvNet's caffe writes it: bn_param at 45 holding scale_filler (1),
    # shift_filler (2) and bn_mode (3) = INFERENCE; unpooling_param at 44.
    filler = pb.FillerParameter(type="constant", value=2).SerializeToString()
    bn = _field(1, 2, filler) + _field(3, 0, _varint(1))
    v1 = pb.V1LayerParameter(name="bn", type=pb.V1LayerParameter.BN, bottom=["x"], top=["x"])
    up = pb.V1LayerParameter(name="up", type=pb.V1LayerParameter.UNPOOLING, bottom=["x"], top=["u"])
    unpool = _field(2, 0, _varint(2)) + _field(3, 0, _varint(2)) + _field(12, 0, _varint(8))
    net_bytes = (_field(2, 2, v1.SerializeToString() + _field(45, 2, bn))
                 + _field(2, 2, up.SerializeToString() + _field(44, 2, unpool)))
    param = upgrade_net(pb.NetParameter.FromString(net_bytes))
    p = param.layer[0].bn_param
    assert param.layer[0].type == "BN" and p.bn_mode == pb.BNParameter.INFERENCE
    assert p.scale_filler.value == 2 and not p.HasField("slope_filler")
    assert param.layer[1].type == "Unpooling" and param.layer[1].unpooling_param.unpool_size == 8
    # a V1 BN without bn_param is DeconvNet's LEARN BN (two blobs), not PSPNet's
    bare = upgrade_net(text_format.Parse('layers { name: "b" type: BN bottom: "x" top: "y" }',
                                         pb.NetParameter()))
    assert bare.layer[0].bn_param.bn_mode == pb.BNParameter.LEARN
    layer, _ = make_layer(text_format.MessageToString(bare.layer[0]), [(2, 3, 4, 4)])
    assert len(layer.blobs) == 2


def deconvnet_bn_learn_ref(x, scale, shift):
    """bn_layer.cpp LEARN in float64: E[x] and E[x^2] over (N, H, W), var = E[x^2] - E[x]^2,
    y = (x - mean) / sqrt(var + 1e-9) * scale + shift; tops 1, 2: mean and var (before eps)."""
    x = x.astype(np.float64)
    mean = x.mean((0, 2, 3), keepdims=True)
    var = (x ** 2).mean((0, 2, 3), keepdims=True) - mean ** 2
    return (x - mean) / np.sqrt(var + 1e-9) * scale + shift, mean, var


def test_deconvnet_bn_learn_three_tops_and_gradient():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 5)).astype(F32) * 2 + 1
    layer, tops = make_layer('type: "BN" top: "y" top: "m" top: "v" bn_param { bn_mode: LEARN '
                             'scale_filler { type: "constant" value: 1.5 } '
                             'shift_filler { type: "constant" value: -0.5 } }', [x.shape])
    assert tops == [(2, 3, 4, 5), (1, 3, 1, 1), (1, 3, 1, 1)]
    y, m, v = layer.forward([torch.from_numpy(x)])
    ry, rm, rv = deconvnet_bn_learn_ref(x, 1.5, -0.5)
    np.testing.assert_allclose(y.detach().numpy(), ry, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(m.numpy(), rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v.numpy(), rv, rtol=1e-4, atol=1e-5)   # E[x^2] - E[x]^2 in float32
    assert not m.requires_grad and not v.requires_grad
    assert gradcheck_layer(layer, [torch.from_numpy(x)])
    with pytest.raises(LayerError, match="one top"):
        make_layer('type: "BN" top: "y" top: "m" bn_param { bn_mode: INFERENCE }', [x.shape])


def unpool_ref(x, mask, size, method, kernel=2, stride=2):
    """unpooling_layer.cpp Forward_cpu (pad 0), float32."""
    n, c, h, w = x.shape
    hu, wu = size
    out = np.zeros((n, c, hu * wu), F32)
    for i in range(n):
        for j in range(c):
            for ph in range(h):
                for pw in range(w):
                    v = x[i, j, ph, pw]
                    if method == "MAX":
                        idx = (int(mask[i, j, ph, pw]) if mask is not None
                               else min(ph * stride, hu - 1) * wu + min(pw * stride, wu - 1))
                        out[i, j, idx] = v
                        continue
                    hs, ws = ph * stride, pw * stride
                    he, we = min(hs + kernel, hu), min(ws + kernel, wu)
                    size_ = (he - hs) * (we - ws)
                    for hh in range(hs, he):
                        for ww in range(ws, we):
                            out[i, j, hh * wu + ww] += v / F32(size_) if method == "AVE" else v
    return out.reshape(n, c, hu, wu)


def unpool_backward_ref(g, x_shape, mask, method, kernel=2, stride=2):
    """unpooling_layer.cpp Backward_cpu (pad 0): MAX gathers; AVE and TILE sum / window size."""
    n, c, h, w = x_shape
    hu, wu = g.shape[2:]
    out = np.zeros(x_shape, np.float64)
    gf = g.reshape(n, c, -1)
    for i in range(n):
        for j in range(c):
            for ph in range(h):
                for pw in range(w):
                    if method == "MAX":
                        idx = (int(mask[i, j, ph, pw]) if mask is not None
                               else min(ph * stride, hu - 1) * wu + min(pw * stride, wu - 1))
                        out[i, j, ph, pw] = gf[i, j, idx]
                        continue
                    hs, ws = ph * stride, pw * stride
                    he, we = min(hs + kernel, hu), min(ws + kernel, wu)
                    out[i, j, ph, pw] = g[i, j, hs:he, ws:we].sum() / ((he - hs) * (we - ws))
    return out


@pytest.mark.parametrize("method,kernel,stride,size", [
    ("MAX", 2, 2, (8, 6)), ("MAX", 3, 2, (5, 5)), ("AVE", 3, 2, (9, 7)), ("TILE", 3, 2, (9, 7)),
    ("AVE", 2, 2, (7, 7)), ("TILE", 2, 3, (11, 8)), ("AVE", 3, 3, (12, 9))])
def test_unpooling_without_mask_matches_the_fork(method, kernel, stride, size):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 2, 4, 3)).astype(F32)
    sz = (f"unpool_size: {size[0]}" if size[0] == size[1]
          else f"unpool_h: {size[0]} unpool_w: {size[1]}")
    layer, tops = make_layer(f'type: "Unpooling" top: "y" unpooling_param {{ unpool: {method} '
                             f'kernel_size: {kernel} stride: {stride} {sz} }}', [x.shape])
    hu, wu = size
    assert tops == [(2, 2, hu, wu)]
    xt = torch.from_numpy(x).requires_grad_(True)
    (y,) = layer.forward([xt])
    np.testing.assert_allclose(y.detach().numpy(), unpool_ref(x, None, (hu, wu), method, kernel, stride),
                               rtol=1e-6, atol=1e-6)
    g = rng.standard_normal(y.shape)
    y.backward(torch.from_numpy(g.astype(F32)))
    np.testing.assert_allclose(xt.grad.numpy(), unpool_backward_ref(g, x.shape, None, method, kernel, stride),
                               rtol=1e-5, atol=1e-5)
    if method == "AVE":      # the fork's AVE backward is the adjoint of its forward
        assert gradcheck_layer(layer, [torch.from_numpy(x)])


def test_unpooling_with_mask_last_write_wins_and_gathers_back():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]], requires_grad=True)
    mask = torch.tensor([[[[0.0, 5.0], [5.0, 15.0]]]])     # 5 twice: the later (3) stays
    layer, tops = make_layer('type: "Unpooling" top: "y" unpooling_param { unpool: MAX '
                             'kernel_size: 2 stride: 2 unpool_size: 4 }', [(1, 1, 2, 2)] * 2)
    (y,) = layer.forward([x, mask])
    ref = unpool_ref(x.detach().numpy(), mask.numpy(), (4, 4), "MAX")
    np.testing.assert_array_equal(y.detach().numpy(), ref)
    assert ref[0, 0, 1, 1] == 3
    g = torch.arange(16.0).reshape(1, 1, 4, 4)
    y.backward(g)
    np.testing.assert_array_equal(x.grad.numpy(),
                                  unpool_backward_ref(g.numpy(), (1, 1, 2, 2), mask.numpy(), "MAX"))
    with pytest.raises(LayerError, match="only MAX"):
        make_layer('type: "Unpooling" top: "y" unpooling_param { unpool: AVE kernel_size: 2 '
                   'stride: 2 unpool_size: 4 }', [(1, 1, 2, 2)] * 2)
    with pytest.raises(LayerError, match="zero padding"):
        make_layer('type: "Unpooling" top: "y" unpooling_param { kernel_size: 2 pad: 1 '
                   'unpool_size: 4 }', [(1, 1, 2, 2)])
    with pytest.raises(LayerError, match="requires one"):
        make_layer('type: "Unpooling" top: "y" unpooling_param { kernel_size: 2 }', [(1, 1, 2, 2)])


# ------------------------------------------------------------------------------ happynear

def flip_ref(x, fw, fh):
    """flip_layer.cpp Forward_cpu."""
    n, c, h, w = x.shape
    out = np.empty_like(x)
    for i in range(n):
        for j in range(c):
            for hh in range(h):
                for ww in range(w):
                    out[i, j, hh, ww] = x[i, j, h - 1 - hh if fh else hh, w - 1 - ww if fw else ww]
    return out


@pytest.mark.parametrize("param,fw,fh", [("", True, False), ("flip_height: true", True, True),
                                         ("flip_width: false flip_height: true", False, True)])
def test_flip_matches_the_fork(param, fw, fh):
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(F32)
    layer, tops = make_layer(f'type: "Flip" top: "y" flip_param {{ {param} }}', [x.shape])
    (y,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_array_equal(y.numpy(), flip_ref(x, fw, fh))
    assert gradcheck_layer(layer, [torch.from_numpy(x)])


def feature_normalize_ref(x, l1):
    """normalize_layer.cpp Forward_cpu in float32: norm over C per (n, s) + 1e-6 (then sqrt, L2)."""
    n, c = x.shape[:2]
    x4 = x.reshape(n, c, -1)
    y = np.empty_like(x4)
    norm = np.empty((n, 1, x4.shape[2]), F32)
    for i in range(n):
        for s in range(x4.shape[2]):
            acc = F32(0)
            for j in range(c):
                acc = F32(acc + (abs(x4[i, j, s]) if l1 else x4[i, j, s] * x4[i, j, s]))
            acc = F32(acc + F32(1e-6))
            norm[i, 0, s] = acc if l1 else np.sqrt(acc)
            y[i, :, s] = x4[i, :, s] / norm[i, 0, s]
    return y, norm


def feature_normalize_backward_ref(x, y, norm, gy, gnorm, l1, bp_norm):
    """normalize_layer.cpp Backward_cpu, float64."""
    s = np.sign(x) if l1 else y
    a = (y * gy).sum(1, keepdims=True)
    gx = (gy - s * a) / norm
    return gx + gnorm * s if bp_norm else gx


@pytest.mark.parametrize("ntype", ["L2", "L1"])
@pytest.mark.parametrize("bp_norm", [False, True])
def test_happynear_normalize_forward_backward_against_the_fork(ntype, bp_norm):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 2, 3)).astype(F32)
    layer, tops = make_layer(f'type: "Normalize" top: "y" top: "n" normalize_param {{ '
                             f'normalize_type: "{ntype}" bp_norm: {str(bp_norm).lower()} }}', [x.shape])
    assert tops == [(2, 5, 2, 3), (2, 1, 2, 3)] and layer.blobs == []
    xt = torch.from_numpy(x).double().requires_grad_(True)
    y, n = layer.forward([xt])
    ry, rn = feature_normalize_ref(x, ntype == "L1")
    np.testing.assert_allclose(y.detach().numpy(), ry.reshape(x.shape), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(n.detach().numpy(), rn.reshape(2, 1, 2, 3), rtol=1e-6)
    gy, gn = rng.standard_normal(y.shape), rng.standard_normal(n.shape)
    torch.autograd.backward([y, n], [torch.from_numpy(gy), torch.from_numpy(gn)])
    ref = feature_normalize_backward_ref(x.astype(np.float64), y.detach().numpy(), n.detach().numpy(),
                                         gy, gn, ntype == "L1", bp_norm)
    np.testing.assert_allclose(xt.grad.numpy(), ref, rtol=1e-10, atol=1e-12)
    if bp_norm:     # with the norm's gradient the fork's backward is the exact one
        assert gradcheck_layer(layer, [torch.from_numpy(x)])


def test_happynear_normalize_2d_bottom_gives_a_4d_top_and_ssd_stays_ssd():
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(F32)
    layer, tops = make_layer('type: "Normalize" top: "y" normalize_param { normalize_type: "L2" }',
                             [x.shape])
    assert tops == [(3, 8, 1, 1)]       # the fork's legacy Reshape(num, channels, height, width)
    (y,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_allclose(y.numpy()[:, :, 0, 0], feature_normalize_ref(x, False)[0][:, :, 0],
                               rtol=1e-6)
    ssd, tops = make_layer('type: "Normalize" top: "y" norm_param { across_spatial: false }', [(1, 4, 2, 2)])
    assert tops == [(1, 4, 2, 2)] and len(ssd.blobs) == 1
    with pytest.raises(LayerError, match="give one"):
        make_layer('type: "Normalize" top: "y" norm_param {} normalize_param {}', [(1, 4, 2, 2)])
    with pytest.raises(LayerError, match="L1"):
        make_layer('type: "Normalize" top: "y" normalize_param { normalize_type: "L3" }', [(1, 4)])


def test_amsoftmax_face_deploy_builds_and_runs():
    param = text_format.Parse((FORKS / "amsoftmax_face_deploy_mirror_normalize.prototxt").read_text(),
                              pb.NetParameter())
    param.input_dim[0] = 2        # the file's batch is 100
    net = caffe.Net(param, caffe.TEST)
    _feed(net)
    net.forward()
    data = net.blobs["data"].data
    np.testing.assert_array_equal(net.blobs["flip_data"].data, data[:, :, :, ::-1])
    np.testing.assert_array_equal(net.blobs["concat_data"].data[2:], data[:, :, :, ::-1])
    fc5 = net.blobs["fc5"].data
    feat = fc5[:2] + fc5[2:]
    ref = feat / np.sqrt((feat.astype(np.float64) ** 2).sum(1, keepdims=True) + 1e-6)
    assert net.blobs["norm1"].data.shape == (2, 512, 1, 1)
    np.testing.assert_allclose(net.blobs["norm1"].data[:, :, 0, 0], ref, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------- warp-ctc

def test_continuation_indicator_values_and_checks():
    layer, tops = make_layer('type: "ContinuationIndicator" top: "c" '
                             'continuation_indicator_param { time_step: 4 batch_size: 3 }', [])
    assert tops == [(4, 3)]
    (c,) = layer.forward([])
    ref = np.ones((4, 3), F32)
    ref[0] = 0                       # t == 0 ? 0 : 1
    np.testing.assert_array_equal(c.numpy(), ref)
    with pytest.raises(LayerError, match="batch size"):
        make_layer('type: "ContinuationIndicator" top: "c" continuation_indicator_param { time_step: 4 }', [])


def test_continuation_indicator_binary_field_201_is_read_by_type():
    # warp-ctc caffe writes continuation_indicator_param at 201, SSD's multibox_loss_param here
    wire = _field(1, 0, _varint(80)) + _field(2, 0, _varint(1))
    layer = pb.LayerParameter(name="indicator", type="ContinuationIndicator", top=["indicator"])
    net_bytes = _field(100, 2, layer.SerializeToString() + _field(201, 2, wire))
    from brewnet.proto.upgrade import upgrade_fork_fields
    param = pb.NetParameter.FromString(net_bytes)
    upgrade_fork_fields(param)
    p = param.layer[0].continuation_indicator_param
    assert (p.time_step, p.batch_size) == (80, 1)
    assert not param.layer[0].HasField("multibox_loss_param")


def test_warpctc_captcha_deploy_builds_and_runs():
    net = caffe.Net(str(FORKS / "warpctc_captcha_deploy.prototxt"), caffe.TEST)
    _feed(net)
    net.forward()
    ref = np.ones((80, 1), F32)
    ref[0] = 0
    np.testing.assert_array_equal(net.blobs["indicator"].data, ref)
    assert net.blobs["premuted_fc"].data.shape == (1, 80, 11)
