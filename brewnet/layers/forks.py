"""Layers of smaller forks, each with the fork's own semantics (read from its source):
RCF's AutoCrop (and longjon's V1 CROP, the same layer), DeconvNet's Unpooling, happynear's Flip
(caffe-windows, the AMSoftmax face nets) and warp-ctc caffe's ContinuationIndicator.

DeconvNet's BN is ``BN`` (normalization.py: SegNet took it from DeconvNet) and happynear's
Normalize is ``Normalize`` with ``normalize_param`` (normalization.py).
"""
from __future__ import annotations

from fractions import Fraction

import torch

from .base import Layer
from .data import SourceLayer
from .registry import register
from .resample import _Unpool

# ------------------------------------------------------------------------------ coordinate maps
# longjon's coords.hpp (BVLC PR 1639, kept by RCF and DeconvNet's caffe): a layer maps its
# bottom's coordinates to its top's by y = a * x + b on each of the two spatial axes.

_IDENTITY = ((Fraction(1), Fraction(0)),) * 2

# Layers whose coord_map is the identity in the forks: NeuronLayer's subclasses, Concat,
# Eltwise, LRN, MVN, Slice, Softmax, Split. brewnet adds the position-wise layers the forks
# never gave a map (their NOT_IMPLEMENTED would abort): BatchNorm, Scale, Bias, BN and the
# other neuron-like types, each of which keeps every position where it is.
_IDENTITY_TYPES = {
    "AbsVal", "BNLL", "Dropout", "ELU", "Exp", "Log", "Power", "PReLU", "ReLU", "Sigmoid",
    "TanH", "Threshold", "Concat", "Eltwise", "LRN", "MVN", "Slice", "Softmax", "Split",
    "BatchNorm", "Scale", "Bias", "BN", "ReLU6", "Swish", "Clip", "Flip",
}


def _filter_map(kernel, stride, pad):
    """FilterMap: top -> bottom of a (de)convolution-like window, a = stride, b = (k - 1) / 2 - pad."""
    return tuple((Fraction(s), Fraction(k - 1, 2) - p) for k, s, p in zip(kernel, stride, pad))


def _inv(m):
    return tuple((1 / a, -b / a) for a, b in m)


def _compose(left, right):
    """left o right, as DiagonalAffineMap::compose."""
    return tuple((la * ra, la * rb + lb) for (la, lb), (ra, rb) in zip(left, right))


def _coord_map(layer, bottom_shape):
    """The fork's coord_map() of a built brewnet layer (bottom coordinates -> top)."""
    t = layer.type
    if t in _IDENTITY_TYPES:
        return _IDENTITY
    if t in ("Convolution", "Deconvolution", "DepthwiseConvolution", "ConvolutionDepthwise"):
        if layer.num_spatial != 2:
            raise ValueError(f"{t} '{layer.name}' has {layer.num_spatial} spatial axes; the "
                             "coordinate maps are 2-D")
        ext = [d * (k - 1) + 1 for k, d in zip(layer.kernel, layer.dilation)]
        m = _filter_map(ext, layer.stride, layer.pad)
        return m if t == "Deconvolution" else _inv(m)
    if t == "Pooling":
        kernel = tuple(bottom_shape[2:]) if layer.kernel is None else layer.kernel
        return _inv(_filter_map(kernel, layer.stride, layer.pad))
    if t == "Unpooling":
        return _filter_map(layer.kernel, layer.stride, layer.pad)
    if t == "AutoCrop":
        return tuple((Fraction(1), Fraction(-c)) for c in layer.crop)
    if t == "Crop":     # RCF's crop_layer.hpp: (1, -offsets[0]), (1, -offsets[1])
        return tuple((Fraction(1), Fraction(-s.start)) for s in layer.slices[-2:])
    raise ValueError(f"layer '{layer.name}' (type {t}) has no coordinate map in the forks")


