"""Common layers: inner product, embedding, softmax, eltwise, reductions, parameters, ArgMax.

Shape rules (Caffe's ``Reshape`` methods) live in ``reshape`` and are checked there; ``forward``
is torch ops only. Pure helpers at the top (``eltwise_max``, ``sort_desc``) hold the Caffe rules
that are worth testing alone. Routing and shape layers are in ``shape.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from . import functional as Fn
from .base import Layer, canonical_axis, count
from .neuron import f32
from .registry import register

Op = pb.EltwiseParameter


# -- functional core --------------------------------------------------------------------------
def eltwise_max(xs):
    """Elementwise max with Caffe's tie rule: of the first two, ties go to the second; later
    bottoms win only when strictly greater. torch.where routes the gradient to the winner.

    Without a gradient: ``a > b ? a : b`` as clamp_min(a with NaN -> -inf, b), two vectorized
    passes (torch.where is a scalar kernel on the CPU, ~10x slower). The same values and NaN
    positions; a NaN's bit pattern may differ, and a +-0 tie gives b's zero only where the
    max instruction returns its second operand on equal inputs (x86; ARM orders -0 < +0)."""
    if (not Fn.grad_needed(*xs) and xs[0].is_floating_point()
            and all(x.dtype == xs[0].dtype for x in xs)):
        inf = float("inf")
        top = xs[0]
        for x in xs[1:]:
            # Caffe: top > x ? top : x for the first pair, x > top ? x : top after: a > b ? a : b
            a, b = (top, x) if top is xs[0] else (x, top)
            top = a.nan_to_num(-inf, inf, -inf).clamp_min_(b)
        return top
    top = torch.where(xs[0] > xs[1], xs[0], xs[1])
    for x in xs[2:]:
        top = torch.where(x > top, x, top)
    return top


def eltwise_sum(xs, coeffs):
    """sum of c_i * x_i as Caffe: the first term c_0 x_0, then one axpy per bottom, top + c_i x_i
    with a single rounding (OpenBLAS's saxpy is a fused multiply-add; so is torch.add with
    alpha), one pass each; a -0 first term stays -0 where Caffe's 0 + c x gives +0. After the
    first add, top is fresh and is added to in place: add saves no input for its backward, so
    that is safe under autograd too."""
    top = xs[0] if coeffs[0] == 1 else xs[0] * coeffs[0]
    fresh = top is not xs[0]
    for c, x in zip(coeffs[1:], xs[1:]):
        if fresh and x.dtype == top.dtype:
            top.add_(x, alpha=c)
        else:
            top, fresh = torch.add(top, x, alpha=c), True
    return top


def sort_desc(x, dim):
    """Values and indices along ``dim`` sorted descending; ties put the higher index first
    (Caffe sorts (value, index) pairs with std::greater)."""
    size = x.shape[dim]
    vals, idx = torch.sort(x.flip(dim), dim=dim, descending=True, stable=True)
    return vals, (size - 1) - idx


# -- layers -----------------------------------------------------------------------------------


@register("InnerProduct")
class InnerProduct(Layer):
    """Fully connected: y = x W^T + b over the axes from ``axis`` on.
    Shapes: (d0..d_{axis-1}, K...) -> (d0..d_{axis-1}, N). Params: inner_product_param
    {num_output, bias_term, weight_filler, bias_filler, axis, transpose}.
    Blobs: weight (N, K), or (K, N) when transpose; bias (N,)."""

    exact_bottoms = 1
    exact_tops = 1

    def flops(self, bottom_shapes, top_shapes):
        return 2 * count(self.blobs[0].shape) * count(top_shapes[0]) // self.param.inner_product_param.num_output

    def setup(self, bottom_shapes):
        p = self.param.inner_product_param
        if p.num_output <= 0:
            raise self.fail("inner_product_param.num_output must be positive")
        s = bottom_shapes[0]
        self.axis = canonical_axis(p.axis, len(s), self)
        self.n, self.k, self.transpose = p.num_output, count(s, self.axis), p.transpose
        w_shape = (self.k, self.n) if self.transpose else (self.n, self.k)
        self.blobs = [self.new_blob(w_shape, p.weight_filler)]
        if p.bias_term:
            self.blobs.append(self.new_blob((self.n,), p.bias_filler))

    def reshape(self, bottom_shapes):
        s = bottom_shapes[0]
        axis = canonical_axis(self.param.inner_product_param.axis, len(s), self)
        if count(s, axis) != self.k:
            raise self.fail(f"bottom shape {tuple(s)} has {count(s, axis)} inputs from axis {axis}, "
                            f"the weights expect {self.k}")
        return [tuple(s[:axis]) + (self.n,)]

    def forward(self, bottoms):
        x = bottoms[0]
        x2 = x.reshape(-1, self.k)
        y = Fn.inner_product(x2, self.blobs[0], self.blobs[1] if len(self.blobs) > 1 else None,
                             self.transpose)
        return [y.reshape(tuple(x.shape[:self.axis]) + (self.n,))]


@register("Embed")
class Embed(Layer):
    """Lookup table: top[..., :] = W[index] + b for each (float-stored integer) index.
    Shapes: any -> bottom shape + (num_output,). Params: embed_param {num_output, input_dim,
    bias_term, weight_filler, bias_filler}. Blobs: W (input_dim, num_output), b (num_output,).
    No gradient to the indices; indices are truncated to int as Caffe's static_cast."""

    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom_shapes):
        p = self.param.embed_param
        if p.input_dim <= 0 or p.num_output <= 0:
            raise self.fail(f"embed_param input_dim ({p.input_dim}) and num_output "
                            f"({p.num_output}) must be positive")
        self.k, self.n = p.input_dim, p.num_output
        self.blobs = [self.new_blob((self.k, self.n), p.weight_filler)]
        if p.bias_term:
            self.blobs.append(self.new_blob((self.n,), p.bias_filler))

    def allow_backward(self, bottom_index):
        return False

    def reshape(self, bottom_shapes):
        return [tuple(bottom_shapes[0]) + (self.n,)]

    def forward(self, bottoms):
        idx = bottoms[0].detach().long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.k):
            raise self.fail(f"index out of range [0, {self.k}): got values from "
                            f"{int(idx.min())} to {int(idx.max())}")
        y = F.embedding(idx, self.blobs[0])
        return [y + self.blobs[1] if len(self.blobs) > 1 else y]


