"""Crop layers: BVLC's Crop (offsets given) and RCF's AutoCrop (offsets found from the net's
coordinate maps, longjon's coords.hpp of BVLC PR 1639, kept by RCF and DeconvNet's caffe; the
V1 CROP type of those forks is the same layer)."""
from __future__ import annotations

from fractions import Fraction

from .base import Layer, canonical_axis
from .registry import register


@register("Crop")
class Crop(Layer):
    """Crop bottom 0 to bottom 1's shape on the axes from ``axis`` on.
    Shapes: (A..., B...) , (_, C...) -> (A..., C...). Params: crop_param {axis, offset: none ->
    0, one -> for every cropped axis, else one per cropped axis}. Bottom 1 gets no diff."""

    routing = True
    exact_bottoms = 2
    exact_tops = 1

    def allow_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom_shapes):
        s, ref = tuple(bottom_shapes[0]), tuple(bottom_shapes[1])
        if len(s) != len(ref):
            raise self.fail(f"bottoms must have the same number of axes, got {s} and {ref}")
        p = self.param.crop_param
        start = canonical_axis(p.axis, len(s), self)
        offs = list(p.offset)
        if len(offs) > 1 and len(offs) != len(s) - start:
            raise self.fail(f"{len(offs)} offsets for {len(s) - start} cropped axes (shape {s}, "
                            f"axis {start})")
        self.slices, top = [], []
        for i in range(len(s)):
            if i < start:
                off, size = 0, s[i]
            else:
                off = offs[0] if len(offs) == 1 else offs[i - start] if offs else 0
                size = ref[i]
                if s[i] - off < size:
                    raise self.fail(f"axis {i}: offset {off} + crop size {size} exceeds bottom "
                                    f"shape {s} (reference shape {ref})")
            self.slices.append(slice(off, off + size))
            top.append(size)
        return [tuple(top)]

    def forward(self, bottoms):
        self.reshape([bottoms[0].shape, bottoms[1].shape])
        return [bottoms[0][tuple(self.slices)]]


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
