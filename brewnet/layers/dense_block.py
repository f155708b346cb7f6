"""senlinuc/caffe_ocr's DenseBlock: a whole DenseNet block (BN, ReLU, [1x1 bottleneck], 3x3
convolution, concatenation) in one layer, its blobs in the fork's order so its caffemodels load
(github.com/senlinuc/caffe_ocr at 81642f61ea8f888e360cca30e08e05b7bc6d4556, DenseBlock_layer.cpp/.cu).
Where the fork's CPU and GPU code disagree, brewnet follows the GPU code the published models
were trained and timed with (the CPU test path divides the statistics by a counter GPU
training leaves at 0)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..proto import caffe_pb2 as pb
from .base import Layer
from .registry import register


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
