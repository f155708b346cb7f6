"""Issue 38: the optical-flow layers of PWC-Net's Caffe, against loops written from the forks'
CUDA kernels (both forks have no CPU code):

* Correlation: lmb-freiburg/flownet2 476d400834d96337165d8561a8ef469ecfea77cd,
  src/caffe/layers/correlation_layer.cu (CorrelateData, CorrelateDataSubtract,
  CorrelateDataBackward0/1) and correlation_layer.cpp (Reshape); its caffe.proto puts
  correlation_param at 150 (brewnet's upsample_param).
* Warp: NVlabs/PWC-Net 940521b648b91a053a9daceff2101806286668fe,
  Caffe/warping_code/warp_layer.cu (WarpForwardGPU, WarpBackwardGPU_dFlow, WarpBackwardGPU_dU).
* PWC-Net's own deploy (its timing prototxt, benchmarks/zoo/nets) builds and runs at 256 x 128.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import read_net
from tests.helpers import gradcheck_layer, make_layer

ROOT = Path(__file__).resolve().parents[1]
PWCNET = ROOT / "benchmarks" / "zoo" / "nets" / "pwcnet_1024x448.prototxt"
F32 = np.float32


# -- reference loops ---------------------------------------------------------------------------
def _geometry(shape, pad, k, md, s1, s2):
    n, c, h, w = shape
    kr = (k - 1) // 2
    border = md + kr
    tw = math.ceil((w + 2 * pad - 2 * border) / s1)
    th = math.ceil((h + 2 * pad - 2 * border) / s1)
    r = md // s2
    return n, c, h, w, kr, th, tw, r, 2 * r + 1


def _rearrange(x, pad):
    """blob_rearrange_kernel2: (N, C, H, W) -> zero-padded (N, H + 2 pad, W + 2 pad, C)."""
    n, c, h, w = x.shape
    out = np.zeros((n, h + 2 * pad, w + 2 * pad, c), np.float64)
    out[:, pad:pad + h, pad:pad + w] = x.transpose(0, 2, 3, 1)
    return out


def correlation_ref(a, b, pad, k, md, s1, s2, subtract=False):
    n, c, h, w, kr, th, tw, r, gw = _geometry(a.shape, pad, k, md, s1, s2)
    r1, r2 = _rearrange(a, pad), _rearrange(b, pad)
    top = np.zeros((n, gw * gw, th, tw))
    for item in range(n):
        for y in range(th):
            for x in range(tw):
                for tc in range(gw * gw):
                    s2o = (tc % gw - r) * s2
                    s2p = (tc // gw - r) * s2
                    total = 0.0
                    if not subtract:          # CorrelateData: (x1, y1) the patch's corner
                        x1, y1 = x * s1 + md, y * s1 + md
                        for j in range(k):
                            for i in range(k):
                                total += (r1[item, y1 + j, x1 + i] * r2[item, y1 + j + s2p, x1 + i + s2o]).sum()
                    else:                     # CorrelateDataSubtract: (x1, y1) the centre
                        x1, y1 = x * s1 + kr + md, y * s1 + kr + md
                        for j in range(-kr, kr + 1):
                            for i in range(-kr, kr + 1):
                                total += np.abs(r1[item, y1 + j, x1 + i] - r2[item, y1 + s2p + j, x1 + s2o + i]).sum()
                    top[item, tc, y, x] = total / (k * k * c)
    return top


def correlation_backward_ref(a, b, dtop, pad, k, md, s1, s2):
    """CorrelateDataBackward0 and CorrelateDataBackward1 (MULTIPLY)."""
    n, c, h, w, kr, th, tw, r, gw = _geometry(a.shape, pad, k, md, s1, s2)
    r1, r2 = _rearrange(a, pad), _rearrange(b, pad)
    d0, d1 = np.zeros(a.shape), np.zeros(b.shape)
    sumelems = k * k * c

    def ceil_div(v):
        return -(-v // s1)

    for item in range(n):
        for ch in range(c):
            for m in range(pad, h + pad):
                for l in range(pad, w + pad):
                    # bottom 0
                    xmin, ymin = ceil_div(l - 2 * kr - md), ceil_div(m - 2 * kr - md)
                    xmax, ymax = (l - md) // s1, (m - md) // s1
                    total = 0.0
                    if xmax >= 0 and ymax >= 0 and xmin <= tw - 1 and ymin <= th - 1:
                        xmin, xmax, ymin, ymax = max(0, xmin), min(tw - 1, xmax), max(0, ymin), min(th - 1, ymax)
                        for p in range(-r, r + 1):
                            for o in range(-r, r + 1):
                                bot1 = r2[item, m + s2 * p, l + s2 * o, ch]
                                op = (p + r) * gw + (o + r)
                                total += dtop[item, op, ymin:ymax + 1, xmin:xmax + 1].sum() * bot1
                    d0[item, ch, m - pad, l - pad] = total / sumelems
                    # bottom 1
                    total = 0.0
                    for p in range(-r, r + 1):
                        for o in range(-r, r + 1):
                            s2o, s2p = s2 * o, s2 * p
                            xmin, ymin = ceil_div(l - 2 * kr - md - s2o), ceil_div(m - 2 * kr - md - s2p)
                            xmax, ymax = (l - md - s2o) // s1, (m - md - s2p) // s1
                            if xmax >= 0 and ymax >= 0 and xmin <= tw - 1 and ymin <= th - 1:
                                xmin, xmax = max(0, xmin), min(tw - 1, xmax)
                                ymin, ymax = max(0, ymin), min(th - 1, ymax)
                                assert m - s2p >= 0 and l - s2o >= 0
                                bot0 = r1[item, m - s2p, l - s2o, ch]
                                op = (p + r) * gw + (o + r)
                                total += dtop[item, op, ymin:ymax + 1, xmin:xmax + 1].sum() * bot0
                    d1[item, ch, m - pad, l - pad] = total / sumelems
    return d0, d1


def warp_ref(u, flow):
    """WarpForwardGPU."""
    n, c, h, w = u.shape
    v = np.zeros(u.shape)
    for i in range(n):
        for j in range(c):
            pic = u[i, j]
            for s in range(h):
                for t in range(w):
                    x, y = t + flow[i, 0, s, t], s + flow[i, 1, s, t]
                    if 0 <= x <= w - 1 and 0 <= y <= h - 1:
                        fx, fy, cx, cy = math.floor(x), math.floor(y), math.ceil(x), math.ceil(y)
                        ax, ay = x - fx, y - fy
                        v[i, j, s, t] = ((1 - ax) * (1 - ay) * pic[fy, fx] + ax * (1 - ay) * pic[fy, cx]
                                         + (1 - ax) * ay * pic[cy, fx] + ax * ay * pic[cy, cx])
    return v


def warp_backward_ref(u, flow, dv):
    """WarpBackwardGPU_dFlow and WarpBackwardGPU_dU."""
    n, c, h, w = u.shape
    du, dflow = np.zeros(u.shape), np.zeros(flow.shape)
    for i in range(n):
        for j in range(c):
            pic = u[i, j]
            for s in range(h):
                for t in range(w):
                    x, y = t + flow[i, 0, s, t], s + flow[i, 1, s, t]
                    if not (0 <= x <= w - 1 and 0 <= y <= h - 1):
                        continue
                    g = dv[i, j, s, t]
                    fx, fy, cx, cy = math.floor(x), math.floor(y), math.ceil(x), math.ceil(y)
                    ax, ay = x - fx, y - fy
                    dflow[i, 0, s, t] += ((1 - ay) * pic[fy, cx] - (1 - ay) * pic[fy, fx]
                                          + ay * pic[cy, cx] - ay * pic[cy, fx]) * g
                    dflow[i, 1, s, t] += ((1 - ax) * pic[cy, fx] - (1 - ax) * pic[fy, fx]
                                          + ax * pic[cy, cx] - ax * pic[fy, cx]) * g
                    if fx == cx:
                        tl = bl = tr = br = 0.0
                        if fx - 1 >= 0:
                            tl, bl = pic[fy, fx] - pic[fy, fx - 1], pic[cy, fx] - pic[cy, fx - 1]
                        if fx + 1 <= w - 1:
                            tr, br = pic[fy, fx + 1] - pic[fy, fx], pic[cy, fx + 1] - pic[cy, fx]
                        dflow[i, 0, s, t] += ((1 - ay) * (tr + tl) / 2 + ay * (br + bl) / 2) * g
                    if fy == cy:
                        tl = tr = bl = br = 0.0
                        if fy - 1 >= 0:
                            tl, tr = pic[fy, fx] - pic[fy - 1, fx], pic[fy, cx] - pic[fy - 1, cx]
                        if fy + 1 <= h - 1:
                            bl, br = pic[fy + 1, fx] - pic[fy, fx], pic[fy + 1, cx] - pic[fy, cx]
                        dflow[i, 1, s, t] += ((1 - ax) * (bl + tl) / 2 + ax * (br + tr) / 2) * g
                    du[i, j, fy, fx] += (1 - ax) * (1 - ay) * g
                    du[i, j, fy, cx] += ax * (1 - ay) * g
                    du[i, j, cy, fx] += (1 - ax) * ay * g
                    du[i, j, cy, cx] += ax * ay * g
    return du, dflow


def _corr(shape, pad, k, md, s1, s2, kind="MULTIPLY"):
    text = (f'type: "Correlation" bottom: "a" bottom: "b" top: "c" correlation_param {{ pad: {pad} '
            f'kernel_size: {k} max_displacement: {md} stride_1: {s1} stride_2: {s2} '
            f'correlation_type: {kind} }}')
    return make_layer(text, [shape, shape])


# PWC-Net's (pad 4, k 1, d 4), FlowNetC's shape of parameters (k 1, stride_2 2) made small, a
# 3 x 3 patch with stride_1 2, and a top that the ceil leaves one column short of the border.
CASES = [(4, 1, 4, 1, 1), (3, 1, 3, 1, 2), (2, 3, 2, 2, 1), (1, 3, 3, 2, 2), (0, 1, 1, 3, 1)]


@pytest.mark.parametrize("pad,k,md,s1,s2", CASES)
@pytest.mark.parametrize("kind", ["MULTIPLY", "SUBTRACT"])
def test_correlation_matches_the_forks_kernels(pad, k, md, s1, s2, kind):
    rng = np.random.default_rng(pad * 100 + k * 10 + md + s1 + s2)
    shape = (2, 5, 9, 8)
    a, b = rng.standard_normal(shape).astype(F32), rng.standard_normal(shape).astype(F32)
    layer, tops = _corr(shape, pad, k, md, s1, s2, kind)
    ref = correlation_ref(a, b, pad, k, md, s1, s2, subtract=kind == "SUBTRACT")
    assert tops == [ref.shape]
    (top,) = layer.forward([torch.from_numpy(a), torch.from_numpy(b)])
    np.testing.assert_allclose(top.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pad,k,md,s1,s2", CASES)
def test_correlation_backward_is_the_forks_backward_kernels(pad, k, md, s1, s2):
    rng = np.random.default_rng(7 + pad + k + md + s1 + s2)
    shape = (2, 3, 8, 9)
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    layer, tops = _corr(shape, pad, k, md, s1, s2)
    dtop = rng.standard_normal(tops[0])
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    (top,) = layer.forward([ta, tb])
    top.backward(torch.from_numpy(dtop))
    d0, d1 = correlation_backward_ref(a, b, dtop, pad, k, md, s1, s2)
    np.testing.assert_allclose(ta.grad.numpy(), d0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(tb.grad.numpy(), d1, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["MULTIPLY", "SUBTRACT"])
def test_correlation_gradient_float64(kind):
    rng = np.random.default_rng(3)
    shape = (1, 3, 7, 6)
    layer, _ = _corr(shape, 2, 3, 2, 2, 1, kind)
    a, b = torch.from_numpy(rng.standard_normal(shape)), torch.from_numpy(rng.standard_normal(shape))
    assert gradcheck_layer(layer, [a, b])


def test_correlation_channel_order_is_vertical_major():
    # one feature at (2, 3) in f1; f2's copy moved 1 right and 2 down: the match is in channel
    # (p + r) * D + (o + r) with p = 2 (down), o = 1 (right), r = 2
    a, b = np.zeros((1, 1, 7, 7), F32), np.zeros((1, 1, 7, 7), F32)
    a[0, 0, 2, 3] = b[0, 0, 4, 4] = 1
    layer, _ = _corr(a.shape, 2, 1, 2, 1, 1)
    (top,) = layer.forward([torch.from_numpy(a), torch.from_numpy(b)])
    hot = np.argwhere(top.numpy()[0] != 0)
    np.testing.assert_array_equal(hot, [[(2 + 2) * 5 + (1 + 2), 2, 3]])


def test_correlation_refuses_what_the_fork_checks():
    with pytest.raises(LayerError, match="kernel_size is required"):
        make_layer('type: "Correlation" bottom: "a" bottom: "b" top: "c" '
                   'correlation_param { max_displacement: 1 }', [(1, 1, 5, 5)] * 2)
    with pytest.raises(LayerError, match="odd"):
        _corr((1, 1, 5, 5), 0, 2, 1, 1, 1)
    with pytest.raises(LayerError, match="no room"):
        _corr((1, 1, 5, 5), 0, 1, 3, 1, 1)
    with pytest.raises(LayerError, match="one shape"):
        make_layer('type: "Correlation" bottom: "a" bottom: "b" top: "c" '
                   'correlation_param { kernel_size: 1 max_displacement: 1 }', [(1, 2, 5, 5), (1, 3, 5, 5)])


def test_flownet_binary_correlation_param_at_150_is_read_by_type(tmp_path):
    # A caffemodel as FlowNet 2.0's / PWC-Net's Caffe writes it: correlation_param at 150,
    # brewnet's upsample_param (the YOLO ports'); max_displacement 4 and stride_1 3 land on
    # Upsample's pad_out_h/w (enums, so they survive), single_direction -1 and type SUBTRACT
    # on numbers Upsample lacks.
    corr = pb.CorrelationParameter(pad=4, kernel_size=1, max_displacement=4, stride_1=3,
                                   stride_2=2, single_direction=-1, do_abs=True,
                                   correlation_type=pb.CorrelationParameter.SUBTRACT)
    layer = pb.LayerParameter(name="corr", type="Correlation", bottom=["a", "b"], top=["c"])
    up = pb.LayerParameter(name="up", type="Upsample", bottom=["c"], top=["u"],
                           upsample_param=pb.UpsampleParameter(scale=2, pad_out_h=1))
    wire = layer.SerializeToString() + _field(150, 2, corr.SerializeToString())
    path = tmp_path / "flownet.caffemodel"
    path.write_bytes(_field(100, 2, wire) + _field(100, 2, up.SerializeToString()))
    read = {lp.name: lp for lp in read_net(str(path)).layer}
    assert read["corr"].correlation_param == corr
    assert not read["corr"].HasField("upsample_param")
    assert read["up"].upsample_param.pad_out_h and read["up"].upsample_param.scale == 2
    # brewnet writes its own number (20150) and reads it back as it is
    again = tmp_path / "brewnet.caffemodel"
    again.write_bytes(pb.NetParameter(layer=[read["corr"]]).SerializeToString())
    assert read_net(str(again)).layer[0].correlation_param == corr


def _varint(v):
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _field(number, wire, payload):
    return _varint(number << 3 | wire) + (_varint(len(payload)) + payload if wire == 2 else payload)


# -- Warp ----------------------------------------------------------------------------------------
def _warp(shape):
    return make_layer('type: "Warp" bottom: "u" bottom: "f" top: "v"',
                      [shape, (shape[0], 2) + shape[2:]])


def _flows(rng, shape, integer):
    n, _, h, w = shape
    base = rng.integers(-3, 4, (n, 2, h, w)).astype(np.float64)
    if integer:      # whole pixels: the kernels' floor == ceil rule, and exact borders
        return base
    return base + rng.uniform(0.15, 0.85, (n, 2, h, w))


@pytest.mark.parametrize("integer", [False, True])
def test_warp_forward_and_backward_match_the_forks_kernels(integer):
    rng = np.random.default_rng(11 + integer)
    shape = (2, 3, 6, 7)
    u, flow = rng.standard_normal(shape), _flows(rng, shape, integer)
    layer, tops = _warp(shape)
    assert tops == [shape]
    tu, tf = torch.tensor(u, requires_grad=True), torch.tensor(flow, requires_grad=True)
    (v,) = layer.forward([tu, tf])
    np.testing.assert_allclose(v.detach().numpy(), warp_ref(u, flow), rtol=1e-12, atol=1e-12)
    dv = rng.standard_normal(shape)
    v.backward(torch.from_numpy(dv))
    du, dflow = warp_backward_ref(u, flow, dv)
    np.testing.assert_allclose(tu.grad.numpy(), du, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tf.grad.numpy(), dflow, rtol=1e-12, atol=1e-12)
    # float32, as the fork runs it
    (v32,) = layer.forward([torch.from_numpy(u.astype(F32)), torch.from_numpy(flow.astype(F32))])
    np.testing.assert_allclose(v32.numpy(), warp_ref(u.astype(F32), flow.astype(F32)), rtol=1e-5, atol=1e-6)


def test_warp_borders_zero_outside_and_sample_the_last_row_and_column():
    u = np.arange(12, dtype=F32).reshape(1, 1, 3, 4)
    flow = np.zeros((1, 2, 3, 4), F32)
    flow[0, 0, 0, 0] = 3.0          # x = 3 = W - 1: inside, samples u[0, 3]
    flow[0, 0, 0, 1] = 2.5          # x = 3.5: outside, 0
    flow[0, 1, 1, 2] = -1.25        # y = -0.25: outside, 0
    flow[0, 1, 0, 3] = 2.0          # y = 2 = H - 1: u[2, 3]
    layer, _ = _warp(u.shape)
    (v,) = layer.forward([torch.from_numpy(u), torch.from_numpy(flow)])
    want = u.copy()
    want[0, 0, 0, 0], want[0, 0, 0, 1], want[0, 0, 1, 2], want[0, 0, 0, 3] = 3, 0, 0, 11
    np.testing.assert_array_equal(v.numpy(), want)


def test_warp_gradient_float64():
    rng = np.random.default_rng(5)
    shape = (1, 2, 5, 6)
    layer, _ = _warp(shape)
    u = torch.from_numpy(rng.standard_normal(shape))
    flow = torch.from_numpy(_flows(rng, shape, integer=False))
    assert gradcheck_layer(layer, [u, flow])


def test_warp_refuses_a_flow_of_another_shape():
    with pytest.raises(LayerError, match="flow"):
        make_layer('type: "Warp" bottom: "u" bottom: "f" top: "v"', [(1, 3, 4, 4), (1, 3, 4, 4)])
    with pytest.raises(LayerError, match="flow"):
        make_layer('type: "Warp" bottom: "u" bottom: "f" top: "v"', [(1, 3, 4, 4), (1, 2, 2, 2)])


def test_eltwise_one_bottom_is_flownets_scaled_copy():
    layer, tops = make_layer('type: "Eltwise" bottom: "x" top: "y" eltwise_param { coeff: 20 }', [(2, 3)])
    x = torch.arange(6, dtype=torch.float32).view(2, 3)
    (y,) = layer.forward([x])
    assert tops == [(2, 3)] and y is not x
    np.testing.assert_array_equal(y.numpy(), 20 * x.numpy())
    with pytest.raises(LayerError, match="at least 2"):
        make_layer('type: "Eltwise" bottom: "x" top: "y" eltwise_param { operation: MAX }', [(2, 3)])


# -- PWC-Net's deploy --------------------------------------------------------------------------
def test_pwcnet_deploy_builds_and_runs():
    # its timing prototxt (1024 x 448, the fork's Correlation/Warp, a one-bottom Eltwise * 20)
    # at 256 x 128: the pyramid's 6 levels still divide it
    param = read_net(str(PWCNET))
    for lp in param.layer[:2]:
        dims = lp.input_param.shape[0].dim
        dims[2], dims[3] = 256, 128
    net = caffe.Net(param, caffe.TEST)
    assert net.outputs == ["blob50"]
    rng = np.random.default_rng(38)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.data.shape) * 0.05
    imgs = [rng.standard_normal((1, 3, 256, 128)).astype(F32) for _ in range(2)]
    out = net.forward(img0_nomean_resize=imgs[0], img1_nomean_resize=imgs[1])
    assert out["blob50"].shape == (1, 2, 64, 32) and np.isfinite(out["blob50"]).all()
    np.testing.assert_array_equal(out["blob50"], 20 * net.blobs["predict_flow"].data)
    layers = {lp.name: lp for lp in param.layer}
    for name in ("Correlation1", "Correlation2"):
        a, b = (net.blobs[x].data.astype(np.float64) for x in layers[name].bottom)
        p = layers[name].correlation_param
        ref = correlation_ref(a, b, p.pad, p.kernel_size, p.max_displacement, p.stride_1, p.stride_2)
        # the tops went through an in-place ReLU: compare the positive part
        np.testing.assert_allclose(net.blobs[name].data, np.maximum(ref, 0), rtol=1e-4, atol=1e-6)
    u, flow = (net.blobs[x].data.astype(np.float64) for x in layers["warped_image5"].bottom)
    np.testing.assert_allclose(net.blobs["warped_image5"].data, warp_ref(u, flow), rtol=1e-5, atol=1e-5)
