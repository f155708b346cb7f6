"""Recurrent layers: RNN, LSTM and the single-step LSTMUnit, with Caffe's exact semantics;
senlinuc/caffe_ocr's Lstm (Junhyuk's LSTM layer) and warp-ctc caffe's ContinuationIndicator,
with their forks'.

The parameter blobs are the learnable params of Caffe's unrolled net, in its order (run here as a
loop over time: docs/internals.md, *Design notes by module*); I = count(x, 2), S = count(x_static, 1):

    RNN:  W_xh (H, I), b_h (H), [W_xh_static (H, S)], W_hh (H, H), W_ho (H, H), b_o (H)
    LSTM: W_xc (4H, I), b_c (4H), [W_xc_static (4H, S)], W_hc (4H, H)     gates i, f, o, g

``cont_t`` multiplies h_{t-1} (and the LSTM's c_{t-1}): 0 starts a new sequence. Without
``expose_hidden`` h_T (c_T) is kept between forwards as in Caffe (cont 1 at t=0 continues the
previous batch; no gradient crosses batches); with it, bottoms h0 [c0] are the initial state and
tops give h_T [c_T], sharing only data as Caffe: no diff reaches h0/c0, diffs to h_T/c_T are ignored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Layer, count
from .data import SourceLayer
from .registry import register


# -- functional core --------------------------------------------------------------------------
class _LSTMUnit(torch.autograd.Function):
    """Caffe's LSTMUnit. The forget gate is f = cont * sigmoid(x_f) (exactly 0 where cont is 0)
    and Caffe's backward uses f * (1 - f) as its derivative: the true one for binary cont, not
    for other values, so the backward is written out."""

    @staticmethod
    def forward(ctx, c_prev, gates, cont):
        i, f, o, g = gates.chunk(4, dim=-1)
        i, o, g = torch.sigmoid(i), torch.sigmoid(o), torch.tanh(g)
        cont = cont.unsqueeze(-1)
        f = torch.where(cont == 0, torch.zeros_like(f), cont * torch.sigmoid(f))
        c = f * c_prev + i * g
        tanh_c = torch.tanh(c)
        ctx.save_for_backward(c_prev, i, f, o, g, tanh_c)
        return c, o * tanh_c

    @staticmethod
    def backward(ctx, dc, dh):
        c_prev, i, f, o, g, tanh_c = ctx.saved_tensors
        c_term = dc + dh * o * (1 - tanh_c * tanh_c)
        dgates = torch.cat([c_term * g * i * (1 - i), c_term * c_prev * f * (1 - f),
                            dh * tanh_c * o * (1 - o), c_term * i * (1 - g * g)], dim=-1)
        return c_term * f, dgates, None


def lstm_unit(c_prev, gates, cont):
    """One LSTM step: ``gates`` (..., 4H) in Caffe's order i, f, o, g; ``cont`` (...) scales the
    forget gate. Returns (c_t, h_t) = (f * c_prev + i * g, o * tanh(c_t))."""
    return _LSTMUnit.apply(c_prev, gates, cont.detach())


def rnn_sequence(x, cont, h0, w_xh, b_h, w_hh, w_ho, b_o, static=None):
    """Caffe's RNN over x (T, N, I): h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ static]),
    o_t = tanh(W_ho h_t + b_o). ``static`` is the (N, H) W_xh_static x_static term.
    Returns (o (T, N, H), h_T (N, H))."""
    wx = torch.nn.functional.linear(x, w_xh, b_h)
    h, hs = h0, []
    for t in range(x.shape[0]):
        pre = (h * cont[t].unsqueeze(-1)) @ w_hh.t() + wx[t]
        if static is not None:
            pre = pre + static
        h = torch.tanh(pre)
        hs.append(h)
    o = torch.tanh(torch.nn.functional.linear(torch.stack(hs), w_ho, b_o))
    return o, h


def lstm_sequence(x, cont, h0, c0, w_xc, b_c, w_hc, static=None):
    """Caffe's LSTM over x (T, N, I): gates_t = W_hc (cont_t h_{t-1}) + W_xc x_t + b_c [+ static],
    then ``lstm_unit``. Returns (h (T, N, H), h_T, c_T)."""
    wx = torch.nn.functional.linear(x, w_xc, b_c)
    h, c, hs = h0, c0, []
    for t in range(x.shape[0]):
        gates = (h * cont[t].unsqueeze(-1)) @ w_hc.t() + wx[t]
        if static is not None:
            gates = gates + static
        c, h = lstm_unit(c, gates, cont[t])
        hs.append(h)
    return torch.stack(hs), h, c


# -- layers -----------------------------------------------------------------------------------
class _Recurrent(Layer):
    """Shared bottom/top handling of Caffe's RecurrentLayer; subclasses give the cell."""

    min_bottoms = 2
    n_state = 1          # recurrent blobs: RNN h; LSTM h and c
    gate_mult = 1        # rows of the weight matrices per hidden unit: RNN 1, LSTM 4
    in_place_ok = False

    def _counts(self, n_bottoms: int) -> tuple[bool, bool]:
        expose = self.param.recurrent_param.expose_hidden
        static = n_bottoms > 2 + (self.n_state if expose else 0)
        return expose, static

    def allow_backward(self, i: int) -> bool:
        # cont and the exposed initial states get no diff; x and x_static do.
        _, static = self._counts(len(self.param.bottom))
        return i == 0 or (static and i == 2)

    def setup(self, bottom_shapes):
        rp = self.param.recurrent_param
        self.hidden = int(rp.num_output)
        if self.hidden <= 0:
            raise self.fail("recurrent_param.num_output must be positive")
        x = bottom_shapes[0]
        if len(x) < 2:
            raise self.fail(f"bottom[0] must have at least 2 axes (T, N, ...), got {tuple(x)}")
        self.T = int(x[0])
        self.expose, self.static = self._counts(len(bottom_shapes))
        n_expected = 2 + self.static + (self.n_state if self.expose else 0)
        if len(bottom_shapes) != n_expected:
            raise self.fail(f"takes x, cont{', x_static' if self.static else ''}"
                            f"{' and the exposed hidden state' if self.expose else ''}: "
                            f"{n_expected} bottoms, got {len(bottom_shapes)}")
        n_tops = 1 + (self.n_state if self.expose else 0)
        if self.num_tops != n_tops:
            raise self.fail(f"needs {n_tops} top(s) (output{' and final state' if self.expose else ''}),"
                            f" got {self.num_tops}")
        static_dim = count(bottom_shapes[2], 1) if self.static else 0
        self.blobs = self.make_blobs(count(x, 2), static_dim)
        self._state = None

    def reshape(self, bottom_shapes):
        x, cont = tuple(bottom_shapes[0]), tuple(bottom_shapes[1])
        if len(x) < 2 or x[0] != self.T:
            raise self.fail(f"bottom[0] must be ({self.T}, N, ...): the number of timesteps is fixed "
                            f"at setup; got {x}")
        n = x[1]
        if cont != (self.T, n):
            raise self.fail(f"cont must be (T, N) = {(self.T, n)}, got {cont} for x {x}")
        if self.static:
            xs = tuple(bottom_shapes[2])
            if len(xs) < 1 or xs[0] != n or count(xs, 1) != self.blobs[2].shape[1]:
                raise self.fail(f"x_static must be (N={n}, {self.blobs[2].shape[1]} values), got {xs}")
        state = (1, n, self.hidden)
        if self.expose:
            for j, s in enumerate(bottom_shapes[2 + self.static:]):
                if tuple(s) != state:
                    raise self.fail(f"bottom[{2 + self.static + j}] (initial hidden state) must be "
                                    f"{state}, got {tuple(s)}")
        return [(self.T, n, self.hidden)] + [state] * (self.n_state if self.expose else 0)

    def reset(self) -> None:
        """Zero the state carried between forward calls (Caffe's ``RecurrentLayer::Reset``)."""
        self._state = None

    def _initial_state(self, bottoms, like):
        n = like.shape[1]
        if self.expose:
            return [b.detach().reshape(n, self.hidden) for b in bottoms[2 + self.static:]]
        if self._state is not None and self._state[0].shape[0] == n:
            return [s.to(like) for s in self._state]
        return [like.new_zeros(n, self.hidden) for _ in range(self.n_state)]

    def forward(self, bottoms):
        x = bottoms[0]
        T, n = x.shape[:2]
        xf = x.reshape(T, n, -1)
        cont = bottoms[1].detach().to(x.dtype)
        static = None
        if self.static:
            static = bottoms[2].reshape(n, -1) @ self.blobs[2].t()
        out, *final = self.run(xf, cont, self._initial_state(bottoms, x), static)
        final = [f.detach() for f in final]
        if not self.expose:
            self._state = final
            return [out]
        return [out] + [f.reshape(1, n, self.hidden) for f in final]

    def make_blobs(self, input_dim: int, static_dim: int) -> list[torch.Tensor]:
        rp = self.param.recurrent_param
        rows = self.gate_mult * self.hidden
        blobs = [self.new_blob((rows, input_dim), rp.weight_filler),
                 self.new_blob((rows,), rp.bias_filler)]
        if static_dim:
            blobs.append(self.new_blob((rows, static_dim), rp.weight_filler))
        blobs.append(self.new_blob((rows, self.hidden), rp.weight_filler))
        return blobs

    def run(self, x, cont, state, static):
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_output={self.hidden}"


