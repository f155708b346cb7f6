"""Caffe's Adam (``adam_solver.cpp``); history holds m for every param, then v. With t = iter+1:

    m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g^2;
    step = local_rate * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

The bias correction is folded into the rate and eps is added to the uncorrected sqrt(v), as
Caffe does (torch.optim.Adam adds eps after correcting v).
"""
from __future__ import annotations

import math

import numpy as np

from .base import register
from .sgd import SGDSolver

f32 = np.float32


@register("Adam")
class AdamSolver(SGDSolver):
    history_sets = 2
    frozen_is_noop = False

    def compute_update(self, i, param, grad, local_rate):
        n = len(self.net.learnable)
        m, v = self.history[i], self.history[n + i]
        b1, b2 = f32(self.param.momentum), f32(self.param.momentum2)
        t = self.iter + 1
        # Caffe: pow(float, int) is a double; the correction is stored as a float.
        correction = f32(math.sqrt(1 - math.pow(float(b2), t)) / (1 - math.pow(float(b1), t)))
        m.mul_(float(b1)).add_(grad, alpha=float(f32(1) - b1))
        v.mul_(float(b2)).addcmul_(grad, grad, value=float(f32(1) - b2))
        step_rate = float(f32(local_rate) * correction)
        grad.copy_(m).div_(v.sqrt().add_(float(self.param.delta))).mul_(step_rate)
