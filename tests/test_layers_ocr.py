"""senlinuc/caffe_ocr's layers against loops written from the fork's own C++ (github.com/
senlinuc/caffe_ocr at commit 81642f61ea8f888e360cca30e08e05b7bc6d4556):

- Transpose: src/caffe/layers/transpose_layer.cpp (transpose_cpu's index arithmetic)
- Reverse: src/caffe/layers/reverse_layer.cpp (Forward_cpu's pointer walk)
- Lstm: src/caffe/layers/lstm_layer_Junhyuk.cpp (Forward_cpu, Backward_cpu) and .cu (the GPU
  kernels, per sample, for N > 1: the CPU forward adds sample 0's recurrent term to every sample)
- CTCGreedyDecoder: src/caffe/layers/ctc_decoder_layer.cpp (Decode, Forward_cpu's accuracy)
- DenseBlock: src/caffe/layers/DenseBlock_layer.cpp (convolution_Fwd, BN_inf_Fwd, the blob
  order) and .cu (TEST uses the stored mean/variance as they are; TRAIN's running update)
- the proto: src/caffe/proto/caffe.proto (names, numbers)

OpenCV's dnn runs none of these types (its Caffe importer has BVLC's LSTM, not this Lstm), so the
fork's formulas are the only reference. The real net is the fork's
examples/ocr/densenet/densenet-res-blstm_deploy.prototxt (tests/data/forks/PROVENANCE.md).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import upgrade_net
from brewnet.proto.io import _varint
from tests.helpers import gradcheck_layer, make_layer

FORKS = Path(__file__).resolve().parent / "data" / "forks"
F64 = np.float64


# -- Transpose ------------------------------------------------------------------------------
def transpose_ref(x, dims):
    """transpose_cpu: from_counts/to_counts are count(i + 1); to_index = sum from_inds[map[i]] * to_counts[i]."""
    shape = x.shape
    top_shape = [shape[d] for d in dims]
    from_counts = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    to_counts = [int(np.prod(top_shape[i + 1:])) for i in range(len(shape))]
    src, out = x.reshape(-1), np.zeros(x.size, x.dtype)
    for index in range(x.size):
        rem, inds = index, []
        for i in range(len(shape)):
            inds.append(rem // from_counts[i])
            rem %= from_counts[i]
        out[sum(inds[dims[i]] * to_counts[i] for i in range(len(shape)))] = src[index]
    return out.reshape(top_shape)


@pytest.mark.parametrize("dims", [(3, 2, 0, 1), (0, 2, 1, 3), (1, 0)])
def test_transpose_is_the_forks_index_rule(dims):
    shape = (2, 3, 4, 5)[:len(dims)]
    x = np.random.default_rng(0).standard_normal(shape)
    text = "".join(f"dim: {d} " for d in dims)
    layer, tops = make_layer(f'type: "Transpose" top: "y" transpose_param {{ {text} }}', [shape])
    assert tops == [tuple(shape[d] for d in dims)]
    (y,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_array_equal(y.numpy(), transpose_ref(x, dims))
    assert gradcheck_layer(layer, [torch.from_numpy(x)])
    with pytest.raises(caffe.layers.LayerError, match="dims for a"):
        make_layer(f'type: "Transpose" top: "y" transpose_param {{ {text} dim: {len(dims)} }}', [shape])
    with pytest.raises(caffe.layers.LayerError, match="not a permutation"):
        make_layer('type: "Transpose" top: "y" transpose_param { dim: 0 dim: 0 }', [(2, 3)])


# -- Reverse --------------------------------------------------------------------------------
def reverse_ref(x, axis):
    """ReverseLayer::Forward_cpu: num_fix blocks of sub_iter_max slices of copy_amount values,
    each block written from its end."""
    count = x.size
    axis_count = int(np.prod(x.shape[axis:]))
    copy_amount = 1 if axis + 1 == x.ndim else int(np.prod(x.shape[axis + 1:]))
    num_fix = count // axis_count if axis > 0 else 1
    sub_iter_max = x.shape[axis]
    src, out = x.reshape(-1), np.zeros(count, x.dtype)
    s = 0
    for fix in range(num_fix):
        target = (fix + 1) * copy_amount * sub_iter_max - copy_amount
        for _ in range(sub_iter_max):
            out[target:target + copy_amount] = src[s:s + copy_amount]
            s += copy_amount
            target -= copy_amount
    return out.reshape(x.shape)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reverse_is_the_forks_copy_loop(axis):
    shape = (4, 3, 5)
    x = np.random.default_rng(1).standard_normal(shape)
    layer, tops = make_layer(f'type: "Reverse" top: "y" reverse_param {{ axis: {axis} }}', [shape])
    assert tops == [shape]
    (y,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_array_equal(y.numpy(), reverse_ref(x, axis))
    assert gradcheck_layer(layer, [torch.from_numpy(x)])
    with pytest.raises(caffe.layers.LayerError, match="axis must be >= 0"):
        make_layer('type: "Reverse" top: "y" reverse_param { axis: -1 }', [shape])
    with pytest.raises(caffe.layers.LayerError, match="out of range"):
        make_layer('type: "Reverse" top: "y" reverse_param { axis: 3 }', [shape])


# -- Lstm -----------------------------------------------------------------------------------
def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_ref_cpu(x, w_i, w_h, b):
    """LstmLayer::Forward_cpu, literally (one bottom: cont = t > 0; h_to_gate is never advanced
    over n, so every sample gets sample 0's recurrent term). Returns h, c, gates, h_0."""
    steps, n, _ = x.shape
    h_dim = w_h.shape[1]
    pre = x.reshape(steps * n, -1) @ w_i.T + b          # pre_gate (T*N, 4H)
    pre = pre.reshape(steps, n, 4 * h_dim).copy()
    gate = np.zeros_like(pre)
    h, c = np.zeros((steps, n, h_dim)), np.zeros((steps, n, h_dim))
    h0 = np.zeros((n, h_dim))
    for t in range(steps):
        h_prev = h[t - 1] if t > 0 else h0
        c_prev = c[t - 1] if t > 0 else h0
        h_to_gate = h_prev @ w_h.T                       # (N, 4H)
        for k in range(n):
            cont = t > 0
            if cont:
                pre[t, k] += h_to_gate[0]                # the fork's pointer: row 0 for every k
            for d in range(h_dim):
                gate[t, k, d] = sigmoid(pre[t, k, d])
                gate[t, k, h_dim + d] = sigmoid(pre[t, k, h_dim + d]) if cont else 0.0
                gate[t, k, 2 * h_dim + d] = sigmoid(pre[t, k, 2 * h_dim + d])
                gate[t, k, 3 * h_dim + d] = np.tanh(pre[t, k, 3 * h_dim + d])
                c[t, k, d] = gate[t, k, h_dim + d] * c_prev[k, d] + gate[t, k, d] * gate[t, k, 3 * h_dim + d]
                h[t, k, d] = gate[t, k, 2 * h_dim + d] * np.tanh(c[t, k, d])
    return h, c, gate, h0


def lstm_ref_gpu(x, w_i, w_h, b):
    """LstmLayer::Forward_gpu's kernels: ClipAdd (each sample its own h_to_gate row, times
    clip_t = t > 0), ActivationForward (sigmoid for the first 3H, tanh after), LSTMForward."""
    steps, n, _ = x.shape
    h_dim = w_h.shape[1]
    pre = (x.reshape(steps * n, -1) @ w_i.T + b).reshape(steps, n, 4 * h_dim)
    h, c = np.zeros((n, h_dim)), np.zeros((n, h_dim))
    out = []
    for t in range(steps):
        clip_t = float(t > 0)
        a = pre[t] + clip_t * (h @ w_h.T)
        gate = np.concatenate([sigmoid(a[:, :3 * h_dim]), np.tanh(a[:, 3 * h_dim:])], 1)
        i, f, o, g = np.split(gate, 4, 1)
        c = clip_t * f * c + i * g
        h = o * np.tanh(c)
        out.append(h)
    return np.stack(out)


def lstm_backward_ref_cpu(x, w_i, w_h, b, top_diff, clip):
    """LstmLayer::Backward_cpu (one bottom, N = 1 here so the forward above is the GPU's too)."""
    h, c, gate, h0 = lstm_ref_cpu(x, w_i, w_h, b)
    steps, n, h_dim = h.shape
    dh = top_diff.copy()
    dc = np.zeros_like(c)
    pre_diff = np.zeros_like(gate)
    dh0, dc0 = np.zeros((n, h_dim)), np.zeros((n, h_dim))
    for t in range(steps - 1, -1, -1):
        c_prev = c[t - 1] if t > 0 else h0
        dh_prev = dh[t - 1] if t > 0 else dh0
        dc_prev = dc[t - 1] if t > 0 else dc0
        cont = t > 0
        g = gate[t]
        gd = np.zeros((n, 4 * h_dim))
        for k in range(n):
            tanh_c = np.tanh(c[t, k])
            gd[k, 2 * h_dim:3 * h_dim] = dh[t, k] * tanh_c
            dc[t, k] += dh[t, k] * g[k, 2 * h_dim:3 * h_dim] * (1 - tanh_c ** 2)
            dc_prev[k] = dc[t, k] * g[k, h_dim:2 * h_dim] if cont else 0
            gd[k, h_dim:2 * h_dim] = dc[t, k] * c_prev[k] if cont else 0
            gd[k, :h_dim] = dc[t, k] * g[k, 3 * h_dim:]
            gd[k, 3 * h_dim:] = dc[t, k] * g[k, :h_dim]
            sg = g[k, :3 * h_dim]
            pre_diff[t, k, :3 * h_dim] = gd[k, :3 * h_dim] * sg * (1 - sg)
            pre_diff[t, k, 3 * h_dim:] = gd[k, 3 * h_dim:] * (1 - g[k, 3 * h_dim:] ** 2)
            if clip > 0:
                pre_diff[t, k] = np.clip(pre_diff[t, k], -clip, clip)
        h_to_h = pre_diff[t] @ w_h
        if cont:
            dh_prev += h_to_h
    flat = pre_diff.reshape(steps * n, -1)
    d_wi = flat.T @ x.reshape(steps * n, -1)
    d_wh = pre_diff[1:].reshape(-1, 4 * h_dim).T @ h[:-1].reshape(-1, h_dim) + pre_diff[0].T @ h0
    d_b = flat.sum(0)
    d_x = (flat @ w_i).reshape(x.shape)
    return d_x, d_wi, d_wh, d_b


def lstm_layer(shape, hidden, clip=0.0, seed=0):
    layer, tops = make_layer(f'type: "Lstm" top: "h" lstm_param {{ num_output: {hidden} '
                             f'clipping_threshold: {clip} weight_filler {{ type: "gaussian" std: 0.5 }} '
                             'bias_filler { type: "gaussian" std: 0.5 } }', [shape])
    rng = np.random.default_rng(seed)
    layer.blobs = [torch.from_numpy(rng.standard_normal(tuple(b.shape)) * 0.6).requires_grad_(True)
                   for b in layer.blobs]
    return layer, tops


def test_lstm_forward_is_the_forks_cpu_loop_and_its_gpu_kernels_for_a_batch():
    layer, tops = lstm_layer((5, 1, 3), 4)
    assert tops == [(5, 1, 4)]
    assert [tuple(b.shape) for b in layer.blobs] == [(16, 3), (16, 4), (16,)]
    w_i, w_h, b = (t.detach().numpy() for t in layer.blobs)
    x = np.random.default_rng(3).standard_normal((5, 1, 3))
    (h,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_allclose(h.detach().numpy(), lstm_ref_cpu(x, w_i, w_h, b)[0], rtol=1e-12, atol=1e-14)
    # a batch: the GPU kernels (each sample's own recurrence); the CPU loop differs there
    xb = np.random.default_rng(4).standard_normal((5, 3, 3))
    layer3, _ = lstm_layer((5, 3, 3), 4)
    (hb,) = layer3.forward([torch.from_numpy(xb)])
    np.testing.assert_allclose(hb.detach().numpy(), lstm_ref_gpu(xb, w_i, w_h, b), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(hb.detach().numpy()[:, :1], lstm_ref_cpu(xb[:, :1], w_i, w_h, b)[0], rtol=1e-12)
    assert not np.allclose(hb.detach().numpy(), lstm_ref_cpu(xb, w_i, w_h, b)[0])
    assert gradcheck_layer(layer3, [torch.from_numpy(xb)])


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_lstm_backward_is_the_forks_with_gate_gradient_clipping(clip):
    layer, _ = lstm_layer((6, 1, 3), 3, clip=clip, seed=5)
    w_i, w_h, b = (t.detach().numpy() for t in layer.blobs)
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((6, 1, 3))).requires_grad_(True)
    top_diff = np.random.default_rng(7).standard_normal((6, 1, 3))
    (h,) = layer.forward([x])
    h.backward(torch.from_numpy(top_diff))
    # the proto's float: the bound is float32(clip), as the fork's Dtype clipping_threshold_
    want = lstm_backward_ref_cpu(x.detach().numpy(), w_i, w_h, b, top_diff, float(np.float32(clip)))
    got = [x.grad] + [bl.grad for bl in layer.blobs]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-12)
    if clip:   # the bound binds somewhere, so this is not the true gradient
        free = lstm_backward_ref_cpu(x.detach().numpy(), w_i, w_h, b, top_diff, 0.0)
        assert np.abs(want[1]).max() < np.abs(free[1]).max()


# -- CTCGreedyDecoder -----------------------------------------------------------------------
def scores(best, classes):
    """(T, N, C) scores whose per-step maximum is ``best[t][n]``."""
    steps, n = len(best), len(best[0])
    x = np.zeros((steps, n, classes))
    for t in range(steps):
        for k in range(n):
            x[t, k, best[t][k]] = 1.0
    return x


def test_ctc_greedy_decoder_by_hand():
    best = [[1, 0], [1, 2], [0, 2], [1, 3], [2, 3], [2, 0]]   # T = 6, N = 2, C = 4
    x = scores(best, 4)
    layer, tops = make_layer('type: "CTCGreedyDecoder" top: "r"', [x.shape])
    assert tops == [(2, 6, 1, 1)]
    (r,) = layer.forward([torch.from_numpy(x)])
    # blank 0 (the fork's default), repeats merged: sample 0 is 1 1 _ 1 2 2, sample 1 _ 2 2 3 3 _
    assert r.reshape(2, 6).tolist() == [[1, 1, 2, -1, -1, -1], [2, 3, -1, -1, -1, -1]]
    layer, _ = make_layer('type: "CTCGreedyDecoder" top: "r" ctc_decoder_param { blank_index: -1 '
                          'ctc_merge_repeated: false }', [x.shape])
    (r,) = layer.forward([torch.from_numpy(x)])
    # blank 3 (the last class), nothing merged
    assert r.reshape(2, 6).tolist() == [[1, 1, 0, 1, 2, 2], [0, 2, 2, 0, -1, -1]]
    # ties: the first class of highest score (the fork's strict >)
    tie = np.zeros((1, 1, 4))
    tie[0, 0, [2, 3]] = 5
    (r,) = layer.forward([torch.from_numpy(tie)])
    assert r.reshape(-1).tolist() == [2]
    # a (T, N, C, 1) bottom reads the same
    (r4,) = make_layer('type: "CTCGreedyDecoder" top: "r"', [x.shape + (1,)])[0].forward(
        [torch.from_numpy(x[..., None])])
    assert r4.reshape(2, 6).tolist() == [[1, 1, 2, -1, -1, -1], [2, 3, -1, -1, -1, -1]]


def test_ctc_greedy_decoder_accuracy_with_labels():
    # decoded: [1, 1, 2] and [2, 3] (as above); a third sample decodes to nothing
    best = [[1, 0, 0], [1, 2, 0], [0, 2, 0], [1, 3, 0], [2, 3, 0], [2, 0, 0]]
    x = scores(best, 4)
    labels = np.array([[1, 1, 2, -1], [2, 0, 3, 1.2], [-1, 2, 2, 2]])   # 0 is blank: skipped
    layer, tops = make_layer('type: "CTCGreedyDecoder" top: "acc"', [x.shape, labels.shape])
    assert tops == [(1, 2, 1, 1)]
    (acc,) = layer.forward([torch.from_numpy(x), torch.from_numpy(labels)])
    # sample 0 exact; sample 1 target [2, 3, 1] vs [2, 3]: distance 1 of 3; sample 2 both empty:
    # skipped (distance 0, not counted exact), as the fork's `continue`
    assert acc.reshape(-1).tolist() == pytest.approx([1 - (0 + 1 / 3) / 3, 1 / 3])


# -- DenseBlock -----------------------------------------------------------------------------
def conv_fwd_ref(x, w):
    """convolution_Fwd: output (h, w) += filter(o, i, fx, fy) * input(h + k/2 - fx, w + k/2 - fy)."""
    n, ci, hh, ww = x.shape
    co, _, kh, kw = w.shape
    out = np.zeros((n, co, hh, ww))
    for fx in range(kh):
        for fy in range(kw):
            for i in range(hh):
                for j in range(ww):
                    li, lj = i + kh // 2 - fx, j + kw // 2 - fy
                    if 0 <= li < hh and 0 <= lj < ww:
                        out[:, :, i, j] += x[:, :, li, lj] @ w[:, :, fx, fy].T
    return out


def bn_inf_ref(x, mean, var, scale, bias):
    """BN_inf_Fwd with the stored mean/variance as they are (the GPU's cuDNN inference call)."""
    r = lambda v: v.reshape(1, -1, 1, 1)   # noqa: E731
    return r(scale) * ((x - r(mean)) / np.sqrt(r(var) + 1e-5)) + r(bias)


def dense_block_ref(x, blobs, transitions, bc):
    b = [t.detach().numpy() for t in blobs]
    n_t, feats = transitions, x
    for i in range(n_t):
        y = np.maximum(bn_inf_ref(feats, b[3 * n_t + i], b[4 * n_t + i], b[n_t + i], b[2 * n_t + i]), 0)
        if bc:
            y = conv_fwd_ref(y, b[5 * n_t + i])
            y = np.maximum(bn_inf_ref(y, b[8 * n_t + i], b[9 * n_t + i], b[6 * n_t + i], b[7 * n_t + i]), 0)
        feats = np.concatenate([feats, conv_fwd_ref(y, b[i])], 1)
    return feats


def dense_block(shape, transitions, growth, bc, phase=pb.TEST, seed=0):
    layer, tops = make_layer(
        f'type: "DenseBlock" top: "y" denseblock_param {{ numTransition: {transitions} initChannel: 64 '
        f'growthRate: {growth} use_BC: {str(bc).lower()} Filter_Filler {{ type: "msra" }} '
        'BN_Scaler_Filler { type: "constant" value: 1 } BN_Bias_Filler { type: "constant" value: 0 } '
        'moving_average_fraction: 0.25 }', [shape], phase)
    rng = np.random.default_rng(seed)
    n_t = transitions
    for k, blob in enumerate(layer.blobs[:-1]):
        v = rng.standard_normal(tuple(blob.shape))
        if 4 * n_t <= k < 5 * n_t or 9 * n_t <= k:     # variances > 0
            v = np.abs(v) + 0.5
        layer.blobs[k] = torch.from_numpy(v).requires_grad_(blob.requires_grad)
    return layer, tops


@pytest.mark.parametrize("bc", [False, True])
def test_dense_block_blobs_and_test_forward_are_the_forks(bc):
    shape, n_t, g = (2, 3, 4, 5), 2, 2
    layer, tops = dense_block(shape, n_t, g, bc)
    assert tops == [(2, 3 + n_t * g, 4, 5)]          # initChannel (64) is ignored, as the fork
    want = [(g, 4 * g if bc else 3, 3, 3), (g, 4 * g if bc else 5, 3, 3)] + [(1, 3, 1, 1), (1, 5, 1, 1)] * 4
    if bc:
        want += [(4 * g, 3, 1, 1), (4 * g, 5, 1, 1)] + [(1, 4 * g, 1, 1)] * 8
    assert [tuple(b.shape) for b in layer.blobs] == want + [(1,)]
    assert [b.requires_grad for b in layer.blobs[3 * n_t:5 * n_t]] == [False] * (2 * n_t)
    x = np.random.default_rng(9).standard_normal(shape)
    (y,) = layer.forward([torch.from_numpy(x)])
    np.testing.assert_allclose(y.detach().numpy(), dense_block_ref(x, layer.blobs, n_t, bc), rtol=1e-10, atol=1e-12)
    # the stored statistics are used as they are (the GPU path; the CPU path's scale-factor blob,
    # left 0 by GPU training, is not read)
    layer.blobs[-1] = torch.tensor([7.0], dtype=torch.float64)
    np.testing.assert_allclose(layer.forward([torch.from_numpy(x)])[0].detach().numpy(), y.detach().numpy())
    assert gradcheck_layer(layer, [torch.from_numpy(x)], check_params=False)


def test_dense_block_train_uses_batch_statistics_and_updates_the_stored_ones():
    shape = (3, 2, 3, 4)
    layer, _ = dense_block(shape, 1, 2, False, phase=pb.TRAIN)
    mean0, var0 = layer.blobs[3].detach().clone(), layer.blobs[4].detach().clone()
    x = np.random.default_rng(10).standard_normal(shape)
    (y,) = layer.forward([torch.from_numpy(x)])
    bm, bv = x.mean((0, 2, 3)), x.var((0, 2, 3))
    b = [t.detach().numpy() for t in layer.blobs]
    z = np.maximum(bn_inf_ref(x, bm, bv, b[1], b[2]), 0)
    np.testing.assert_allclose(y.detach().numpy(), np.concatenate([x, conv_fwd_ref(z, b[0])], 1),
                               rtol=1e-10, atol=1e-12)
    m = x.size // 2
    # cudnn's running update with factor moving_average_fraction (0.25), unbiased variance
    np.testing.assert_allclose(b[3].reshape(-1), 0.25 * bm + 0.75 * mean0.numpy().reshape(-1), rtol=1e-12)
    np.testing.assert_allclose(b[4].reshape(-1), 0.25 * bv * m / (m - 1) + 0.75 * var0.numpy().reshape(-1), rtol=1e-12)
    assert gradcheck_layer(layer, [torch.from_numpy(x)])


# -- the proto --------------------------------------------------------------------------------
def _ld(number, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_fork_numbers_in_binary_files():
    # the fork's own numbers: lstm_param 8266711 (brewnet's roi_pooling_param), denseblock_param
    # 147 (swish_param), re-read by layer type; transpose 8266710, reverse 160, ctc 158 as they are
    lstm = pb.LSTMParameter(num_output=256, clipping_threshold=0.5,
                            weight_filler=pb.FillerParameter(type="gaussian", std=0.1))
    dense = pb.DenseBlockParameter(numTransition=8, growthRate=8, use_dropout=False, dropout_amount=0.2)
    others = (_ld(8266710, pb.TransposeParameter(dim=[3, 2, 0, 1]).SerializeToString())
              + _ld(160, pb.ReverseParameter(axis=1).SerializeToString())
              + _ld(158, pb.CTCDecoderParameter(blank_index=-1).SerializeToString()))
    net = pb.NetParameter()
    for name, typ, extra in [("l", "Lstm", _ld(8266711, lstm.SerializeToString())),
                             ("d", "DenseBlock", _ld(147, dense.SerializeToString())),
                             ("o", "Transpose", others)]:
        net.layer.append(pb.LayerParameter.FromString(
            pb.LayerParameter(name=name, type=typ).SerializeToString() + extra))
    out = {lay.name: lay for lay in upgrade_net(net).layer}
    assert out["l"].lstm_param == lstm and not out["l"].HasField("roi_pooling_param")
    assert out["d"].denseblock_param == dense and not out["d"].HasField("swish_param")
    assert list(out["o"].transpose_param.dim) == [3, 2, 0, 1]
    assert out["o"].reverse_param.axis == 1 and out["o"].ctc_decoder_param.blank_index == -1
    again = upgrade_net(pb.NetParameter.FromString(upgrade_net(net).SerializeToString()))
    assert again == upgrade_net(net)


# -- the fork's real OCR net ------------------------------------------------------------------
def test_caffe_ocr_densenet_res_blstm_deploy_builds_and_runs(tmp_path):
    src = FORKS / "caffe_ocr_densenet_res_blstm_deploy.prototxt"
    net = caffe.Net(str(src), caffe.TEST)
    rng = np.random.default_rng(11)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.data.shape) * 0.1
    for name in ("DenseBlock1", "DenseBlock2", "DenseBlock3"):    # variances > 0
        blobs = net.params[name]
        for b in blobs[32:40]:
            b.data[...] = np.abs(b.data) + 0.5
    x = rng.standard_normal((1, 3, 32, 280)).astype(np.float32)
    out = net.forward(data=x)
    shapes = {k: net.blobs[k].data.shape for k in
              ("DenseBlock1", "DenseBlock3", "pool5_ave_transpose", "blstm_input", "lstm1", "rlstm1",
               "blstm2", "fc1x")}
    assert shapes == {"DenseBlock1": (1, 128, 16, 140), "DenseBlock3": (1, 192, 4, 35),
                      "pool5_ave_transpose": (35, 1, 1, 192), "blstm_input": (35, 1, 192),
                      "lstm1": (35, 1, 256), "rlstm1": (35, 1, 256), "blstm2": (35, 1, 512),
                      "fc1x": (35, 1, 5990)}
    assert [len(net.params[n]) for n in ("DenseBlock1", "lstm1")] == [41, 3]
    assert out["result"].shape == (1, 35, 1, 1)
    # the backward LSTM is Reverse-Lstm-Reverse; the decoder reads fc1x as the fork's loop
    best = net.blobs["fc1x"].data[:, 0].argmax(-1)
    seq = [int(c) for t, c in enumerate(best) if c != 0 and (t == 0 or c != best[t - 1])]
    r = out["result"].reshape(-1)
    assert r[:len(seq)].tolist() == seq and (r[len(seq):] == -1).all()
    # caffemodel round trip: the fork's fields and blobs come back
    net.save(str(tmp_path / "ocr.caffemodel"))
    again = caffe.Net(str(src), str(tmp_path / "ocr.caffemodel"), caffe.TEST)
    np.testing.assert_array_equal(again.forward(data=x)["result"], out["result"])
