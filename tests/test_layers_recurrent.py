"""RNN, LSTM, LSTMUnit: numpy reference, Caffe's one-step-at-a-time test, state handling,
float64 gradient checks. (The real-Caffe golden cases run in test_golden_layers.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brewnet.layers.base import LayerError
from brewnet.layers.recurrent import lstm_unit as LSTMUnitOp
from helpers import gradcheck_layer, make_layer

RNG = np.random.default_rng(7)


def recurrent_text(kind, h=3, expose=False, n_bottoms=2):
    names = ["x", "cont", "xs", "h0", "c0"][:n_bottoms]
    n_state = 2 if kind == "LSTM" else 1
    tops = ["y"] + (["hT", "cT"][:n_state] if expose else [])
    return (f'name: "r" type: "{kind}" ' + " ".join(f'bottom: "{b}"' for b in names) + " "
            + " ".join(f'top: "{t}"' for t in tops)
            + f' recurrent_param {{ num_output: {h} expose_hidden: {str(expose).lower()}'
            ' weight_filler { type: "uniform" min: -0.5 max: 0.5 }'
            ' bias_filler { type: "uniform" min: -0.5 max: 0.5 } }')


def sigmoid(v):
    return 1 / (1 + np.exp(-v))


def np_lstm(x, cont, blobs, xs=None, h0=None, c0=None):
    """Independent numpy LSTM: explicit per-gate matrices and loops over time and streams."""
    w_xc, b_c, w_hc = blobs[0], blobs[1], blobs[-1]
    T, N = x.shape[:2]
    H = w_hc.shape[1]
    h = np.zeros((N, H)) if h0 is None else h0.copy()
    c = np.zeros((N, H)) if c0 is None else c0.copy()
    out = np.zeros((T, N, H))
    for t in range(T):
        for n in range(N):
            hp, cp = cont[t, n] * h[n], c[n]
            z = w_xc @ x[t, n].ravel() + b_c + w_hc @ hp
            if xs is not None:
                z = z + blobs[2] @ xs[n].ravel()
            i, f, o, g = sigmoid(z[:H]), sigmoid(z[H:2 * H]), sigmoid(z[2 * H:3 * H]), np.tanh(z[3 * H:])
            c[n] = cont[t, n] * f * cp + i * g
            h[n] = o * np.tanh(c[n])
        out[t] = h
    return out, h, c


def np_rnn(x, cont, blobs, xs=None, h0=None):
    w_xh, b_h, w_hh, w_ho, b_o = blobs[0], blobs[1], blobs[-3], blobs[-2], blobs[-1]
    T, N = x.shape[:2]
    h = np.zeros((N, w_hh.shape[0])) if h0 is None else h0.copy()
    out = np.zeros((T, N, w_ho.shape[0]))
    for t in range(T):
        for n in range(N):
            z = w_hh @ (cont[t, n] * h[n]) + w_xh @ x[t, n].ravel() + b_h
            if xs is not None:
                z = z + blobs[2] @ xs[n].ravel()
            h[n] = np.tanh(z)
            out[t, n] = np.tanh(w_ho @ h[n] + b_o)
    return out, h


def inputs(T=4, N=3, feat=(2, 2), static=None, cont=None):
    x = torch.tensor(RNG.normal(size=(T, N) + feat))
    if cont is None:
        cont = np.ones((T, N))
        cont[0] = 0
        cont[2, 1] = 0
    b = [x, torch.tensor(cont)]
    if static:
        b.append(torch.tensor(RNG.normal(size=(N,) + static)))
    return b


def blobs_np(layer):
    return [b.detach().double().numpy() for b in layer.blobs]


@pytest.mark.parametrize("static", [False, True])
def test_lstm_matches_numpy(static):
    b = inputs(static=(3,) if static else None)
    layer, tops = make_layer(recurrent_text("LSTM", n_bottoms=len(b)), [t.shape for t in b])
    # Caffe's blob order and layout: W_xc (4H, I), b_c (4H), [W_xc_static (4H, S)], W_hc (4H, H).
    assert [tuple(p.shape) for p in layer.blobs] == [(12, 4), (12,)] + [(12, 3)] * static + [(12, 3)]
    assert tops == [(4, 3, 3)]
    y = layer.forward([t.float() for t in b])[0]
    ref, _, _ = np_lstm(b[0].numpy(), b[1].numpy(), blobs_np(layer), b[2].numpy() if static else None)
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("static", [False, True])
def test_rnn_matches_numpy(static):
    b = inputs(static=(2, 1) if static else None)
    layer, tops = make_layer(recurrent_text("RNN", n_bottoms=len(b)), [t.shape for t in b])
    # W_xh (H, I), b_h, [W_xh_static (H, S)], W_hh, W_ho, b_o
    assert [tuple(p.shape) for p in layer.blobs] == \
        [(3, 4), (3,)] + [(3, 2)] * static + [(3, 3), (3, 3), (3,)]
    y = layer.forward([t.float() for t in b])[0]
    ref, _ = np_rnn(b[0].numpy(), b[1].numpy(), blobs_np(layer), b[2].numpy() if static else None)
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_one_step_at_a_time_equals_all_at_once(kind):
    # Caffe's test_{lstm,rnn}_layer TestForward: a T=1 layer run T times carries h (and c)
    # between calls, so it reproduces the T-step output when cont is 1 after t=0.
    T, N = 5, 2
    x, cont = inputs(T=T, N=N, cont=np.r_[np.zeros((1, N)), np.ones((T - 1, N))])
    full, _ = make_layer(recurrent_text(kind), [x.shape, cont.shape])
    step, _ = make_layer(recurrent_text(kind), [(1,) + tuple(x.shape[1:]), (1, N)])
    for p, q in zip(step.blobs, full.blobs):
        p.data.copy_(q.data)
    want = full.forward([x.float(), cont.float()])[0]
    got = torch.cat([step.forward([x[t:t + 1].float(), cont[t:t + 1].float()])[0] for t in range(T)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # A second all-at-once batch with cont 1 at t=0 continues from the first batch's state.
    again = full.forward([x.float(), torch.ones_like(cont).float()])[0]
    xx = np.concatenate([x.numpy(), x.numpy()])
    cc = np.concatenate([cont.numpy(), np.ones_like(cont.numpy())])
    ref = (np_lstm if kind == "LSTM" else np_rnn)(xx, cc, blobs_np(full))[0][T:]
    np.testing.assert_allclose(again.detach().numpy(), ref, rtol=1e-5, atol=1e-6)
    full.reset()
    fresh = full.forward([x.float(), torch.ones_like(cont).float()])[0]
    fn = np_lstm if kind == "LSTM" else np_rnn
    ref = fn(x.numpy(), np.ones_like(cont.numpy()), blobs_np(full))[0]
    np.testing.assert_allclose(fresh.detach().numpy(), ref, rtol=1e-5, atol=1e-6)


def test_cont_zero_starts_a_new_sequence():
    T, N = 4, 2
    x, cont = inputs(T=T, N=N)   # stream 1 restarts at t=2
    layer, _ = make_layer(recurrent_text("LSTM"), [x.shape, cont.shape])
    y = layer.forward([x.float(), cont.float()])[0]
    # From t=2 on, stream 1 is exactly a fresh sequence of its own last two steps.
    ref, _, _ = np_lstm(x[2:, 1:].numpy(), np.array([[0.0], [1.0]]), blobs_np(layer))
    np.testing.assert_allclose(y[2:, 1:].detach().numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_expose_hidden(kind):
    n_state = 2 if kind == "LSTM" else 1
    x, cont = inputs(T=3, N=2, cont=np.ones((3, 2)))
    h0 = [torch.tensor(RNG.normal(size=(1, 2, 3))) for _ in range(n_state)]
    shapes = [x.shape, cont.shape] + [s.shape for s in h0]
    layer, tops = make_layer(recurrent_text(kind, expose=True, n_bottoms=2 + n_state), shapes)
    assert tops == [(3, 2, 3)] + [(1, 2, 3)] * n_state
    assert [layer.allow_backward(i) for i in range(2 + n_state)] == [True] + [False] * (1 + n_state)
    states = [s.float().requires_grad_(True) for s in h0]
    out = layer.forward([x.float(), cont.float()] + states)
    fn = np_lstm if kind == "LSTM" else np_rnn
    ref = fn(x.numpy(), cont.numpy(), blobs_np(layer), None, *[s.numpy()[0] for s in h0])
    np.testing.assert_allclose(out[0].detach().numpy(), ref[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(out[1:], ref[1:]):
        np.testing.assert_allclose(got.detach().numpy()[0], want, rtol=1e-5, atol=1e-6)
        assert not got.requires_grad   # Caffe shares only data: h_T/c_T diffs are ignored
    out[0].sum().backward()
    assert all(s.grad is None for s in states)  # and no diff reaches h0/c0
    # Exposed state: the layer carries nothing between calls.
    again = layer.forward([x.float(), cont.float()] + [s.detach() for s in states])[0]
    torch.testing.assert_close(again, out[0].detach())


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_gradient(kind):
    b = inputs(T=3, N=2, feat=(2,), static=(2,))
    layer, _ = make_layer(recurrent_text(kind, n_bottoms=3), [t.shape for t in b])
    assert [layer.allow_backward(i) for i in range(3)] == [True, False, True]
    assert gradcheck_layer(layer, b)


def test_gradient_expose_hidden():
    x, cont = inputs(T=3, N=2, feat=(2,), cont=np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]))
    h0, c0 = (torch.tensor(RNG.normal(size=(1, 2, 3))) for _ in range(2))
    layer, _ = make_layer(recurrent_text("LSTM", expose=True, n_bottoms=4),
                          [x.shape, cont.shape, h0.shape, c0.shape])
    assert gradcheck_layer(layer, [x, cont, h0, c0])


def test_lstm_unit_forward_and_gradient():
    N, H = 3, 4
    c_prev = torch.tensor(RNG.normal(size=(1, N, H)))
    gates = torch.tensor(RNG.normal(size=(1, N, 4 * H)))
    cont = torch.tensor([[1.0, 0.0, 1.0]])
    layer, tops = make_layer('name: "u" type: "LSTMUnit" bottom: "c0" bottom: "x" bottom: "cont" '
                             'top: "c" top: "h"', [c_prev.shape, gates.shape, cont.shape])
    assert tops == [(1, N, H), (1, N, H)] and layer.blobs == []
    c, h = layer.forward([c_prev, gates, cont])
    g = gates.numpy()[0]
    i, f, o = sigmoid(g[:, :H]), sigmoid(g[:, H:2 * H]), sigmoid(g[:, 2 * H:3 * H])
    gg = np.tanh(g[:, 3 * H:])
    c_ref = cont.numpy()[0][:, None] * f * c_prev.numpy()[0] + i * gg
    np.testing.assert_allclose(c.numpy()[0], c_ref, rtol=1e-12)
    np.testing.assert_allclose(h.numpy()[0], o * np.tanh(c_ref), rtol=1e-12)
    assert [layer.allow_backward(j) for j in range(3)] == [True, True, False]
    assert gradcheck_layer(layer, [c_prev, gates, cont])


def test_lstm_unit_caffe_gradient_for_fractional_cont():
    # Caffe takes f = cont * sigmoid(x_f) and differentiates it as f * (1 - f): for cont 0.5
    # that is not the true derivative; brewnet reproduces Caffe's number.
    H = 2
    c_prev = torch.tensor(RNG.normal(size=(1, 1, H)))
    gates = torch.tensor(RNG.normal(size=(1, 1, 4 * H)), requires_grad=True)
    c, h = LSTMUnitOp(c_prev, gates, torch.tensor([[0.5]]))
    dc, dh = torch.tensor(RNG.normal(size=(1, 1, H))), torch.tensor(RNG.normal(size=(1, 1, H)))
    torch.autograd.backward([c, h], [dc, dh])
    x = gates.detach().numpy()[0, 0]
    f = 0.5 * sigmoid(x[H:2 * H])
    tanh_c = np.tanh(c.detach().numpy()[0, 0])
    o = sigmoid(x[2 * H:3 * H])
    c_term = dc.numpy()[0, 0] + dh.numpy()[0, 0] * o * (1 - tanh_c ** 2)
    want = c_term * c_prev.numpy()[0, 0] * f * (1 - f)
    np.testing.assert_allclose(gates.grad.numpy()[0, 0, H:2 * H], want, rtol=1e-12)


def test_shape_errors():
    with pytest.raises(LayerError, match="cont must be"):
        make_layer(recurrent_text("LSTM"), [(4, 2, 3), (4, 3)])
    layer, _ = make_layer(recurrent_text("RNN"), [(4, 2, 3), (4, 2)])
    with pytest.raises(LayerError, match="number of timesteps"):
        layer.reshape([(5, 2, 3), (5, 2)])
    assert layer.reshape([(4, 6, 3), (4, 6)]) == [(4, 6, 3)]   # N may change, T may not
    with pytest.raises(LayerError, match="num_output"):
        make_layer('name: "r" type: "RNN" bottom: "x" bottom: "c" top: "y"', [(4, 2, 3), (4, 2)])
    with pytest.raises(LayerError, match="initial hidden state"):
        make_layer(recurrent_text("RNN", expose=True, n_bottoms=3), [(4, 2, 3), (4, 2), (1, 2, 4)])
    with pytest.raises(LayerError, match="gates must be"):
        make_layer('name: "u" type: "LSTMUnit" bottom: "a" bottom: "b" bottom: "c" top: "c1" top: "h"',
                   [(1, 2, 3), (1, 2, 9), (1, 2)])
