"""Normalization layers: BatchNorm, Scale, Bias, MVN, and the SSD fork's L2 Normalize, with Caffe's
exact statistics and gradients.

The math lives in module-level functions (``batch_norm``, ``mvn``, ``broadcast_param``) so it can be
tested without building a layer.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from .base import Layer, Shape, canonical_axis, count
from .registry import register

log = logging.getLogger("brewnet")


# -- functional core -------------------------------------------------------------------------------
def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(C,) -> (1, C, 1, ...) for an ndim-D input; a 1-D input has one channel."""
    return t.reshape((1, -1) + (1,) * (ndim - 2)) if ndim >= 2 else t.reshape(-1)


def batch_norm(x: torch.Tensor, mean_blob: torch.Tensor, var_blob: torch.Tensor,
               factor_blob: torch.Tensor, use_global_stats: bool, maf: float,
               eps: float) -> torch.Tensor:
    """Caffe's BatchNorm: y = (x - mean) / sqrt(var + eps) per channel (axis 1).

    Global stats: mean = mean_blob / factor, var = var_blob / factor (factor 0 -> 0).
    Batch stats: biased mean/var over all axes but 1, and the running blobs are updated in place,
    outside autograd: factor = maf*factor + 1, mean_blob = mean + maf*mean_blob,
    var_blob = m/(m-1)*var + maf*var_blob with m = count / C.
    """
    dims = [d for d in range(x.dim()) if d != 1]
    if use_global_stats:
        f = factor_blob.detach().reshape(())
        s = torch.where(f == 0, torch.zeros_like(f), 1 / f)
        mean = (mean_blob.detach() * s).to(x.dtype)
        var = (var_blob.detach() * s).to(x.dtype)
        if x.dim() >= 2:  # one fused kernel; (x - mean) * rsqrt(var + eps) is within an ulp
            return F.batch_norm(x, mean, var, None, None, False, 0.0, eps)
    else:
        mean = x.mean(dims)
        var = (x - _channel_view(mean, x.dim())).square().mean(dims)
        m = x.numel() // max(mean.numel(), 1)
        correction = m / (m - 1) if m > 1 else 1.0
        with torch.no_grad():
            factor_blob.mul_(maf).add_(1)
            mean_blob.mul_(maf).add_(mean.detach().to(mean_blob.dtype))
            var_blob.mul_(maf).add_(var.detach().to(var_blob.dtype), alpha=correction)
    std = torch.sqrt(_channel_view(var, x.dim()) + eps)
    return (x - _channel_view(mean, x.dim())) / std


class _MVNNormalize(torch.autograd.Function):
    """Rows of x -> (x - mean) / (std + eps), with Caffe's backward
    (dy - mean(dy) - mean(dy*y)*y) / (std + eps). That is the true derivative only for eps = 0:
    the exact one would use (x - mean)/std where Caffe uses y."""

    @staticmethod
    def forward(ctx, x, eps):
        centered = x - x.mean(1, keepdim=True)
        denom = centered.square().mean(1, keepdim=True).sqrt() + eps
        y = centered / denom
        ctx.save_for_backward(y, denom)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, denom = ctx.saved_tensors
        dx = dy - dy.mean(1, keepdim=True) - (dy * y).mean(1, keepdim=True) * y
        return dx / denom, None


def mvn(x: torch.Tensor, normalize_variance: bool = True, across_channels: bool = False,
        eps: float = 1e-9) -> torch.Tensor:
    """Caffe's MVN: subtract the mean per (n, c) (per n if across_channels); optionally divide by
    the standard deviation plus eps (eps on the std, not the variance)."""
    rows = x.shape[0] if across_channels or x.dim() < 2 else x.shape[0] * x.shape[1]
    flat = x.reshape(rows, -1)
    if normalize_variance:
        out = _MVNNormalize.apply(flat, eps)
    else:
        out = flat - flat.mean(1, keepdim=True)
    return out.reshape(x.shape)


