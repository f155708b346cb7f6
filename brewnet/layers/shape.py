"""Routing and shape layers: Concat, Slice, Split, Flatten, Reshape, Tile, Filter,
BatchReindex, Silence, the SSD fork's Permute, caffe_ocr's Transpose and Reverse and happynear's
Flip. They move or select values; none computes anything new.

``reshape_shape`` holds Caffe's Reshape rule (0 copies a dim, -1 infers one) and is tested alone.
"""
from __future__ import annotations

import torch

from .base import Layer, canonical_axis, count
from .registry import register


def reshape_shape(bottom, dims, axis=0, num_axes=-1, who=None):
    """Caffe's Reshape rule: replace axes [axis, axis + num_axes) of ``bottom`` by ``dims``;
    0 copies the bottom dim at that position, one -1 is inferred. Negative ``axis`` counts from
    the end with +1 (-1 appends)."""
    fail = (who.fail if who is not None else ValueError)
    n = len(bottom)
    start = axis if axis >= 0 else n + axis + 1
    if not 0 <= start <= n:
        raise fail(f"reshape axis {axis} out of range for bottom shape {tuple(bottom)}")
    if num_axes < -1:
        raise fail(f"reshape num_axes must be >= -1, got {num_axes}")
    end = n if num_axes == -1 else start + num_axes
    if end > n:
        raise fail(f"reshape axis {axis} + num_axes {num_axes} exceed bottom shape {tuple(bottom)}")
    if list(dims).count(-1) > 1:
        raise fail(f"reshape shape {list(dims)} has more than one -1")
    new = []
    for i, d in enumerate(dims):
        if d == 0:
            if start + i >= n:
                raise fail(f"reshape shape {list(dims)} has a 0 at position {i} but bottom "
                           f"{tuple(bottom)} has no axis {start + i} to copy")
            d = bottom[start + i]
        elif d < -1:
            raise fail(f"reshape shape {list(dims)} has an invalid dim {d}")
        new.append(int(d))
    top = list(bottom[:start]) + new + list(bottom[end:])
    total = count(bottom)
    if -1 in new:
        known = count([d for d in top if d != -1])
        if known == 0 or total % known:
            raise fail(f"bottom count {total} (shape {tuple(bottom)}) is not divisible by the "
                       f"product {known} of the reshape dims {list(dims)}")
        top[start + new.index(-1)] = total // known
    if count(top) != total:
        raise fail(f"reshape of {tuple(bottom)} to {tuple(top)} changes the count")
    return tuple(top)


def _legacy_axis(layer, msg, legacy_name, num_axes):
    """Concat/Slice: ``axis`` or the deprecated ``*_dim`` (not both; the legacy one is >= 0)."""
    if msg.HasField("axis") and msg.HasField(legacy_name):
        raise layer.fail(f"give either axis or {legacy_name}, not both")
    if msg.HasField(legacy_name):
        a = getattr(msg, legacy_name)
        if a >= num_axes:
            raise layer.fail(f"{legacy_name} {a} out of range for a {num_axes}-D blob")
        return a
    return canonical_axis(msg.axis, num_axes, layer)


@register("Concat")
class Concat(Layer):
    """Join bottoms along ``axis``. Shapes: all equal except at axis -> summed there.
    Params: concat_param.axis, or legacy concat_dim."""

    routing = True
    min_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom_shapes):
        s0 = tuple(bottom_shapes[0])
        self.axis = _legacy_axis(self, self.param.concat_param, "concat_dim", len(s0))
        for s in bottom_shapes[1:]:
            if len(s) != len(s0) or any(a != b for i, (a, b) in enumerate(zip(s, s0)) if i != self.axis):
                raise self.fail(f"bottom shapes {[tuple(b) for b in bottom_shapes]} differ "
                                f"outside the concat axis {self.axis}")
        return [s0[:self.axis] + (sum(s[self.axis] for s in bottom_shapes),) + s0[self.axis + 1:]]

    def forward(self, bottoms):
        return [torch.cat(bottoms, self.axis) if len(bottoms) > 1 else bottoms[0].view_as(bottoms[0])]