@register("RNN")
class RNN(_Recurrent):
    """Elman RNN with a tanh output layer (Caffe's RNNLayer).

    Bottoms: x (T, N, ...), cont (T, N), [x_static (N, ...)], [h0 (1, N, H) if expose_hidden].
    Tops: o (T, N, H) with o_t = tanh(W_ho h_t + b_o), [h_T (1, N, H) if expose_hidden].
    Params: recurrent_param num_output (H), weight_filler, bias_filler, expose_hidden.
    Blobs: W_xh, b_h, [W_xh_static], W_hh, W_ho, b_o.
    Differs from torch: nn.RNN has no output layer, no cont resets, and two bias vectors.
    """

    def make_blobs(self, input_dim, static_dim):
        rp = self.param.recurrent_param
        return super().make_blobs(input_dim, static_dim) + [
            self.new_blob((self.hidden, self.hidden), rp.weight_filler),
            self.new_blob((self.hidden,), rp.bias_filler)]

    def run(self, x, cont, state, static):
        b = self.blobs
        w_hh, w_ho, b_o = b[-3], b[-2], b[-1]
        return rnn_sequence(x, cont, state[0], b[0], b[1], w_hh, w_ho, b_o, static)


@register("LSTM")
class LSTM(_Recurrent):
    """Long short-term memory over a sequence (Caffe's LSTMLayer), without peepholes.

    Bottoms: x (T, N, ...), cont (T, N), [x_static (N, ...)], [h0, c0 (1, N, H) if expose_hidden].
    Tops: h (T, N, H), [h_T, c_T (1, N, H) if expose_hidden].
    Params: recurrent_param num_output (H), weight_filler, bias_filler, expose_hidden.
    Blobs: W_xc (4H, I), b_c (4H), [W_xc_static (4H, S)], W_hc (4H, H); gate rows i, f, o, g.
    Differs from torch: nn.LSTM orders gates i, f, g, o, has two biases and no cont resets.
    """

    n_state = 2
    gate_mult = 4

    def run(self, x, cont, state, static):
        b = self.blobs
        return lstm_sequence(x, cont, state[0], state[1], b[0], b[1], b[-1], static)