def broadcast_param(t: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    """View a Scale/Bias operand (shape = bottom.shape[axis:axis+k]) so it broadcasts over an
    ndim-D bottom."""
    return t.reshape((1,) * axis + tuple(t.shape) + (1,) * (ndim - axis - t.dim()))


def _operand_axis(layer: Layer, bottom: Sequence[int], operand: Sequence[int], axis: int) -> int:
    """Caffe's Scale/Bias Reshape rule: a 0-D operand applies at axis 0, otherwise at the canonical
    ``axis``; bottom.shape[axis:axis+k] must equal the operand shape."""
    a = 0 if len(operand) == 0 else canonical_axis(axis, len(bottom), layer)
    if tuple(bottom[a:a + len(operand)]) != tuple(operand):
        raise layer.fail(f"operand shape {tuple(operand)} does not match bottom shape "
                         f"{tuple(bottom)} starting at axis {a}")
    return a


def _param_shape(layer: Layer, bottom: Sequence[int], axis: int, num_axes: int) -> Shape:
    """Shape of a learned Scale/Bias blob: bottom.shape[axis : axis+num_axes] (-1: to the end)."""
    if num_axes < -1:
        raise layer.fail(f"num_axes must be non-negative, or -1 to extend to the end of the "
                         f"bottom; got {num_axes}")
    a = canonical_axis(axis, len(bottom), layer)
    if num_axes >= 0 and len(bottom) < a + num_axes:
        raise layer.fail(f"param of {num_axes} axes starting at axis {a} extends past bottom "
                         f"shape {tuple(bottom)}")
    return tuple(bottom[a:]) if num_axes == -1 else tuple(bottom[a:a + num_axes])


# -- layers ----------------------------------------------------------------------------------------
@register("BatchNorm")
class BatchNorm(Layer):
    """Per-channel normalization with batch or stored statistics (Caffe's BatchNorm).

    Bottom (N, C, ...) or (N,) -> top of the same shape. Params: batch_norm_param.use_global_stats
    (default: phase == TEST), moving_average_fraction, eps. Blobs (not learnable, never get
    gradients): [mean sum (C), variance sum (C), scale factor (1)]; TRAIN forward updates them.
    Differs from torch: no affine (use Scale); running blobs are un-normalized sums divided by the
    scale factor; the stored variance is unbiased while the batch is normalized with the biased one.
    """

    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom_shapes):
        p = self.param.batch_norm_param
        self.use_global_stats = (p.use_global_stats if p.HasField("use_global_stats")
                                 else self.phase == pb.TEST)
        self.maf = p.moving_average_fraction
        self.eps = p.eps
        shape = bottom_shapes[0]
        self.channels = int(shape[1]) if len(shape) > 1 else 1
        for i, spec in enumerate(self.param.param):
            if spec.lr_mult != 0:
                raise self.fail(f"cannot configure batch normalization statistics as layer "
                                f"parameters: param {i} has lr_mult {spec.lr_mult}, must be 0")
        self.blobs = [self.new_blob(s).requires_grad_(False)
                      for s in ((self.channels,), (self.channels,), (1,))]

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        channels = shape[1] if len(shape) > 1 else 1
        if channels != self.channels or len(shape) == 0:
            raise self.fail(f"bottom shape {shape} does not have {self.channels} channels on axis 1")
        return [shape]

    def forward(self, bottoms):
        mean, var, factor = self.blobs
        return [batch_norm(bottoms[0], mean, var, factor, self.use_global_stats, self.maf, self.eps)]

    def extra_repr(self):
        return f"channels={self.channels}, use_global_stats={self.use_global_stats}"