@register("AutoCrop")
class AutoCrop(Layer):
    """RCF's AutoCrop (yun-liu/RCF; longjon's V1 CROP, the same code): crop bottom 0 (N, C, H, W)
    to bottom 1's H x W at an offset found from the net, as the fork's LayerSetUp does.

    From bottom 0, walk back through each producing layer's first bottom (in-place layers are
    skipped: a blob's first producer counts); from bottom 1 likewise until a blob on that path.
    Each path composes its layers' coordinate maps (conv and pooling: FilterMap(extent, stride,
    pad) inverted, deconv: FilterMap, crops: a shift, position-wise layers: the identity); the map
    from bottom 0 to bottom 1 must have scale 1 and a non-positive integer shift b: the offset is
    -b on each axis. Top (N, C, H1, W1) = bottom0[:, :, off_h:off_h + H1, off_w:off_w + W1].
    Gradient: to bottom 0 only, zero outside the crop.
    """

    exact_bottoms = 2
    exact_tops = 1
    routing = True
    arithmetic = "elementwise"
    in_place_ok = False

    def __init__(self, param, phase):
        super().__init__(param, phase)
        self.crop = None

    def allow_backward(self, bottom_index):
        return bottom_index == 0

    def set_net(self, net) -> None:
        """Find the offsets in the net built so far (the layers before this one)."""
        down = {}
        for i, tops in enumerate(net.top_lists):
            for t in tops:
                down.setdefault(t, i)
        b0, b1 = self.param.bottom[0], self.param.bottom[1]
        path, blob = {b0}, b0
        while blob in down and net.bottom_lists[down[blob]]:
            blob = net.bottom_lists[down[blob]][0]
            path.add(blob)
        inter = b1
        while inter not in path:
            if inter not in down or not net.bottom_lists[down[inter]]:
                raise self.fail("Cannot align apparently disconnected blobs "
                                f"('{b0}' and '{b1}' share no blob upstream)")
            inter = net.bottom_lists[down[inter]][0]
        maps = []
        for start in (b0, b1):
            m, blob = _IDENTITY, start
            while blob != inter:
                i = down[blob]
                bottom = net.bottom_lists[i][0]
                try:
                    m = _compose(m, _coord_map(net.layer_list[i], net.shapes[bottom]))
                except ValueError as e:
                    raise self.fail(str(e)) from None
                blob = bottom
            maps.append(m)
        crop = []
        for axis, (a, b) in zip("hw", _compose(maps[1], _inv(maps[0]))):
            if a != 1:
                raise self.fail(f"scale mismatch between '{b0}' and '{b1}' on {axis}: {a}")
            if b > 0:
                raise self.fail(f"negative crop width on {axis}: '{b0}' would need padding by {b}")
            if b.denominator != 1:
                raise self.fail(f"the crop on {axis} is not an integer: {-b}")
            crop.append(int(-b))
        self.crop = tuple(crop)

    def setup(self, bottom_shapes):
        if self.crop is None:
            raise self.fail("finds its offsets from the net it is in: build it in a Net")

    def reshape(self, bottom_shapes):
        x, ref = tuple(bottom_shapes[0]), tuple(bottom_shapes[1])
        if len(x) != 4 or len(ref) != 4:
            raise self.fail(f"bottoms must be 4-D, got {x} and {ref}")
        (oh, ow), (h, w) = self.crop, ref[2:]
        if oh + h > x[2] or ow + w > x[3]:
            raise self.fail(f"the crop at ({oh}, {ow}) of size {h}x{w} exceeds bottom 0 {x}")
        return [x[:2] + (h, w)]

    def forward(self, bottoms):
        (oh, ow), (h, w) = self.crop, bottoms[1].shape[2:]
        return [bottoms[0][:, :, oh:oh + h, ow:ow + w]]

    def extra_repr(self):
        return f"crop={self.crop}"


# --------------------------------------------------------------------------------- Unpooling

