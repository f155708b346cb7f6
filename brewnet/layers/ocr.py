"""senlinuc/caffe_ocr's layers (CNN + BLSTM + CTC text recognition): Transpose, Reverse, Lstm,
CTCGreedyDecoder and DenseBlock, each with the fork's own semantics, read from its source
(github.com/senlinuc/caffe_ocr at 81642f61ea8f888e360cca30e08e05b7bc6d4556,
src/caffe/layers/{transpose,reverse,lstm_layer_Junhyuk,ctc_decoder,DenseBlock}_layer.cpp/.cu).

Where the fork's CPU and GPU code disagree, brewnet follows the GPU code: the fork's published
OCR models were trained and timed on the GPU (its README: "densenet ... CPU N/A"), and the CPU
code has bugs there (noted at each layer). Where they agree, both are the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from .base import Layer, count
from .registry import register
from .shape import Rearrange


@register("Transpose")
class Transpose(Rearrange):
    """caffe_ocr's Transpose: top axis i is bottom axis dim[i] (transpose_layer.cpp's
    transpose_cpu: to_index = sum_i from_inds[dim[i]] * to_counts[i]).

    Bottom of any rank -> top of the same rank. Params: transpose_param.dim (one per bottom axis,
    a permutation). Gradient: the inverse permutation.
    """

    def setup(self, bottom_shapes):
        self.dims = [int(d) for d in self.param.transpose_param.dim]
        if sorted(self.dims) != list(range(len(self.dims))):
            raise self.fail(f"transpose_param.dim {self.dims} is not a permutation of 0..{len(self.dims) - 1}")

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != len(self.dims):
            raise self.fail(f"transpose_param has {len(self.dims)} dims for a {len(shape)}-D bottom {shape}")
        return [tuple(shape[d] for d in self.dims)]

    def forward(self, bottoms):
        return [bottoms[0].permute(self.dims).contiguous()]

    def extra_repr(self):
        return f"dims={self.dims}"


@register("Reverse")
class Reverse(Rearrange):
    """caffe_ocr's Reverse: the bottom flipped along reverse_param.axis (default 0, the time axis;
    the fork requires 0 <= axis < num_axes, no negative axes). Top shaped as the bottom, never in
    place. Gradient: the same flip (reverse_layer.cpp's Backward_cpu)."""

    def setup(self, bottom_shapes):
        self.axis = self.param.reverse_param.axis
        if self.axis < 0:
            raise self.fail(f"reverse_param.axis must be >= 0, got {self.axis}")

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if self.axis >= len(shape):
            raise self.fail(f"axis {self.axis} out of range for a {len(shape)}-D bottom {shape}")
        return [shape]

    def forward(self, bottoms):
        return [bottoms[0].flip(self.axis)]

    def extra_repr(self):
        return f"axis={self.axis}"


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


@register("CTCGreedyDecoder")
class CTCGreedyDecoder(Layer):
    """caffe_ocr's CTCGreedyDecoder (ctc_decoder_layer.cpp): per sample and step the first class
    of highest score; a class equal to the previous step's (ctc_merge_repeated) or to blank_index
    (negative: the last class; default 0) is dropped.

    Bottom x (T, N, C, ...) (the C values read at each (t, n) are the first C of its row, as
    the fork's offset(t, n)) -> top (N, T, 1, 1): each sample's classes, then -1. With a second
    bottom, labels (N, L, ...) (a label < 0 ends a sample's; blank labels are skipped; each is
    rounded as int(0.5 + v)), the top is instead (1, 2, 1, 1): [1 - mean over samples of
    edit distance / max(len(label), len(decoded)), fraction of samples decoded exactly] (a sample
    with both empty counts as 0 distance but not as exact, as in the fork). No backward.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    arithmetic = "exact"

    def allow_backward(self, bottom_index):
        return False

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) < 3:
            raise self.fail(f"needs a (T, N, C) bottom, got {x}")
        if len(bottom_shapes) == 2:
            lab = tuple(bottom_shapes[1])
            if len(lab) < 2 or lab[0] != x[1]:
                raise self.fail(f"labels {lab} are not (N, L) for N = {x[1]}")
            return [(1, 2, 1, 1)]
        return [(x[1], x[0], 1, 1)]

    def _blank(self, classes: int) -> int:
        b = self.param.ctc_decoder_param.blank_index
        return classes - 1 if b < 0 else b

    def decode(self, x: torch.Tensor) -> list[list[int]]:
        """Each sample's decoded classes."""
        steps, n, classes = x.shape[:3]
        best = x.detach().reshape(steps, n, -1)[:, :, :classes].argmax(-1)   # first max, as the fork
        prev = torch.cat([torch.full_like(best[:1], -1), best[:-1]])
        keep = best != self._blank(classes)
        if self.param.ctc_decoder_param.ctc_merge_repeated:
            keep &= best != prev
        best, keep = best.t().tolist(), keep.t().tolist()
        return [[c for c, k in zip(row, ks) if k] for row, ks in zip(best, keep)]

    def forward(self, bottoms):
        x = bottoms[0]
        steps, n, classes = x.shape[:3]
        seqs = self.decode(x)
        if len(bottoms) == 1:
            out = torch.full((n, steps), -1.0, dtype=x.dtype)
            for i, s in enumerate(seqs):
                out[i, :len(s)] = torch.tensor(s, dtype=x.dtype)
            return [out.reshape(n, steps, 1, 1).to(x.device)]
        lab = bottoms[1].detach()
        lab = lab.reshape(lab.shape[0], lab.shape[1], -1)[:, :, 0].double().tolist()
        blank = self._blank(classes)
        acc_edit, exact = 0.0, 0
        for row, s in zip(lab, seqs):
            target = []
            for v in row:
                if v < 0:
                    break
                if int(0.5 + v) != blank:
                    target.append(int(0.5 + v))
            if not target and not s:
                continue
            d = edit_distance(target, s)
            acc_edit += d / max(len(target), len(s))
            exact += d == 0
        out = torch.tensor([1 - acc_edit / n, exact / n], dtype=x.dtype, device=x.device)
        return [out.reshape(1, 2, 1, 1)]


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance (CTCDecoderLayer::EditDistance)."""
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        diag, row[0] = row[0], i
        for j in range(1, len(b) + 1):
            diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1]))
    return row[-1]


@register("DenseBlock")
class DenseBlock(Layer):
    """caffe_ocr's DenseBlock (the memory-efficient DenseNet block, DenseBlock_layer.cpp/.cu).

    Bottom (N, C0, H, W) -> top (N, C0 + T G, H, W), T = numTransition, G = growthRate. Each
    transition appends G channels computed from all channels so far:
    BN-ReLU-Conv3x3 (use_BC: BN-ReLU-Conv1x1 to 4G-BN-ReLU-Conv3x3). The fork ignores initChannel
    (C0 is the bottom's channels) and the pad/stride/filter fields: 3x3 filters, pad 1, stride 1,
    no bias, applied as a true convolution (cuDNN's CUDNN_CONVOLUTION mode and the CPU loop both
    flip the kernel, unlike Caffe's Convolution). BN: scale * (x - mean) / sqrt(var + 1e-5) + bias
    per channel, eps = the fork's bundled cuDNN's CUDNN_BN_MIN_EPSILON.

    Blobs, in the fork's order (i = 0..T-1): [i] 3x3 filters (G, C_i or 4G, 3, 3); [T+i] BN scale,
    [2T+i] BN bias, [3T+i] mean, [4T+i] variance (1, C_i, 1, 1), C_i = C0 + i G; with use_BC also
    [5T+i] 1x1 filters (4G, C_i, 1, 1), [6T+i..9T+i] the second BN's scale, bias, mean, variance
    (1, 4G, 1, 1); last, one (1,) blob the GPU code never uses (not learnable, as means/variances).
    TEST uses mean and variance as stored (the GPU code; the CPU code divides them by that last
    blob, which GPU training leaves 0, so it cannot run the published models). TRAIN normalizes
    with the batch's biased variance and updates mean/var in place as cuDNN with factor
    moving_average_fraction (f): mean = f * batch mean + (1 - f) * mean, var likewise with the
    unbiased batch variance; use_dropout drops each transition's new channels (dropout_amount).
    """

    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False
    eps = 1e-5

    def setup(self, bottom_shapes):
        p = self.param.denseblock_param
        x = tuple(bottom_shapes[0])
        if len(x) != 4:
            raise self.fail(f"needs an (N, C, H, W) bottom, got {x}")
        self.transitions, self.growth, self.bc = int(p.numTransition), int(p.growthRate), p.use_BC
        if self.transitions <= 0 or self.growth <= 0:
            raise self.fail("numTransition and growthRate must be > 0")
        self.channels = int(x[1])
        n_t, g = self.transitions, self.growth
        stat = dict(requires_grad=False)
        blobs: list = [None] * ((10 if self.bc else 5) * n_t + 1)
        const = pb.FillerParameter(type="constant", value=1)
        for i in range(n_t):
            c = self.channels + i * g
            blobs[i] = self.new_blob((g, 4 * g if self.bc else c, 3, 3), p.Filter_Filler)
            blobs[n_t + i] = self.new_blob((1, c, 1, 1), p.BN_Scaler_Filler)
            blobs[2 * n_t + i] = self.new_blob((1, c, 1, 1), p.BN_Bias_Filler)
            blobs[3 * n_t + i] = self.new_blob((1, c, 1, 1)).requires_grad_(**stat)
            blobs[4 * n_t + i] = self.new_blob((1, c, 1, 1), const).requires_grad_(**stat)
            if self.bc:
                blobs[5 * n_t + i] = self.new_blob((4 * g, c, 1, 1), p.Filter_Filler)
                blobs[6 * n_t + i] = self.new_blob((1, 4 * g, 1, 1), p.BN_Scaler_Filler)
                blobs[7 * n_t + i] = self.new_blob((1, 4 * g, 1, 1), p.BN_Bias_Filler)
                blobs[8 * n_t + i] = self.new_blob((1, 4 * g, 1, 1)).requires_grad_(**stat)
                blobs[9 * n_t + i] = self.new_blob((1, 4 * g, 1, 1), const).requires_grad_(**stat)
        blobs[-1] = self.new_blob((1,)).requires_grad_(**stat)
        self.blobs = blobs

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) != 4 or x[1] != self.channels:
            raise self.fail(f"bottom {x} is not (N, {self.channels}, H, W)")
        return [(x[0], self.channels + self.transitions * self.growth, x[2], x[3])]

    def _bn(self, x, scale, bias, mean, var):
        if self.phase == pb.TEST:
            m, v = mean.detach().reshape(1, -1, 1, 1), var.detach().reshape(1, -1, 1, 1)
        else:
            m = x.mean((0, 2, 3), keepdim=True)
            v = (x - m).square().mean((0, 2, 3), keepdim=True)
            k = x.numel() // x.shape[1]
            f = self.param.denseblock_param.moving_average_fraction
            with torch.no_grad():
                mean.mul_(1 - f).add_(m.detach().to(mean.dtype).reshape(mean.shape), alpha=f)
                var.mul_(1 - f).add_(v.detach().to(var.dtype).reshape(var.shape),
                                     alpha=f * (k / (k - 1) if k > 1 else 1.0))
        y = (x - m.to(x.dtype)) / torch.sqrt(v.to(x.dtype) + self.eps)
        return y * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)

    def forward(self, bottoms):
        feats = bottoms[0]
        n_t, b = self.transitions, self.blobs
        p = self.param.denseblock_param
        for i in range(n_t):
            y = F.relu(self._bn(feats, b[n_t + i], b[2 * n_t + i], b[3 * n_t + i], b[4 * n_t + i]))
            if self.bc:
                y = F.conv2d(y, b[5 * n_t + i])
                y = F.relu(self._bn(y, b[6 * n_t + i], b[7 * n_t + i], b[8 * n_t + i], b[9 * n_t + i]))
            y = F.conv2d(y, b[i].flip((2, 3)), padding=1)
            if self.phase == pb.TRAIN and p.use_dropout and p.dropout_amount > 0:
                y = F.dropout(y, p.dropout_amount, training=True)
            feats = torch.cat([feats, y], 1)
        return [feats]

    def flops(self, bottom_shapes, top_shapes):
        n, _, h, w = bottom_shapes[0]
        g, total = self.growth, 0
        for i in range(self.transitions):
            c = self.channels + i * g
            total += 2 * n * h * w * 9 * g * (4 * g if self.bc else c)
            if self.bc:
                total += 2 * n * h * w * c * 4 * g
        return total

    def extra_repr(self):
        return f"transitions={self.transitions}, growth={self.growth}, bc={self.bc}"