@register("LSTMUnit")
class LSTMUnit(Layer):
    """One LSTM step (Caffe's LSTMUnitLayer), the cell the LSTM layer unrolls.

    Bottoms: c_prev (1, N, H), gates (1, N, 4H) pre-activations in order i, f, o, g, cont (1, N).
    Tops: c (1, N, H) = cont * f * c_prev + i * g, h (1, N, H) = o * tanh(c).
    No params; cont gets no diff. Caffe's backward treats cont * f as the gate (see _LSTMUnit).
    """

    exact_bottoms = 3
    exact_tops = 2
    in_place_ok = False

    def allow_backward(self, i: int) -> bool:
        return i != 2

    def reshape(self, bottom_shapes):
        c, x, cont = (tuple(s) for s in bottom_shapes)
        if len(c) != 3 or c[0] != 1:
            raise self.fail(f"c_prev must be (1, N, H), got {c}")
        n, h = c[1], c[2]
        if x != (1, n, 4 * h) or cont != (1, n):
            raise self.fail(f"with c_prev {c} the gates must be {(1, n, 4 * h)} and cont {(1, n)}; "
                            f"got gates {x}, cont {cont}")
        return [c, c]

    def forward(self, bottoms):
        c_prev, gates, cont = bottoms
        return list(lstm_unit(c_prev, gates, cont.detach().to(gates.dtype)))