@register("Softmax")
class Softmax(Layer):
    """exp(x) / sum(exp(x)) along ``axis``. Shapes: any -> same. Params: softmax_param.axis."""

    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom_shapes):
        canonical_axis(self.param.softmax_param.axis, len(bottom_shapes[0]), self)
        return [tuple(bottom_shapes[0])]

    def forward(self, bottoms):
        x = bottoms[0]
        return [torch.softmax(x, canonical_axis(self.param.softmax_param.axis, x.dim(), self))]


@register("Eltwise")
class Eltwise(Layer):
    """Elementwise SUM (with per-bottom coeff), PROD or MAX over equally shaped bottoms.
    Params: eltwise_param {operation, coeff (SUM; MAX accepts and ignores them, as Caffe),
    stable_prod_grad}. MAX ties: see eltwise_max.
    Differs from Caffe: stable_prod_grad false (x-product / x_i) is not reproduced; PROD always
    uses the exact product of the other bottoms (Caffe's default, which has no 0/0).
    One bottom: SUM only, coeff * x (FlowNet 2.0's Caffe allows one bottom, as PWC-Net's
    flow * 20 uses; its PROD and MAX would read a second one; BVLC requires two)."""

    arithmetic = "elementwise"
    min_bottoms = 1
    exact_tops = 1

    def setup(self, bottom_shapes):
        p = self.param.eltwise_param
        if len(p.coeff) not in (0, len(bottom_shapes)):
            raise self.fail(f"takes one coeff per bottom: {len(p.coeff)} coeffs for "
                            f"{len(bottom_shapes)} bottoms")
        if len(p.coeff) and p.operation == Op.PROD:  # Caffe rejects PROD only; MAX ignores them
            raise self.fail("coeff is only allowed for operation SUM (and ignored by MAX)")
        self.coeffs = [f32(c) for c in p.coeff] or [1.0] * len(bottom_shapes)
        if len(bottom_shapes) == 1 and p.operation != Op.SUM:
            raise self.fail("takes at least 2 bottom blobs for PROD and MAX (one bottom: SUM "
                            "only, as FlowNet 2.0's Caffe)")

    def reshape(self, bottom_shapes):
        if any(tuple(s) != tuple(bottom_shapes[0]) for s in bottom_shapes):
            raise self.fail(f"bottoms must have equal shapes, got {[tuple(s) for s in bottom_shapes]}")
        return [tuple(bottom_shapes[0])]

    def forward(self, bottoms):
        op = self.param.eltwise_param.operation
        if len(bottoms) == 1:
            return [bottoms[0] * self.coeffs[0]]
        if op == Op.MAX:
            return [eltwise_max(bottoms)]
        if op == Op.PROD:
            top = bottoms[0] * bottoms[1]
            # in place only without a gradient: mul saves its inputs, top among them
            grad = Fn.grad_needed(*bottoms)
            for x in bottoms[2:]:
                top = top * x if grad or x.dtype != top.dtype else top.mul_(x)
            return [top]
        return [eltwise_sum(bottoms, self.coeffs)]


