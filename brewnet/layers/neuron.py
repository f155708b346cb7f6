"""Neuron layers: elementwise maps with one bottom and one top of the same shape.

The math lives in the module-level functions (each takes a tensor and plain numbers); the layer
classes only read their params. Constants derived from float params are rounded to float32 as
Caffe computes them in ``Dtype``. Where autograd's derivative at a kink differs from Caffe's
(ReLU/PReLU/ELU at 0, Clip at its bounds, BNLL at 0) the forward is written so that autograd
picks Caffe's branch; the tests check those points.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from .base import Layer
from .functional import grad_needed
from .registry import register


def f32(v: float) -> float:
    """``v`` rounded to float32, as Caffe stores layer constants."""
    return float(np.float32(v))


# -- functional core --------------------------------------------------------------------------
def relu(x, negative_slope: float = 0.0):
    # Caffe's backward uses x > 0, else slope: leaky_relu and relu use the same test.
    return torch.relu(x) if negative_slope == 0 else F.leaky_relu(x, negative_slope)


# torch's PReLU on NHWC memory vectorises along the channels: with a channel count that is not
# a multiple of 4 its loops run scalar (MTCNN P-Net's 10 channels, 238x318: 497 us). Such a
# tensor is taken as rows of W*C values with the slopes tiled along a row: 153 us, the same bits
# (benchmarks/inference_kernels.py, AVX-512: 3-20x from 2^16 elements under 16 channels; at
# 2^15-2^16 a few microseconds either way).
PRELU_ROWS_MIN = 1 << 15
PRELU_ROWS_CHANNELS = 16


def _prelu_rows_ok(x, slope) -> bool:
    if torch.compiler.is_compiling() or x.dim() != 4 or x.device.type != "cpu":
        return False                   # (a traced graph keeps torch's op; its batch stays symbolic)
    return (x.shape[1] % 4 and 1 < x.shape[1] < PRELU_ROWS_CHANNELS and slope.numel() == x.shape[1]
            and x.numel() >= PRELU_ROWS_MIN and x.is_contiguous(memory_format=torch.channels_last)
            and not x.is_contiguous())


def prelu(x, slope):
    """``slope`` is a scalar tensor or one value per channel (axis 1).

    Without a gradient: torch.prelu, one pass. Its value is the where-form's bit for bit,
    x > 0 ? x : slope * x, signed zeros and NaN included, which is Caffe's
    max(x, 0) + slope * min(x, 0) except the sign of a zero result: x = +0 with a negative slope
    gives -0 where Caffe gives +0 (both forms; they compare equal). NaN in x or slope gives NaN
    as in Caffe."""
    if (x.dim() >= 2 and slope.dtype == x.dtype and slope.device == x.device
            and not grad_needed(x, slope)):
        if _prelu_rows_ok(x, slope):
            n, c, h, w = x.shape
            rows = x.permute(0, 2, 3, 1).reshape(n * h, w * c)        # NHWC memory: a view
            tiled = slope.reshape(1, c).expand(w, c).reshape(-1)
            return F.prelu(rows, tiled).view(n, h, w, c).permute(0, 3, 1, 2)
        return F.prelu(x, slope)
    if slope.dim() == 1:
        slope = slope.view((1, -1) + (1,) * (x.dim() - 2))
    # where(x > 0, ...) gives the slope branch (and a slope diff of 0) at x == 0, as Caffe.
    return torch.where(x > 0, x, x * slope)


def elu(x, alpha: float = 1.0):
    # exp(x) - 1 (not expm1) as Caffe; min(x, 0) keeps the unused branch finite.
    neg = alpha * (torch.exp(torch.clamp(x, max=0)) - 1)
    return torch.where(x > 0, x, neg)


def bnll(x):
    # Caffe: log(1 + e^x), stable; its gradient e^min(x,50) / (e^min(x,50) + 1) is softplus'.
    return F.softplus(x, beta=1.0, threshold=50.0)


def power(x, p: float = 1.0, scale: float = 1.0, shift: float = 0.0):
    """(shift + scale * x) ** p, with Caffe's special cases."""
    if p * scale == 0:  # input ignored: 1 if p == 0 else shift ** p; zero gradient
        value = 1.0 if p == 0 else f32(math.pow(shift, p))
        return torch.full_like(x.detach(), value)
    y = x
    if scale != 1:
        y = y * scale
    if shift != 0:
        y = y + shift
    return y if p == 1 else torch.pow(y, p)


def exp(x, base: float = -1.0, scale: float = 1.0, shift: float = 0.0):
    """base ** (shift + scale * x); base -1 means e."""
    log_base = 1.0 if base == -1 else f32(math.log(base))
    inner = f32(log_base * scale)
    outer = 1.0 if shift == 0 else f32(math.exp(shift) if base == -1 else math.pow(base, shift))
    y = torch.exp(x * inner if inner != 1 else x)
    return y if outer == 1 else y * outer


def log(x, base: float = -1.0, scale: float = 1.0, shift: float = 0.0):
    """log_base(shift + scale * x); base -1 means e."""
    y = x * scale if scale != 1 else x
    if shift != 0:
        y = y + shift
    y = torch.log(y)
    base_scale = 1.0 if base == -1 else f32(1.0 / f32(math.log(base)))
    return y if base_scale == 1 else y * base_scale


