"""Vision layers: Convolution, Deconvolution, Pooling, SPP, LRN, Im2col.

The math lives in ``functional.py``; these classes read Caffe's params, check shapes the way
Caffe's ``LayerSetUp``/``Reshape`` do, and create the learnable blobs.
"""
from __future__ import annotations

import torch

from . import functional as Fn
from . import pooling as Pool
from .base import Layer, canonical_axis, count
from .registry import register

# caffe.proto enum values
MAX, AVE, STOCHASTIC = 0, 1, 2          # PoolingParameter.PoolMethod / SPPParameter.PoolMethod
CEIL, FLOOR = 0, 1                      # PoolingParameter.RoundMode
ACROSS_CHANNELS, WITHIN_CHANNEL = 0, 1  # LRNParameter.NormRegion
TRAIN = 0
POOL_NAMES = {MAX: "MAX", AVE: "AVE", STOCHASTIC: "STOCHASTIC"}


def conv_geometry(layer: Layer, cp, num_spatial: int):
    """(kernel, stride, pad, dilation) tuples of length ``num_spatial`` from a
    ConvolutionParameter, with Caffe's rules: one value for all dims or one per dim; the
    ``*_h``/``*_w`` forms only for 2-D and never together with the repeated form."""

    def pick(name, default):
        values = list(getattr(cp, name))
        h, w = f"{name.split('_')[0]}_h", f"{name.split('_')[0]}_w"
        if name != "dilation" and (cp.HasField(h) or cp.HasField(w)):
            if num_spatial != 2:
                raise layer.fail(f"{h} & {w} can only be used for 2D convolution "
                                 f"(the input has {num_spatial} spatial axes)")
            if values:
                raise layer.fail(f"either {name} or {h}/{w} should be specified; not both")
            return getattr(cp, h), getattr(cp, w)
        if len(values) not in ((1, num_spatial) if default is None else (0, 1, num_spatial)):
            raise layer.fail(f"{name} must be specified once, or once per spatial dimension "
                             f"({name} specified {len(values)} times; {num_spatial} spatial dims)")
        if not values:
            return (default,) * num_spatial
        return tuple(values[0 if len(values) == 1 else i] for i in range(num_spatial))

    kernel, stride = pick("kernel_size", None), pick("stride", 1)
    pad, dilation = pick("pad", 0), pick("dilation", 1)
    if any(k <= 0 for k in kernel):
        raise layer.fail(f"filter dimensions must be nonzero, got kernel {kernel}")
    if any(s <= 0 for s in stride):
        raise layer.fail(f"stride dimensions must be nonzero, got stride {stride}")
    return kernel, stride, pad, dilation