@register("Lstm")
class Lstm(Layer):
    """caffe_ocr's Lstm (Junhyuk Oh's LSTM, lstm_layer_Junhyuk.cpp/.cu; not BVLC's ``LSTM``).

    Bottom x (T, N, I) -> top h (T, N, H), H = lstm_param.num_output. Blobs: W_i (4H, I),
    W_h (4H, H), b (4H), gates in the order i, f, o, g. For each t, with h_0 = c_0 = 0:

        a_t = W_i x_t + b + [t > 0] W_h h_{t-1}
        i, f, o = sigmoid(a_i, a_f, a_o), g = tanh(a_g), f = 0 at t = 0
        c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)

    Backward: autograd, the fork's formula; with clipping_threshold > 0 the gradient of each a_t is
    bounded to [-threshold, threshold] before it goes on (to W_i, W_h, b, x and h_{t-1}), as the
    fork does. The fork's CPU forward adds sample 0's W_h h_{t-1} to every sample of a batch (it
    never advances that pointer); its GPU forward, followed here, adds each sample's own; they
    agree for N = 1. The fork's optional second bottom (a clip blob continuing the previous
    forward's state) is not supported: its deploy nets have one bottom.
    """

    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def setup(self, bottom_shapes):
        p = self.param.lstm_param
        x = tuple(bottom_shapes[0])
        if len(x) < 3:
            raise self.fail(f"needs a (T, N, I) bottom, got {x}")
        self.hidden = int(p.num_output)
        if self.hidden <= 0:
            raise self.fail("lstm_param.num_output must be > 0")
        self.input_dim = int(x[2])
        h = self.hidden
        self.blobs = [self.new_blob((4 * h, self.input_dim), p.weight_filler),
                      self.new_blob((4 * h, h), p.weight_filler),
                      self.new_blob((4 * h,), p.bias_filler)]
        self.clipping_threshold = float(p.clipping_threshold)

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) < 3 or x[2] != self.input_dim or count(x, 2) != x[2]:
            raise self.fail(f"bottom {x} is not (T, N, {self.input_dim})")
        return [(x[0], x[1], self.hidden)]

    def forward(self, bottoms):
        x = bottoms[0]
        steps, n = x.shape[0], x.shape[1]
        w_i, w_h, b = self.blobs
        pre = F.linear(x.reshape(steps, n, -1), w_i, b)
        thr = self.clipping_threshold
        hs, h, c = [], None, None
        for t in range(steps):
            a = pre[t] if t == 0 else pre[t] + F.linear(h, w_h)
            if thr > 0 and a.requires_grad:
                a.register_hook(lambda d: d.clamp(-thr, thr))
            a_i, a_f, a_o, a_g = a.chunk(4, dim=-1)
            i, o, g = torch.sigmoid(a_i), torch.sigmoid(a_o), torch.tanh(a_g)
            c = i * g if t == 0 else torch.sigmoid(a_f) * c + i * g
            h = o * torch.tanh(c)
            hs.append(h)
        return [torch.stack(hs)]

    def flops(self, bottom_shapes, top_shapes):
        steps, n = bottom_shapes[0][:2]
        return 2 * steps * n * 4 * self.hidden * (self.input_dim + self.hidden)

    def extra_repr(self):
        return f"hidden={self.hidden}, input={self.input_dim}"


@register("ContinuationIndicator")
class ContinuationIndicator(SourceLayer):
    """warp-ctc caffe's ContinuationIndicator (xmfbit/warpctc-caffe): no bottom; top
    (time_step, batch_size), 0 at t = 0 and 1 after: the sequence-continuation input of LSTM."""

    exact_tops = 1
    arithmetic = "exact"

    def setup(self, bottom_shapes):
        p = self.param.continuation_indicator_param
        self.shape = (p.time_step, p.batch_size)
        if p.batch_size <= 0:
            raise self.fail("The batch size should be greater than 0.")
        if p.time_step <= 0:
            raise self.fail("The time step should be greater than 0.")

    def reshape(self, bottom_shapes):
        return [self.shape]

    def forward(self, bottoms):
        top = torch.ones(self.shape, dtype=self.dtype, device=self.device)
        top[0] = 0
        return [top]