@register("Scale")
class Scale(Layer):
    """Elementwise product with a broadcast scale, plus an optional bias (Caffe's Scale).

    Bottoms: x, and optionally the scale s (shape = x.shape[axis:axis+s.dim()], a 0-D s scales
    everything). Top: x's shape. Params: scale_param.axis, num_axes (learned scale only; -1: to the
    end, 0: scalar), filler (default constant 1), bias_term, bias_filler. Blobs: [scale, bias]
    (learned scale: shape x.shape[axis:axis+num_axes]), or [bias] with a bottom scale; the bias
    has the scale's shape.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom_shapes):
        p = self.param.scale_param
        x = bottom_shapes[0]
        self.learned_scale = len(bottom_shapes) == 1
        if self.learned_scale:
            filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant", value=1)
            self.blobs.append(self.new_blob(_param_shape(self, x, p.axis, p.num_axes), filler))
        if p.bias_term:
            num_axes = len(bottom_shapes[1]) if len(bottom_shapes) > 1 else p.num_axes
            self.blobs.append(self.new_blob(_param_shape(self, x, p.axis, num_axes), p.bias_filler))

    def _operands(self, bottoms):
        scale = self.blobs[0] if self.learned_scale else bottoms[1]
        bias = self.blobs[-1] if self.param.scale_param.bias_term else None
        return scale, bias

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        s_shape = tuple(self.blobs[0].shape) if self.learned_scale else tuple(bottom_shapes[1])
        _operand_axis(self, x, s_shape, self.param.scale_param.axis)
        if self.param.scale_param.bias_term:
            _operand_axis(self, x, tuple(self.blobs[-1].shape), self.param.scale_param.axis)
        return [x]

    def forward(self, bottoms):
        x = bottoms[0]
        scale, bias = self._operands(bottoms)
        axis = _operand_axis(self, x.shape, scale.shape, self.param.scale_param.axis)
        scale = broadcast_param(scale, x.dim(), axis)
        if bias is None:
            return [x * scale]
        axis = _operand_axis(self, x.shape, bias.shape, self.param.scale_param.axis)
        # In place on the fresh product: mul saves its inputs, not its output, so autograd is fine.
        return [(x * scale).add_(broadcast_param(bias, x.dim(), axis))]


@register("Bias")
class Bias(Layer):
    """Elementwise sum with a broadcast bias (Caffe's Bias).

    Bottoms: x, and optionally the bias b (shape = x.shape[axis:axis+b.dim()]). Top: x's shape.
    Params: bias_param.axis, num_axes (learned bias only; -1: to the end), filler (default
    constant 0). Blobs: [bias] when there is one bottom.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def setup(self, bottom_shapes):
        p = self.param.bias_param
        if len(bottom_shapes) == 1:
            self.blobs.append(self.new_blob(_param_shape(self, bottom_shapes[0], p.axis, p.num_axes),
                                            p.filler))

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        b = tuple(bottom_shapes[1]) if len(bottom_shapes) > 1 else tuple(self.blobs[0].shape)
        _operand_axis(self, x, b, self.param.bias_param.axis)
        return [x]

    def forward(self, bottoms):
        x = bottoms[0]
        b = bottoms[1] if len(bottoms) > 1 else self.blobs[0]
        axis = _operand_axis(self, x.shape, b.shape, self.param.bias_param.axis)
        return [x + broadcast_param(b, x.dim(), axis)]


@register("MVN")
class MVN(Layer):
    """Mean-variance normalization per (n, c) or per n (Caffe's MVN).

    Bottom (N, C, ...) -> top of the same shape. Params: mvn_param.normalize_variance (true),
    across_channels (false), eps (1e-9).
    Differs from torch: eps is added to the standard deviation, not the variance, and the backward
    is Caffe's formula (exact only for eps = 0).
    """

    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) < 1 or count(shape) == 0:
            raise self.fail(f"bottom shape {shape} is empty")
        return [shape]

    def forward(self, bottoms):
        p = self.param.mvn_param
        return [mvn(bottoms[0], p.normalize_variance, p.across_channels, p.eps)]


class _FeatureNormalize(torch.autograd.Function):
    """happynear's Normalize over axis 1 of (N, C, H, W), with the fork's CPU backward."""

    @staticmethod
    def forward(ctx, x, l1, bp_norm):
        norm = (x.abs() if l1 else x * x).sum(1, keepdim=True) + 1e-6
        if not l1:
            norm = torch.sqrt(norm)
        y = x / norm
        ctx.save_for_backward(x, y, norm)
        ctx.l1, ctx.bp_norm = l1, bp_norm
        return y, norm

    @staticmethod
    def backward(ctx, gy, gnorm):
        x, y, norm = ctx.saved_tensors
        s = torch.sign(x) if ctx.l1 else y
        gx = (gy - s * (y * gy).sum(1, keepdim=True)) / norm
        if ctx.bp_norm and gnorm is not None:
            gx = gx + gnorm * s
        return gx, None, None