class _ConvolutionBase(Layer):
    """Shared set-up of Convolution and Deconvolution (Caffe's BaseConvolutionLayer)."""

    min_bottoms = 1
    min_tops = 1
    transposed = False

    def flops(self, bottom_shapes, top_shapes):
        w = self.blobs[0].shape          # conv: (out, in/g, k...); deconv: (in, out/g, k...)
        spatial = bottom_shapes[0] if self.transposed else top_shapes[0]
        macs = count(w) * count(spatial[2:]) * spatial[0]
        return 2 * macs + (count(top_shapes[0]) if len(self.blobs) > 1 else 0)

    def setup(self, bottom_shapes):
        if len(self.param.top) != len(bottom_shapes):
            raise self.fail(f"needs one top per bottom, got {len(bottom_shapes)} bottom(s) and "
                            f"{len(self.param.top)} top(s)")
        cp = self.param.convolution_param
        shape = tuple(bottom_shapes[0])
        self.axis = canonical_axis(cp.axis, len(shape), self)
        self.num_spatial = len(shape) - self.axis - 1
        self.kernel, self.stride, self.pad, self.dilation = conv_geometry(self, cp,
                                                                          self.num_spatial)
        self.channels, self.num_output, self.group = shape[self.axis], cp.num_output, cp.group
        if self.num_output <= 0 or self.group <= 0:
            raise self.fail(f"num_output ({self.num_output}) and group ({self.group}) must be > 0")
        if self.channels % self.group or self.num_output % self.group:
            raise self.fail(f"input channels ({self.channels}, bottom shape {shape}) and "
                            f"num_output ({self.num_output}) must be multiples of group "
                            f"({self.group})")
        g = self.group
        io = (self.channels, self.num_output // g) if self.transposed else (self.num_output,
                                                                            self.channels // g)
        self.bias_term = cp.bias_term
        self.blobs = [self.new_blob(io + tuple(self.kernel), cp.weight_filler)]
        if self.bias_term:
            self.blobs.append(self.new_blob((self.num_output,), cp.bias_filler))

    def out_size(self, size, k, s, p, d) -> int:
        return Fn.conv_out_size(size, k, s, p, d)

    def reshape(self, bottom_shapes):
        s0 = tuple(bottom_shapes[0])
        if len(s0) != self.axis + 1 + self.num_spatial or s0[self.axis] != self.channels:
            raise self.fail(f"bottom shape {s0} does not fit the layer set up for "
                            f"{self.channels} channels on axis {self.axis} and "
                            f"{self.num_spatial} spatial axes")
        for s in bottom_shapes[1:]:
            if tuple(s) != s0:
                raise self.fail(f"all bottoms must have the same shape, got {s0} and {tuple(s)}")
        spatial = tuple(self.out_size(*g) for g in zip(s0[self.axis + 1:], self.kernel,
                                                       self.stride, self.pad, self.dilation))
        if any(o <= 0 for o in spatial):
            raise self.fail(f"bottom {s0} with kernel {self.kernel}, stride {self.stride}, pad "
                            f"{self.pad}, dilation {self.dilation} gives output size {spatial}")
        return [s0[:self.axis] + (self.num_output,) + spatial] * len(bottom_shapes)

    def forward(self, bottoms):
        op = Fn.deconv_nd if self.transposed else Fn.conv_nd
        w = self.blobs[0]
        b = self.blobs[1] if self.bias_term else None
        tops = []
        for x in bottoms:
            if self.axis == 1:  # no reshape: it would reset a 1-channel NHWC tensor to NCHW
                tops.append(op(x, w, b, self.stride, self.pad, self.dilation, self.group))
                continue
            lead = tuple(x.shape[:self.axis])     # all axes before `axis` are batch axes
            y = op(x.reshape((-1,) + tuple(x.shape[self.axis:])), w, b, self.stride, self.pad,
                   self.dilation, self.group)
            tops.append(y.reshape(lead + tuple(y.shape[1:])))
        return tops

    def extra_repr(self):
        return (f"num_output={self.num_output}, kernel={self.kernel}, stride={self.stride}, "
                f"pad={self.pad}, dilation={self.dilation}, group={self.group}")


@register("Convolution")
class Convolution(_ConvolutionBase):
    """Cross-correlation with learned filters (Caffe ConvolutionLayer).

    Bottoms: one or more blobs of the same shape (..., C, *spatial) with C on ``axis``; one top
    per bottom, (..., num_output, *out), out = (in + 2 pad - dilation (k - 1) - 1) / stride + 1
    (C++ integer division). Blobs: weight (num_output, C/group, *kernel), bias (num_output).
    Params: convolution_param num_output, bias_term, pad/kernel_size/stride/dilation (or
    *_h/*_w), group, weight_filler, bias_filler, axis; engine and force_nd_im2col change nothing.
    Any number of spatial axes (0-D = grouped matmul).
    Differs from torch: the truncating output-size rule (a kernel overhanging the padding by less
    than a stride still gives an output, reading zeros).
    """


@register("DepthwiseConvolution")
class DepthwiseConvolution(Convolution):
    """yonghenglh6/DepthwiseConvolution's layer: a Convolution (its CPU path is Caffe's, with the
    prototxt's ``group``, which MobileNet nets set to the channel count); same blobs and params."""


@register("ConvolutionDepthwise")
class ConvolutionDepthwise(Convolution):
    """The MobileNet ports' ConvolutionDepthwise (conv_dw_layer): one kh x kw filter per input
    channel, i.e. a Convolution with group = num_output = C whatever convolution_param says
    (the fork ignores num_output and group). Blobs: weight (C, 1, kh, kw), bias (C)."""

    def setup(self, bottom_shapes):
        cp = self.param.convolution_param
        c = int(bottom_shapes[0][canonical_axis(cp.axis, len(bottom_shapes[0]), self)])
        param = type(self.param)()
        param.CopyFrom(self.param)
        param.convolution_param.num_output = param.convolution_param.group = c
        self.param = param
        super().setup(bottom_shapes)


@register("Deconvolution")
class Deconvolution(_ConvolutionBase):
    """Transposed convolution, the adjoint of Convolution (Caffe DeconvolutionLayer).

    Bottoms/tops as Convolution; out = stride (in - 1) + dilation (k - 1) + 1 - 2 pad.
    Blobs: weight (C, num_output/group, *kernel) (torch's transposed layout), bias (num_output).
    Params: as Convolution (bilinear weight_filler with group = C is FCN's upsampling).
    """

    transposed = True

    def out_size(self, size, k, s, p, d) -> int:
        return Fn.deconv_out_size(size, k, s, p, d)


@register("Im2col")
class Im2col(Layer):
    """The im2col matrix of Caffe's convolution as a blob (Caffe Im2colLayer).

    Bottom (..., C, *spatial) with C on ``axis``; top (..., C * prod(kernel), *out), channel
    index (c * kh + i) * kw + j. Params: convolution_param pad/kernel_size/stride/dilation (or
    *_h/*_w), axis. Backward is col2im (summing overlaps).
    """

    arithmetic = "elementwise"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom_shapes):
        cp = self.param.convolution_param
        shape = tuple(bottom_shapes[0])
        self.axis = canonical_axis(cp.axis, len(shape), self)
        self.num_spatial = len(shape) - self.axis - 1
        if self.num_spatial < 1:
            raise self.fail(f"needs at least one spatial axis after axis {self.axis}, "
                            f"bottom shape {shape}")
        self.kernel, self.stride, self.pad, self.dilation = conv_geometry(self, cp,
                                                                          self.num_spatial)

    def reshape(self, bottom_shapes):
        s0 = tuple(bottom_shapes[0])
        if len(s0) != self.axis + 1 + self.num_spatial:
            raise self.fail(f"bottom shape {s0}: the number of axes may not change")
        spatial = tuple(Fn.conv_out_size(*g) for g in zip(s0[self.axis + 1:], self.kernel,
                                                          self.stride, self.pad, self.dilation))
        if any(o <= 0 for o in spatial):
            raise self.fail(f"bottom {s0} with kernel {self.kernel}, stride {self.stride}, pad "
                            f"{self.pad}, dilation {self.dilation} gives output size {spatial}")
        ch = s0[self.axis]
        for k in self.kernel:
            ch *= k
        return [s0[:self.axis] + (ch,) + spatial]

    def forward(self, bottoms):
        x = bottoms[0]
        lead = tuple(x.shape[:self.axis])
        y = Fn.im2col(x.reshape((-1,) + tuple(x.shape[self.axis:])), self.kernel, self.stride,
                      self.pad, self.dilation)
        return [y.reshape(lead + tuple(y.shape[1:]))]


