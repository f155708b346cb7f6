"""An L2 Normalize layer as a brewnet plugin: y = x / ||x|| per sample.

The norm runs over every axis but the first: ||x|| = sqrt(sum x^2 + eps). Backward is written
out, as a Caffe layer's Backward_cpu would be: dx = (dy - y * (y . dy)) / ||x||, the sums
per sample. (Exact with eps too: eps only enters through ||x||.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from brewnet.layers import Layer, register_layer


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        dims = tuple(range(1, x.dim()))
        norm = torch.sqrt((x * x).sum(dims, keepdim=True) + eps)
        y = x / norm
        ctx.save_for_backward(y, norm)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, norm = ctx.saved_tensors
        dims = tuple(range(1, y.dim()))
        return (dy - y * (y * dy).sum(dims, keepdim=True)) / norm, None


@register_layer("L2Normalize")
class L2Normalize(Layer):
    """Bottom (N, ...) -> top of the same shape, each sample scaled to unit L2 norm.

    Params (python_param.param_str): eps, added to the sum of squares (default 1e-10, as the
    SSD fork's Normalize layer).
    """

    exact_bottoms = 1
    exact_tops = 1

    @dataclass
    class Params:
        eps: float = 1e-10

    def setup(self, bottom_shapes):
        if len(bottom_shapes[0]) < 2:
            raise self.fail(f"bottom must be (N, ...) with at least 2 axes, got {bottom_shapes[0]}")
        if self.params.eps < 0:
            raise self.fail(f"eps must be >= 0, got {self.params.eps}")

    def forward(self, bottoms):
        return [_L2Normalize.apply(bottoms[0], self.params.eps)]

    def flops(self, bottom_shapes, top_shapes):
        n = 1
        for d in bottom_shapes[0]:
            n *= int(d)
        return 3 * n  # a square-add and a divide per element