@register("Slice")
class Slice(Layer):
    """Split the bottom along ``axis`` at slice_point(s), or into equal parts.
    Shapes: one bottom -> one top per piece. Params: slice_param {axis | slice_dim, slice_point}."""

    routing = True
    exact_bottoms = 1
    min_tops = 1

    def reshape(self, bottom_shapes):
        s = tuple(bottom_shapes[0])
        p = self.param.slice_param
        self.axis = _legacy_axis(self, p, "slice_dim", len(s))
        dim, ntop = s[self.axis], self.num_tops
        points = list(p.slice_point)
        if points:
            if len(points) != ntop - 1:
                raise self.fail(f"{len(points)} slice_point(s) for {ntop} tops (need {ntop - 1})")
            if any(b <= a for a, b in zip([0] + points, points + [dim])):
                raise self.fail(f"slice_point {points} must increase strictly within (0, {dim}) "
                                f"(axis {self.axis} of shape {s})")
            self.sizes = [b - a for a, b in zip([0] + points, points + [dim])]
        else:
            if dim % ntop:
                raise self.fail(f"{ntop} tops do not evenly divide axis {self.axis} of shape {s}")
            self.sizes = [dim // ntop] * ntop
        return [s[:self.axis] + (n,) + s[self.axis + 1:] for n in self.sizes]

    def forward(self, bottoms):
        return list(torch.split(bottoms[0], self.sizes, self.axis))


@register("Split")
class Split(Layer):
    """Copy the bottom to every top (shared data); backward sums the top diffs.
    Shapes: x -> x, x, ... Params: none."""

    routing = True
    exact_bottoms = 1
    min_tops = 1

    def forward(self, bottoms):
        x = bottoms[0]
        return [x.view_as(x) for _ in range(self.num_tops)]  # distinct graph nodes, no copies


@register("Flatten")
class Flatten(Layer):
    """Merge axes [axis, end_axis] into one. Shapes: (a, b, c, d) -> e.g. (a, b*c*d).
    Params: flatten_param {axis, end_axis}. Not in place (a view)."""

    routing = True
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def reshape(self, bottom_shapes):
        s = tuple(bottom_shapes[0])
        p = self.param.flatten_param
        a = canonical_axis(p.axis, len(s), self)
        e = canonical_axis(p.end_axis, len(s), self)
        if e < a:
            raise self.fail(f"end_axis {p.end_axis} comes before axis {p.axis} for shape {s}")
        return [s[:a] + (count(s, a, e + 1),) + s[e + 1:]]

    def forward(self, bottoms):
        x = bottoms[0]
        return [x.reshape(self.reshape([x.shape])[0])]


@register("Reshape")
class Reshape(Layer):
    """Change the shape, keeping the data. Shapes: see reshape_shape (0 copies, -1 infers).
    Params: reshape_param {shape, axis, num_axes}. Not in place (a view)."""

    routing = True
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def reshape(self, bottom_shapes):
        p = self.param.reshape_param
        return [reshape_shape(tuple(bottom_shapes[0]), list(p.shape.dim), p.axis, p.num_axes, self)]

    def forward(self, bottoms):
        x = bottoms[0]
        return [x.reshape(self.reshape([x.shape])[0])]


@register("Tile")
class Tile(Layer):
    """Repeat the block of axes >= ``axis`` ``tiles`` times along ``axis``.
    Shapes: (..., d_axis, ...) -> (..., d_axis * tiles, ...). Params: tile_param {axis, tiles}."""

    routing = True
    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom_shapes):
        s = tuple(bottom_shapes[0])
        p = self.param.tile_param
        if p.tiles <= 0:
            raise self.fail(f"tile_param.tiles must be positive, got {p.tiles}")
        self.axis = canonical_axis(p.axis, len(s), self)
        return [s[:self.axis] + (s[self.axis] * p.tiles,) + s[self.axis + 1:]]

    def forward(self, bottoms):
        x = bottoms[0]
        top = self.reshape([x.shape])[0]
        outer = count(x.shape, 0, self.axis)
        return [x.reshape(outer, -1).repeat(1, self.param.tile_param.tiles).reshape(top)]