class _Spread(torch.autograd.Function):
    """top = Fh^T x Fw per plane; backward Bh g Bw^T (the fork's TILE backward divides by the
    window size though its forward does not: B differs from F there)."""

    @staticmethod
    def forward(ctx, x, fh, fw, bh, bw):
        ctx.save_for_backward(bh, bw)
        return torch.einsum("nchw,hH,wW->ncHW", x, fh.to(x.dtype), fw.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        bh, bw = ctx.saved_tensors
        return torch.einsum("ncHW,hH,wW->nchw", g, bh.to(g.dtype), bw.to(g.dtype)), None, None, None, None


@register("Unpooling")
class Unpooling(Layer):
    """DeconvNet's unpooling (HyeonwooNoh/caffe unpooling_layer.cpp), V1 type UNPOOLING.

    Bottom x (N, C, H, W) [and, MAX only, the pooling mask of the same shape: flat indices into
    each output plane, as Pooling's second top]. Top (N, C, Hu, Wu): unpool_size or
    unpool_h/unpool_w, one of which the fork requires (its Reshape's default size,
    max((H - 1) * stride + kernel, H * stride + 1), is never reached). MAX: each value to its
    mask index (a later one winning a repeat), or without a mask to (min(ph * stride, Hu - 1),
    min(pw * stride, Wu - 1)); the rest 0. AVE: each value / window size added over its
    window (clipped to the output; the size counts the unclipped extent up to Hu + pad).
    TILE: each value added over its window.
    Gradient: MAX reads the top gradient back at each index; AVE and TILE sum it over the window
    divided by the window size (TILE too, as the fork's backward). The fork allows pad 0 only.
    """

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    in_place_ok = False

    def allow_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom_shapes):
        p = self.param.unpooling_param
        has = p.HasField
        if has("kernel_size") == (has("kernel_h") and has("kernel_w")):
            raise self.fail("filter size is kernel_size OR kernel_h and kernel_w; not both")
        if (has("pad") and (has("pad_h") or has("pad_w"))) or has("pad_h") != has("pad_w"):
            raise self.fail("pad is pad OR pad_h and pad_w")
        if (has("stride") and (has("stride_h") or has("stride_w"))) or has("stride_h") != has("stride_w"):
            raise self.fail("stride is stride OR stride_h and stride_w")
        if has("unpool_size") == (has("unpool_h") and has("unpool_w")) or has("unpool_h") != has("unpool_w"):
            raise self.fail("the output size is unpool_size OR unpool_h and unpool_w (the fork "
                            "requires one)")
        self.kernel = (p.kernel_size,) * 2 if has("kernel_size") else (p.kernel_h, p.kernel_w)
        self.pad = (p.pad_h, p.pad_w) if has("pad_h") else (p.pad,) * 2
        self.stride = (p.stride_h, p.stride_w) if has("stride_h") else (p.stride,) * 2
        if min(self.kernel) <= 0:
            raise self.fail(f"filter dimensions cannot be zero, got {self.kernel}")
        if any(self.pad):
            raise self.fail("only zero padding is allowed (the fork's check)")
        if min(self.stride) <= 0:
            raise self.fail(f"stride must be positive, got {self.stride}")
        self.method = p.unpool
        if len(bottom_shapes) == 2 and self.method != p.MAX:
            raise self.fail("only MAX unpooling takes a mask bottom")
        self.size = (p.unpool_size,) * 2 if has("unpool_size") else (p.unpool_h, p.unpool_w)
        if min(self.size) <= 0:
            raise self.fail(f"the output size must be positive, got {self.size}")

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) != 4:
            raise self.fail(f"bottom must be (N, C, H, W), got {x}")
        if len(bottom_shapes) == 2 and tuple(bottom_shapes[1]) != x:
            raise self.fail(f"the mask {tuple(bottom_shapes[1])} must be shaped as x {x}")
        return [x[:2] + self.size]

    def _windows(self, n, out, k, s, pad, dtype):
        """(n, out) matrices: the window indicator, and indicator / window extent."""
        f = torch.zeros(n, out, dtype=dtype)
        b = torch.zeros(n, out, dtype=dtype)
        for i in range(n):
            start = i * s - pad
            end = min(start + k, out + pad)
            extent = end - start
            lo, hi = max(start, 0), min(end, out)
            f[i, lo:hi] = 1
            b[i, lo:hi] = 1 / extent
        return f, b

    def forward(self, bottoms):
        x = bottoms[0]
        n, c, h, w = x.shape
        hu, wu = self.size
        MAX, AVE = self.param.unpooling_param.MAX, self.param.unpooling_param.AVE
        if self.method == MAX:
            if len(bottoms) == 2:
                idx = bottoms[1].detach().to("cpu", torch.int64)
                if idx.numel() and (int(idx.max()) >= hu * wu or int(idx.min()) < 0):
                    raise self.fail(f"mask index out of range for a {hu}x{wu} output")
            else:
                rows = (torch.arange(h) * self.stride[0] - self.pad[0]).clamp(0, hu - 1)
                cols = (torch.arange(w) * self.stride[1] - self.pad[1]).clamp(0, wu - 1)
                idx = (rows[:, None] * wu + cols[None, :]).expand(n, c, h, w)
            top = _Unpool.apply(x.cpu() if x.device.type != "cpu" else x, idx, hu * wu)
            return [top.reshape(n, c, hu, wu).to(x.device)]
        fh, bh = self._windows(h, hu, self.kernel[0], self.stride[0], self.pad[0], torch.float64)
        fw, bw = self._windows(w, wu, self.kernel[1], self.stride[1], self.pad[1], torch.float64)
        if self.method == AVE:
            fh, fw = bh, bw
        dev = x.device
        return [_Spread.apply(x, fh.to(dev), fw.to(dev), bh.to(dev), bw.to(dev))]


# ------------------------------------------------------------------------------- Flip, indicator

@register("Flip")
class Flip(Layer):
    """happynear's Flip (caffe-windows flip_layer.cpp): (N, C, H, W) mirrored along W
    (flip_width, default true) and/or H (flip_height). Blobs of fewer axes read as Caffe's legacy
    num/channels/height/width (missing ones 1). Gradient: the top gradient flipped back."""

    exact_bottoms = 1
    exact_tops = 1
    routing = True
    arithmetic = "elementwise"
    in_place_ok = False

    def reshape(self, bottom_shapes):
        x = tuple(bottom_shapes[0])
        if len(x) > 4:
            raise self.fail(f"bottom must have at most 4 axes (N, C, H, W), got {x}")
        return [x]

    def forward(self, bottoms):
        x = bottoms[0]
        p = self.param.flip_param
        dims = [d for d, on in ((2, p.flip_height), (3, p.flip_width)) if on and d < x.dim()]
        return [x.flip(dims) if dims else x.clone()]


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