def swish(x, beta: float = 1.0):
    return x * torch.sigmoid(x * beta if beta != 1 else x)


def dropout(x, ratio: float, train: bool, scale_train: bool = True):
    """Inverted dropout: keep with probability 1 - ratio and scale by 1 / (1 - ratio).
    ``scale_train=False`` (caffe-fast-rcnn's field): TRAIN keeps values unscaled, TEST
    multiplies by 1 - ratio (Caffe's 1 / scale in float32)."""
    scale = f32(1.0 / f32(1.0 - ratio))
    if not train:
        return x if scale_train else x * f32(1.0 / scale)
    keep = torch.empty_like(x).bernoulli_(1.0 - ratio)
    return x * (keep * scale) if scale_train else x * keep


# -- layers -----------------------------------------------------------------------------------
class Neuron(Layer):
    """Base for elementwise layers: one bottom, one top shaped like it."""

    arithmetic = "elementwise"
    exact_bottoms = 1
    exact_tops = 1


@register("ReLU")
class ReLU(Neuron):
    """max(x, 0) + negative_slope * min(x, 0). Shapes: any -> same.
    Params: relu_param.negative_slope. Gradient: x > 0 ? 1 : slope (so slope at x == 0)."""

    def forward(self, bottoms):
        return [relu(bottoms[0], f32(self.param.relu_param.negative_slope))]


@register("PReLU")
class PReLU(Neuron):
    """ReLU with learned negative slopes, one per channel (axis 1) or one shared.
    Shapes: (N, C, ...) -> same. Params: prelu_param.filler (default constant 0.25),
    channel_shared. Blob: slopes (C,), or a 0-D scalar when channel_shared (as Caffe)."""

    arithmetic = "reduction"     # the slope gradient sums over N, H, W

    def setup(self, bottom_shapes):
        if len(bottom_shapes[0]) < 2:
            raise self.fail(f"bottom must have at least 2 axes, got shape {bottom_shapes[0]}")
        p = self.param.prelu_param
        filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant", value=0.25)
        self.channels = bottom_shapes[0][1]
        self.blobs = [self.new_blob(() if p.channel_shared else (self.channels,), filler)]

    def reshape(self, bottom_shapes):
        s = bottom_shapes[0]
        if len(s) < 2 or (not self.param.prelu_param.channel_shared and s[1] != self.channels):
            raise self.fail(f"bottom shape {s} does not match {self.channels} channels")
        return [tuple(s)]

    def forward(self, bottoms):
        return [prelu(bottoms[0], self.blobs[0])]


@register("ELU")
class ELU(Neuron):
    """x > 0 ? x : alpha * (exp(x) - 1). Shapes: any -> same. Params: elu_param.alpha."""

    def forward(self, bottoms):
        return [elu(bottoms[0], f32(self.param.elu_param.alpha))]


@register("Sigmoid")
class Sigmoid(Neuron):
    """1 / (1 + exp(-x)). Shapes: any -> same."""

    def forward(self, bottoms):
        return [torch.sigmoid(bottoms[0])]


@register("TanH")
class TanH(Neuron):
    """tanh(x). Shapes: any -> same."""

    def forward(self, bottoms):
        return [torch.tanh(bottoms[0])]


@register("AbsVal")
class AbsVal(Neuron):
    """|x|; gradient sign(x) with sign(0) = 0. Shapes: any -> same."""

    def forward(self, bottoms):
        return [torch.abs(bottoms[0])]


@register("BNLL")
class BNLL(Neuron):
    """Binomial normal log likelihood log(1 + exp(x)), computed stably. Shapes: any -> same.
    Differs from torch: softplus with threshold 50, Caffe's cut-off for the gradient."""

    def forward(self, bottoms):
        return [bnll(bottoms[0])]


@register("Power")
class Power(Neuron):
    """(shift + scale * x) ** power. Shapes: any -> same. Params: power_param.{power, scale,
    shift}. power * scale == 0 gives a constant top (1 if power == 0, else shift ** power) with
    zero gradient, as Caffe. Differs from Caffe: where its backward formula p * y / x divides
    0 by 0 (base 0) this gives autograd's derivative instead of NaN."""

    def forward(self, bottoms):
        p = self.param.power_param
        return [power(bottoms[0], f32(p.power), f32(p.scale), f32(p.shift))]


def _check_base(layer, base: float) -> None:
    if base != -1 and base <= 0:
        raise layer.fail(f"base must be strictly positive (or -1 for e), got {base}")


@register("Exp")
class Exp(Neuron):
    """base ** (shift + scale * x), base -1 = e. Shapes: any -> same.
    Params: exp_param.{base, scale, shift}; base must be positive (or -1)."""

    def setup(self, bottom_shapes):
        _check_base(self, self.param.exp_param.base)

    def forward(self, bottoms):
        p = self.param.exp_param
        return [exp(bottoms[0], f32(p.base), f32(p.scale), f32(p.shift))]