def pool2d(x: torch.Tensor, method: int, kernel, stride, pad, ceil_mode: bool, train: bool,
           return_mask: bool = False):
    """Dispatch to the functional pooling of ``method``; returns (top, mask or None)."""
    if method == MAX:
        return Pool.max_pool2d(x, kernel, stride, pad, ceil_mode, return_mask)
    if method == AVE:
        return Pool.ave_pool2d(x, kernel, stride, pad, ceil_mode), None
    return Pool.stochastic_pool2d(x, kernel, stride, train, ceil_mode), None


def check_pool_pad(layer: Layer, method: int, kernel, pad, context: str = "") -> None:
    """Caffe's pooling CHECKs on padding: only MAX/AVE, and pad < kernel."""
    if not any(pad):
        return
    if method not in (MAX, AVE):
        raise layer.fail(f"padding {tuple(pad)} is implemented only for AVE and MAX pooling, "
                         f"not {POOL_NAMES.get(method, method)}{context}")
    if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
        raise layer.fail(f"pad {tuple(pad)} must be smaller than kernel {tuple(kernel)}{context}")


@register("Pooling")
class Pooling(Layer):
    """MAX / AVE / STOCHASTIC pooling over H and W (Caffe PoolingLayer).

    Bottom (N, C, H, W); top (N, C, outH, outW), outH = ceil((H + 2 pad - k) / stride) + 1
    (floor with round_mode FLOOR), minus one if padding is used and the last window would start
    at or past H + pad; MAX may have a 2nd top: the argmax flat index h * W + w as float (first
    maximum wins; no gradient). AVE divides by the window clipped to [-pad, H + pad).
    STOCHASTIC: TRAIN samples an element with probability x / sum(window), TEST takes
    sum(x^2) / sum(x) (Caffe's GPU definition; runs on every device here).
    Params: pooling_param pool, kernel_size (or kernel_h/w), stride (or stride_h/w), pad (or
    pad_h/w), global_pooling (kernel = H x W), round_mode.
    Differs from torch: output size rule, pad up to kernel - 1, AVE divisor at the far edge
    (see pooling.max_pool2d / ave_pool2d).
    """

    arithmetic = "elementwise"
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def flops(self, bottom_shapes, top_shapes):
        p = self.param.pooling_param
        k = (bottom_shapes[0][2] * bottom_shapes[0][3]) if p.global_pooling else (
            (p.kernel_h or p.kernel_size) * (p.kernel_w or p.kernel_size))
        return count(top_shapes[0]) * k

    def setup(self, bottom_shapes):
        pp = self.param.pooling_param
        has = pp.HasField
        self.method, self.global_pooling = pp.pool, pp.global_pooling
        self.ceil_mode = pp.round_mode == CEIL
        if self.global_pooling:
            if has("kernel_size") or has("kernel_h") or has("kernel_w"):
                raise self.fail("with global_pooling: true the filter size cannot be specified")
            self.kernel = None
        elif has("kernel_size") == (has("kernel_h") and has("kernel_w")):
            raise self.fail("filter size is kernel_size OR kernel_h and kernel_w; not both "
                            "(and for non-square filters both kernel_h and kernel_w)")
        else:
            self.kernel = ((pp.kernel_size,) * 2 if has("kernel_size")
                           else (pp.kernel_h, pp.kernel_w))
            if min(self.kernel) <= 0:
                raise self.fail(f"filter dimensions cannot be zero, got {self.kernel}")
        if has("pad_h") != has("pad_w") or (has("pad") and has("pad_h")):
            raise self.fail("pad is pad OR pad_h and pad_w")
        if has("stride_h") != has("stride_w") or (has("stride") and has("stride_h")):
            raise self.fail("stride is stride OR stride_h and stride_w")
        self.pad = (pp.pad_h, pp.pad_w) if has("pad_h") else (pp.pad,) * 2
        self.stride = (pp.stride_h, pp.stride_w) if has("stride_h") else (pp.stride,) * 2
        if min(self.stride) <= 0:
            raise self.fail(f"stride must be positive, got {self.stride}")
        if self.global_pooling and (any(self.pad) or self.stride != (1, 1)):
            raise self.fail("with global_pooling: true only pad = 0 and stride = 1 are allowed")
        if self.method not in POOL_NAMES:
            raise self.fail(f"unknown pooling method {self.method}")
        if self.num_tops == 2 and self.method != MAX:
            raise self.fail("only MAX pooling can have a second (mask) top")
        if not self.global_pooling:
            check_pool_pad(self, self.method, self.kernel, self.pad)

    def _kernel(self, in_hw):
        return tuple(in_hw) if self.global_pooling else self.kernel

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.fail(f"input must have 4 axes (N, C, H, W), got shape {shape}")
        out = Pool.pool_out_shape(shape[2:], self._kernel(shape[2:]), self.stride, self.pad,
                                self.ceil_mode)
        if min(out) <= 0:
            raise self.fail(f"bottom {shape} with kernel {self._kernel(shape[2:])}, stride "
                            f"{self.stride}, pad {self.pad} gives pooled size {out}")
        return [shape[:2] + out] * self.num_tops

    def forward(self, bottoms):
        x = bottoms[0]
        y, mask = pool2d(x, self.method, self._kernel(x.shape[2:]), self.stride, self.pad,
                         self.ceil_mode, self.phase == TRAIN, self.num_tops == 2)
        return [y] if mask is None else [y, mask]