@register("Normalize")
class Normalize(Layer):
    """L2 normalization with a learned scale (SSD's conv4_3_norm).

    Bottom (N, C, ...) -> top of the same shape: x / sqrt(sum x^2 + eps) * scale, the sum over
    (C, H, W) per sample if across_spatial, else over C at each position.
    Params: norm_param across_spatial, channel_shared, scale_filler (default constant 1), eps.
    Blob: scale, shape [] if channel_shared else (C,).
    Differs from torch: F.normalize adds eps to the norm (max), not inside the square root.

    happynear's Normalize (caffe-windows normalize_layer.cpp, the AMSoftmax face nets), chosen
    by ``normalize_param`` (its own message: normalize_type, fix_gradient, bp_norm): no blob; at
    each position of (N, C, H, W) (Caffe's legacy axes: fewer read as 1, and the top is 4-D),
    x / norm over C with norm sqrt(sum x^2 + 1e-6) ("L2") or sum |x| + 1e-6 ("L1"); an optional
    second top (N, 1, H, W) is the norm. Gradient, the fork's CPU one: (dy - s <y, dy>) / norm,
    s = y (L2) or sign(x) (L1), plus s * dnorm with bp_norm and two tops (else the norm top takes
    none). The fork's GPU code differs: L2 eps 1e-12, and fix_gradient drops the division;
    brewnet follows the CPU code, which ignores fix_gradient.
    """

    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def setup(self, bottom_shapes):
        self.feature = self.param.HasField("normalize_param")
        if self.feature:
            return self._setup_feature(bottom_shapes)
        if self.num_tops != 1:
            raise self.fail("SSD's Normalize (norm_param) has one top; happynear's two-top "
                            "Normalize is chosen by normalize_param")
        shape = bottom_shapes[0]
        if not 2 <= len(shape) <= 4:
            raise self.fail(f"bottom must have 2 to 4 axes (N, C[, H, W]), got {tuple(shape)}")
        p = self.param.norm_param
        self.across_spatial, self.channel_shared, self.eps = p.across_spatial, p.channel_shared, p.eps
        filler = (p.scale_filler if p.HasField("scale_filler")
                  else pb.FillerParameter(type="constant", value=1.0))
        self.blobs = [self.new_blob(() if self.channel_shared else (shape[1],), filler)]

    def _setup_feature(self, bottom_shapes):
        p = self.param.normalize_param
        if self.param.HasField("norm_param"):
            raise self.fail("has both norm_param (SSD's Normalize) and normalize_param "
                            "(happynear's): give one")
        if p.normalize_type not in ("L1", "L2"):
            raise self.fail(f"normalize_type must be \"L1\" or \"L2\", got {p.normalize_type!r}")
        if not 2 <= len(bottom_shapes[0]) <= 4:
            raise self.fail(f"bottom must have 2 to 4 axes (N, C[, H, W]), got {tuple(bottom_shapes[0])}")
        if p.fix_gradient:
            log.warning("Layer '%s': normalize_param.fix_gradient is ignored, as the fork's CPU "
                        "code does (its GPU code skips the division by the norm)", self.name)
        self.bp_norm = p.bp_norm and self.num_tops == 2

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if self.feature:
            if not 2 <= len(shape) <= 4:
                raise self.fail(f"bottom must have 2 to 4 axes (N, C[, H, W]), got {shape}")
            n, c, h, w = shape + (1,) * (4 - len(shape))
            return [(n, c, h, w), (n, 1, h, w)][:self.num_tops]
        if not 2 <= len(shape) <= 4 or (not self.channel_shared and shape[1] != self.blobs[0].numel()):
            raise self.fail(f"bottom {shape} does not fit the scale of {self.blobs[0].numel()} channels")
        return [shape]

    def forward(self, bottoms):
        x = bottoms[0]
        if self.feature:
            x = x.reshape(tuple(x.shape) + (1,) * (4 - x.dim()))
            l1 = self.param.normalize_param.normalize_type == "L1"
            y, norm = _FeatureNormalize.apply(x, l1, self.bp_norm)
            return [y, norm][:self.num_tops]
        dims = tuple(range(1, x.dim())) if self.across_spatial else (1,)
        y = x / torch.sqrt((x * x).sum(dim=dims, keepdim=True) + self.eps)
        scale = self.blobs[0]
        if not self.channel_shared:
            scale = scale.view((1, -1) + (1,) * (x.dim() - 2))
        return [y * scale.to(x.dtype)]


