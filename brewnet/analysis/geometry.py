"""Receptive fields: which pixels of the net's input each unit of a blob sees.

For every N x C x H x W blob, per spatial axis: ``size`` (pixels a unit sees), ``stride`` (pixels
between neighbouring units) and ``start`` (the first pixel unit 0 sees; negative where the window
reaches into the padding): unit i sees [start + i*stride, start + i*stride + size - 1].
Convolution, Im2col, Pooling and LRN WITHIN_CHANNEL compose as a convolution (dilated kernel
k' = (k - 1) d + 1: size b + (k' - 1) s_b, stride s_b s, start o_b - p s_b); Deconvolution gives
a bound (the union over one phase's units; exact for stride 1); Crop moves the start; a layer
that keeps its bottoms' spatial size (elementwise, BatchNorm, Concat on channels...) gives the
union of their fields; anything else (InnerProduct, Reshape, SPP...) none. Strides and starts are
Fractions, so deconvolutions stay exact. Every rule: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

Field = tuple  # per spatial axis: (size, stride, start)


@dataclass(frozen=True)
class Axis:
    size: Fraction
    stride: Fraction
    start: Fraction


def unit(transposed: bool, k: int, s: int, p: int, d: int = 1) -> Axis:
    """What one top unit of a window layer sees, in bottom units: a convolution/pooling window
    (size k', stride s, start -p), or for a deconvolution the bottom units that reach it."""
    k = (k - 1) * d + 1
    if transposed:
        return Axis(1 + Fraction(k - 1, s), Fraction(1, s), Fraction(p - k + 1, s))
    return Axis(Fraction(k), Fraction(s), Fraction(-p))


def compose(f: Axis, u: Axis) -> Axis:
    """A bottom field ``f`` (in pixels) seen through a layer's ``unit`` (in bottom units)."""
    return Axis(f.size + (u.size - 1) * f.stride, f.stride * u.stride, f.start + u.start * f.stride)


def _window(f: Axis, k: int, s: int, p: int, d: int = 1) -> Axis:
    return compose(f, unit(False, k, s, p, d))


def _deconv(f: Axis, k: int, s: int, p: int, d: int = 1) -> Axis:
    return compose(f, unit(True, k, s, p, d))


def _union(fields: list[tuple[Axis, ...]]) -> tuple[Axis, ...] | None:
    if not fields or any(f is None for f in fields):
        return None
    out = []
    for axes in zip(*fields):
        if len({a.stride for a in axes}) != 1:
            return None
        start = min(a.start for a in axes)
        end = max(a.start + a.size for a in axes)
        out.append(Axis(end - start, axes[0].stride, start))
    return tuple(out)


def _top_field(layer, bottoms, b_shapes, t_shape):
    t = layer.type
    if len(t_shape) != 4 or not bottoms or bottoms[0] is None:
        return None
    f = bottoms[0]
    if t in ("Convolution", "Im2col", "Deconvolution"):
        if getattr(layer, "axis", 1) != 1 or len(layer.kernel) != 2:
            return None
        rule = _deconv if t == "Deconvolution" else _window
        return tuple(rule(a, k, s, p, d) for a, k, s, p, d in
                     zip(f, layer.kernel, layer.stride, layer.pad, layer.dilation))
    if t == "Pooling":
        if layer.global_pooling or layer.kernel is None:
            return tuple(_window(a, n, 1, 0) for a, n in zip(f, b_shapes[0][2:]))
        return tuple(_window(a, k, s, p) for a, k, s, p in zip(f, layer.kernel, layer.stride, layer.pad))
    if t == "LRN" and layer.param.lrn_param.norm_region == 1:       # WITHIN_CHANNEL
        n = layer.param.lrn_param.local_size
        return tuple(_window(a, n, 1, (n - 1) // 2) for a in f)
    if t == "Crop":
        return tuple(Axis(a.size, a.stride, a.start + sl.start * a.stride)
                     for a, sl in zip(f, layer.slices[2:]))
    spatial = tuple(t_shape[2:])
    if all(len(s) == 4 and tuple(s[2:]) == spatial for s in b_shapes[:1]):
        same = [bf for bf, s in zip(bottoms, b_shapes) if len(s) == 4 and tuple(s[2:]) == spatial]
        return _union(same)
    return None


def layer_fields(net):
    """Per layer, in order: ``{top: field}`` as that layer leaves its tops (an in-place layer
    rebinds its blob's field, as it rebinds the values)."""
    fields: dict[str, tuple | None] = {}
    one = Fraction(1)
    for layer, bottoms, tops in zip(net.layer_list, net.bottom_lists, net.top_lists):
        if not bottoms:      # the net's input: a pixel sees itself
            new = {t: (Axis(one, one, Fraction(0)),) * 2 if len(net.shapes[t]) == 4 else None
                   for t in tops}
        else:
            b_fields = [fields.get(b) for b in bottoms]
            b_shapes = [net.shapes[b] for b in bottoms]
            new = {t: _top_field(layer, b_fields, b_shapes, net.shapes[t]) for t in tops}
        fields.update(new)
        yield new


def receptive_fields(net) -> dict[str, tuple[Axis, ...] | None]:
    """{blob name: (Axis for H, Axis for W) or None} after the whole net."""
    out: dict[str, tuple | None] = {}
    for new in layer_fields(net):
        out.update(new)
    return out


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"


def describe(field) -> str:
    """``163 /16 @-64`` (size, stride, start; one per axis when they differ), or ``-``."""
    if field is None:
        return "-"
    parts = [f"{_num(a.size)} /{_num(a.stride)} @{_num(a.start)}" for a in field]
    return parts[0] if len(set(parts)) == 1 else " x ".join(parts)