@register("SPP")
class SPP(Layer):
    """Spatial pyramid pooling (Caffe SPPLayer).

    Bottom (N, C, H, W). Level l = 0..pyramid_height-1 pools with bins = 2^l per side:
    kernel = stride = ceil(H / bins), pad = (kernel * bins - H + 1) / 2 (per dim); each level is
    flattened to (N, C * outH * outW) and the levels are concatenated: top (N, C * sum 4^l).
    With pyramid_height 1 the top is the single level's pooled blob (N, C, 1, 1).
    Params: spp_param pyramid_height, pool. Fails as Caffe does when a level needs
    pad >= kernel (input too small for the number of bins).
    """

    arithmetic = "elementwise"
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom_shapes):
        sp = self.param.spp_param
        self.height, self.method = sp.pyramid_height, sp.pool
        if self.height < 1:
            raise self.fail(f"pyramid_height must be >= 1, got {self.height}")
        if self.method not in POOL_NAMES:
            raise self.fail(f"unknown pooling method {self.method}")

    def levels(self, in_hw):
        """[(kernel, stride, pad)] per pyramid level for an (H, W) input."""
        out = []
        for level in range(self.height):
            bins = 2 ** level
            kernel = tuple(-(-d // bins) for d in in_hw)
            pad = tuple((k * bins - d + 1) // 2 for k, d in zip(kernel, in_hw))
            check_pool_pad(self, self.method, kernel, pad,
                           f" (pyramid level {level} of a {in_hw[0]}x{in_hw[1]} input)")
            out.append((kernel, kernel, pad))
        return out

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4 or min(shape[2:]) <= 0:
            raise self.fail(f"input must have 4 axes (N, C, H, W) with H, W > 0, got {shape}")
        sizes = [Pool.pool_out_shape(shape[2:], k, s, p) for k, s, p in self.levels(shape[2:])]
        if self.height == 1:
            return [shape[:2] + sizes[0]]
        return [(shape[0], shape[1] * sum(h * w for h, w in sizes))]

    def forward(self, bottoms):
        x = bottoms[0]
        train = self.phase == TRAIN
        pooled = [pool2d(x, self.method, k, s, p, True, train)[0]
                  for k, s, p in self.levels(tuple(x.shape[2:]))]
        if self.height == 1:
            return pooled
        return [torch.cat([y.flatten(1) for y in pooled], 1)]


@register("LRN")
class LRN(Layer):
    """Local response normalisation (Caffe LRNLayer).

    Bottom (N, C, H, W); top same shape. ACROSS_CHANNELS: x / (k + alpha/n * sum of x^2 over n
    neighbouring channels)^beta. WITHIN_CHANNEL: x * (1 + alpha/n^2 * sum of x^2 over an n x n
    window)^-beta, zero padded; k is ignored, as Caffe does. Params: lrn_param local_size (odd),
    alpha, beta, norm_region, k.
    Differs from torch: F.local_response_norm has no WITHIN_CHANNEL mode.
    """

    exact_bottoms = 1
    exact_tops = 1

    def flops(self, bottom_shapes, top_shapes):
        return count(top_shapes[0]) * (self.param.lrn_param.local_size + 3)

    def setup(self, bottom_shapes):
        lp = self.param.lrn_param
        self.size, self.alpha, self.beta, self.k = lp.local_size, lp.alpha, lp.beta, lp.k
        self.region = lp.norm_region
        if self.size % 2 != 1 or self.size <= 0:
            raise self.fail(f"LRN only supports odd values for local_size, got {self.size}")
        if self.region not in (ACROSS_CHANNELS, WITHIN_CHANNEL):
            raise self.fail(f"unknown norm_region {self.region}")

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != 4:
            raise self.fail(f"input must have 4 axes (N, C, H, W), got shape {shape}")
        return [shape]

    def forward(self, bottoms):
        x = bottoms[0]
        if self.region == ACROSS_CHANNELS:
            return [Fn.lrn_across_channels(x, self.size, self.alpha, self.beta, self.k)]
        return [Fn.lrn_within_channel(x, self.size, self.alpha, self.beta)]