@register("Filter")
class Filter(Layer):
    """Keep the items (axis 0) whose selector (last bottom, shape (N, 1, ...)) is non-zero.
    Shapes: (N, ...)..., (N,) -> (n_selected, ...)... ``reshape`` gives Caffe's setup shape
    (all N); ``forward`` returns the selected rows (a data-dependent shape, as Caffe's
    per-forward Reshape). No gradient to the selector; unselected rows get diff 0."""

    routing = True
    min_bottoms = 2

    def allow_backward(self, bottom_index):
        return bottom_index != len(self.param.bottom) - 1

    def reshape(self, bottom_shapes):
        if self.num_tops != len(bottom_shapes) - 1:
            raise self.fail(f"needs one top per filtered bottom: {len(bottom_shapes) - 1} "
                            f"bottoms, {self.num_tops} tops")
        sel = tuple(bottom_shapes[-1])
        if len(sel) < 1 or any(d != 1 for d in sel[1:]):
            raise self.fail(f"selector shape {sel} must be (N,) or (N, 1, ...)")
        if any(s[0] != sel[0] for s in bottom_shapes[:-1]):
            raise self.fail(f"bottoms {[tuple(s) for s in bottom_shapes]} must all have the "
                            f"selector's first dimension {sel[0]}")
        return [tuple(s) for s in bottom_shapes[:-1]]

    def forward(self, bottoms):
        keep = torch.nonzero(bottoms[-1].detach().reshape(-1) != 0).reshape(-1)
        return [x.index_select(0, keep) for x in bottoms[:-1]]


@register("BatchReindex")
class BatchReindex(Layer):
    """top[i] = bottom[indices[i]] along axis 0 (repeats allowed; backward scatter-adds).
    Shapes: (N, ...), (M,) -> (M, ...). Params: none. No gradient to the indices."""

    routing = True
    exact_bottoms = 2
    exact_tops = 1

    def allow_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom_shapes):
        s, ix = tuple(bottom_shapes[0]), tuple(bottom_shapes[1])
        if len(ix) != 1:
            raise self.fail(f"indices must be 1-D, got shape {ix}")
        return [(ix[0],) + s[1:]]

    def forward(self, bottoms):
        x, ix = bottoms[0], bottoms[1].detach().long()
        if ix.numel() and (int(ix.min()) < 0 or int(ix.max()) >= x.shape[0]):
            raise self.fail(f"index out of range [0, {x.shape[0]}): got values from "
                            f"{int(ix.min())} to {int(ix.max())}")
        return [x.index_select(0, ix)]


@register("Silence")
class Silence(Layer):
    """Consume bottoms, produce nothing (their diffs stay zero). Shapes: any -> no tops."""

    routing = True
    min_bottoms = 1
    exact_tops = 0

    def reshape(self, bottom_shapes):
        return []

    def forward(self, bottoms):
        return []


@register("Permute")
class Permute(Layer):
    """Reorder the axes (SSD's NCHW -> NHWC before flattening box predictions).

    Bottom any shape -> top with axes permute_param.order, the unnamed axes appended in order.
    """

    routing = True
    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False

    def setup(self, bottom_shapes):
        n = len(bottom_shapes[0])
        order = [int(o) for o in self.param.permute_param.order]
        if any(o >= n for o in order) or len(set(order)) != len(order):
            raise self.fail(f"order {order} must name distinct axes of the {n}-D bottom "
                            f"{tuple(bottom_shapes[0])}")
        self.order = order + [i for i in range(n) if i not in order]

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) != len(self.order):
            raise self.fail(f"bottom {shape} must keep the {len(self.order)} axes it was set up with")
        return [tuple(shape[o] for o in self.order)]

    def forward(self, bottoms):
        return [bottoms[0].permute(self.order).contiguous()]


class Rearrange(Layer):
    """Base of layers that move each value of one bottom to one place of one top (no arithmetic)."""

    exact_bottoms = 1
    exact_tops = 1
    in_place_ok = False
    routing = True
    arithmetic = "elementwise"


@register("ShuffleChannel")
class ShuffleChannel(Rearrange):
    """ShuffleNet's channel shuffle: the channels seen as a (group, C / group) grid are read out
    by column, so output channel j * group + i is input channel i * (C / group) + j.

    Bottom (N, C, ...) -> top of the same shape. Params: shuffle_channel_param.group (> 0, divides
    C). Gradient: the inverse shuffle.
    """

    def setup(self, bottom_shapes):
        self.group = self.param.shuffle_channel_param.group
        if self.group <= 0:
            raise self.fail(f"group must be > 0, got {self.group}")

    def reshape(self, bottom_shapes):
        shape = tuple(bottom_shapes[0])
        if len(shape) < 2 or shape[1] % self.group:
            raise self.fail(f"channels of {shape} must be a multiple of group {self.group}")
        return [shape]

    def forward(self, bottoms):
        x = bottoms[0]
        n, c = x.shape[:2]
        g = x.reshape(n, self.group, c // self.group, -1).transpose(1, 2)
        return [g.reshape(x.shape)]


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