@register("Axpy")
class Axpy(Layer):
    """a * x + y with one scale per channel (SENet's Axpy: the excitation applied to a residual).

    Bottoms: a (N, C) or (N, C, 1, 1), x (N, C, ...), y shaped as x. Top: x's shape. Gradients:
    to all three (a's is sum over positions of x * top_diff).
    """

    exact_bottoms = 3
    exact_tops = 1

    def reshape(self, bottom_shapes):
        a, x, y = (tuple(s) for s in bottom_shapes)
        if a[:2] != x[:2] or (len(a) == 4 and a[2:] != (1, 1)) or x != y:
            raise self.fail(f"needs a (N, C[, 1, 1]), x (N, C, ...) and y shaped as x; got {a}, {x}, {y}")
        return [x]

    def forward(self, bottoms):
        a, x, y = bottoms
        return [a.reshape(a.shape[:2] + (1,) * (x.dim() - 2)) * x + y]


@register("Reduction")
class Reduction(Layer):
    """Reduce all axes >= ``axis`` by SUM, ASUM (sum |x|), SUMSQ or MEAN, times ``coeff``.
    Shapes: (d0..d_{axis-1}, ...) -> (d0..d_{axis-1}) (axis 0: a 0-D scalar).
    Params: reduction_param {operation, axis, coeff}."""

    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom_shapes):
        s = tuple(bottom_shapes[0])
        self.axis = canonical_axis(self.param.reduction_param.axis, len(s), self)
        return [s[:self.axis]]

    def forward(self, bottoms):
        x = bottoms[0]
        p = self.param.reduction_param
        axis = canonical_axis(p.axis, x.dim(), self)
        rows = x.reshape(count(x.shape, 0, axis), -1)
        coeff = f32(p.coeff)
        R = pb.ReductionParameter
        if p.operation == R.ASUM:
            y = rows.abs().sum(1)
        elif p.operation == R.SUMSQ:
            y = (rows * rows).sum(1)
        elif p.operation in (R.SUM, R.MEAN):
            y = rows.sum(1)
            if p.operation == R.MEAN:
                coeff = f32(coeff / max(rows.shape[1], 1))
        else:
            raise self.fail(f"unknown reduction operation {p.operation}")
        y = y if coeff == 1 else y * coeff
        return [y.reshape(tuple(x.shape[:axis]))]


@register("Parameter")
class Parameter(Layer):
    """Expose a learnable blob as the top (its diff is the top's diff).
    Shapes: no bottom -> parameter_param.shape. Blob: that shape, zero-filled as Caffe."""

    routing = True
    exact_bottoms = 0
    exact_tops = 1

    def setup(self, bottom_shapes):
        self.blobs = [self.new_blob(tuple(self.param.parameter_param.shape.dim))]

    def reshape(self, bottom_shapes):
        return [tuple(self.param.parameter_param.shape.dim)]

    def forward(self, bottoms):
        return [self.blobs[0].view_as(self.blobs[0])]


@register("ArgMax")
class ArgMax(Layer):
    """Indices (and optionally values) of the top_k largest entries, as floats.
    Without axis: over count(1..) per item -> (N, 1 or 2, top_k[, 1...]) (2 = indices then
    values with out_max_val). With axis: shape[axis] = top_k, values instead of indices if
    out_max_val. Params: argmax_param {out_max_val, top_k, axis}. Ties: higher index first.
    No backward."""

    arithmetic = "exact"
    exact_bottoms = 1
    exact_tops = 1

    def allow_backward(self, bottom_index):
        return False

    def reshape(self, bottom_shapes):
        s = tuple(bottom_shapes[0])
        p = self.param.argmax_param
        k = p.top_k
        if k < 1:
            raise self.fail(f"top_k must be at least 1, got {k}")
        if p.HasField("axis"):
            a = canonical_axis(p.axis, len(s), self)
            if k > s[a]:
                raise self.fail(f"top_k {k} exceeds axis {a} of shape {s}")
            return [s[:a] + (k,) + s[a + 1:]]
        if k > count(s, 1):
            raise self.fail(f"top_k {k} exceeds the {count(s, 1)} values per item of shape {s}")
        top = [1] * max(3, len(s))
        top[0], top[1], top[2] = s[0], 2 if p.out_max_val else 1, k
        return [tuple(top)]

    def forward(self, bottoms):
        x = bottoms[0].detach()
        p = self.param.argmax_param
        top = self.reshape([x.shape])[0]
        k = p.top_k
        if p.HasField("axis"):
            a = canonical_axis(p.axis, x.dim(), self)
            vals, idx = sort_desc(x, a)
            out = vals.narrow(a, 0, k) if p.out_max_val else idx.narrow(a, 0, k).to(x.dtype)
            return [out.contiguous()]
        vals, idx = sort_desc(x.reshape(x.shape[0], -1), 1)
        idx = idx[:, :k].to(x.dtype)
        out = torch.stack([idx, vals[:, :k]], 1) if p.out_max_val else idx
        return [out.reshape(top)]