@register("BN")
class BN(Layer):
    """The BN layer of SegNet and of PSPNet (one type, two forks), with its own affine blobs.

    Bottom (N, C, H, W) -> top of the same shape. Blobs, each (1, C, 1, 1) as the forks store them.
    SegNet (bn_param has scale_filler, shift_filler or bn_mode): [scale, shift]. bn_mode LEARN
    (any phase) normalizes with the batch's mean and E[x^2] - E[x]^2, eps 1e-9; INFERENCE is
    scale * x + shift (statistics folded in by SegNet's compute_bn_statistics.py).
    PSPNet (otherwise): [slope, bias, mean, variance]. TEST or ``frozen``: (x - mean) /
    sqrt(variance + eps) * slope + bias with the stored statistics; TRAIN: the batch's mean and
    biased variance, each stored blob updated to (1 - momentum) * batch + momentum * blob. The
    statistics blobs never get gradients, nor do slope and bias when frozen.
    DeconvNet's BN (HyeonwooNoh/caffe bn_layer.cpp, V1 type BN; SegNet's is a copy of it) is the
    SegNet reading; in LEARN mode it may have two more tops, the batch mean and the batch
    variance E[x^2] - E[x]^2 (before eps), each (1, C, 1, 1), which take no gradient.
    """

    exact_bottoms = 1
    min_tops = 1
    max_tops = 3

    def setup(self, bottom_shapes):
        p = self.param.bn_param
        self.segnet = any(p.HasField(f) for f in ("scale_filler", "shift_filler", "bn_mode"))
        if len(bottom_shapes[0]) != 4:
            raise self.fail(f"bottom must be (N, C, H, W), got {tuple(bottom_shapes[0])}")
        if self.num_tops > 1 and not (self.segnet and p.bn_mode == pb.BNParameter.LEARN):
            raise self.fail("only DeconvNet's bn_mode LEARN has the batch mean and variance "
                            "tops; this BN has one top")
        shape = (1, bottom_shapes[0][1], 1, 1)
        if self.segnet:
            self.blobs = [self.new_blob(shape, p.scale_filler), self.new_blob(shape, p.shift_filler)]
            return
        self.blobs = [self.new_blob(shape, p.slope_filler), self.new_blob(shape, p.bias_filler),
                      self.new_blob(shape).requires_grad_(False),
                      self.new_blob(shape).requires_grad_(False)]
        if p.frozen:
            with torch.no_grad():
                self.blobs[3].fill_(1)
            for b in self.blobs[:2]:
                b.requires_grad_(False)

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) != 4 or x[1] != self.blobs[0].shape[1]:
            raise self.fail(f"bottom shape {x} does not have {self.blobs[0].shape[1]} channels")
        return [x] + [(1, x[1], 1, 1)] * (self.num_tops - 1)

    def forward(self, bottoms):
        x = bottoms[0]
        p = self.param.bn_param
        if self.segnet:
            scale, shift = self.blobs
            if p.bn_mode == pb.BNParameter.INFERENCE:
                return [x * scale + shift]
            mean = x.mean((0, 2, 3), keepdim=True)
            var = (x * x).mean((0, 2, 3), keepdim=True) - mean * mean
            y = (x - mean) / torch.sqrt(var + 1e-9) * scale + shift
            return [y, mean.detach(), var.detach()][:self.num_tops]
        slope, bias, mean_blob, var_blob = self.blobs
        eps = float(np.float32(p.eps))
        if p.frozen or self.phase == pb.TEST:
            mean, var = mean_blob.detach(), var_blob.detach()
        else:
            mean = x.mean((0, 2, 3), keepdim=True)
            var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
            m = float(np.float32(p.momentum))
            with torch.no_grad():
                mean_blob.mul_(m).add_(mean.detach(), alpha=1 - m)
                var_blob.mul_(m).add_(var.detach(), alpha=1 - m)
        if p.frozen:
            slope, bias = slope.detach(), bias.detach()
        return [(x - mean) * torch.pow(var + eps, -0.5) * slope + bias]