@register("Log")
class Log(Neuron):
    """log_base(shift + scale * x), base -1 = e. Shapes: any -> same.
    Params: log_param.{base, scale, shift}; base must be positive (or -1)."""

    def setup(self, bottom_shapes):
        _check_base(self, self.param.log_param.base)

    def forward(self, bottoms):
        p = self.param.log_param
        return [log(bottoms[0], f32(p.base), f32(p.scale), f32(p.shift))]


@register("Threshold")
class Threshold(Neuron):
    """x > threshold ? 1 : 0 (strict). Shapes: any -> same. Params: threshold_param.threshold.
    No backward (Caffe has none): the top is not connected to the graph."""

    def allow_backward(self, bottom_index):
        return False

    def forward(self, bottoms):
        x = bottoms[0]
        return [(x.detach() > f32(self.param.threshold_param.threshold)).to(x.dtype)]


@register("Clip")
class Clip(Neuron):
    """min(max(x, min), max). Shapes: any -> same. Params: clip_param.{min, max} (required).
    Gradient passes where min <= x <= max (both ends included), as Caffe and torch.clamp."""

    def setup(self, bottom_shapes):
        p = self.param.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            raise self.fail("clip_param needs both min and max")
        if p.min > p.max:
            raise self.fail(f"clip_param min {p.min} is greater than max {p.max}")

    def forward(self, bottoms):
        p = self.param.clip_param
        return [torch.clamp(bottoms[0], f32(p.min), f32(p.max))]


@register("Swish")
class Swish(Neuron):
    """x * sigmoid(beta * x). Shapes: any -> same. Params: swish_param.beta."""

    def forward(self, bottoms):
        return [swish(bottoms[0], f32(self.param.swish_param.beta))]


@register("ReLU6")
class ReLU6(Neuron):
    """min(max(x, 0) + negative_slope * min(x, 0), 6) (MobileNet-YOLO's ReLU6). Shapes: any ->
    same. Params: relu6_param.negative_slope (0). Gradient: (x > 0 ? 1 : slope) where x < 6,
    0 from 6 on (so at 0 the slope, at 6 zero, as the fork)."""

    def forward(self, bottoms):
        x = bottoms[0]
        slope = f32(self.param.relu6_param.negative_slope)
        # torch.where picks the fork's branch at the kinks: x == 0 -> slope, x == 6 -> 0
        y = relu(x, slope)
        return [torch.where(x < 6, y, torch.full_like(y, 6.0).detach())]


@register("Dropout")
class Dropout(Neuron):
    """TRAIN: x * Bernoulli(1 - ratio) mask / (1 - ratio); TEST: identity. Shapes: any -> same.
    Params: dropout_param.dropout_ratio in (0, 1), scale_train (the fork field: false moves the
    scaling to TEST, x * (1 - ratio)), sample_weights_test (caffe-segnet's: TEST drops as TRAIN
    does, Bayesian SegNet's Monte-Carlo dropout). The phase is the layer's (net's) phase."""

    def setup(self, bottom_shapes):
        r = self.param.dropout_param.dropout_ratio
        if not 0 < r < 1:
            raise self.fail(f"dropout_ratio must be in (0, 1), got {r}")

    def forward(self, bottoms):
        ratio = f32(self.param.dropout_param.dropout_ratio)
        p = self.param.dropout_param
        return [dropout(bottoms[0], ratio, self.phase == pb.TRAIN or p.sample_weights_test,
                        p.scale_train)]


@register("SpatialDropout")
class SpatialDropout(Neuron):
    """ENet's SpatialDropout, its Python layer built in (TimoSaemann/caffe-enet 22d356c,
    python/spatial_dropout.py, SpatialDropoutLayer). TRAIN: whole channels dropped, a Bernoulli(1 - p)
    keep draw per (sample, channel), x * keep * 1/(1-p); any other phase: x * 1/(1-p) (the fork's
    code scales at TEST too, so its deploy outputs are not the identity's). Shapes: (N, C, ...) ->
    same. Params: dropout_param.dropout_ratio (its ``p``, in (0, 1)). The phase is the layer's;
    ENet's Python layer takes it from its param_str (python.py maps it).
    Differs from the fork: the gradient is x's true one, each sample through its own mask (the
    fork's backward reuses the last sample's mask for every sample of the batch)."""

    def setup(self, bottom_shapes):
        r = self.param.dropout_param.dropout_ratio
        if not 0 < r < 1:
            raise self.fail(f"p (dropout_ratio) must be between 0 and 1, got {r}")
        if len(bottom_shapes[0]) < 2:
            raise self.fail(f"bottom must have a channel axis, got shape {bottom_shapes[0]}")

    def forward(self, bottoms):
        x = bottoms[0]
        p = float(self.param.dropout_param.dropout_ratio)
        scale = f32(1.0 / (1.0 - p))
        if self.phase != pb.TRAIN:
            return [x * scale]
        keep = torch.empty(x.shape[:2] + (1,) * (x.dim() - 2), dtype=x.dtype,
                           device=x.device).bernoulli_(1.0 - p)
        return [x * (keep * scale)]
