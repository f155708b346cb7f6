"""Caffe's Adam (``adam_solver.cpp``); history holds m for every param, then v. With t = iter+1:

    m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g^2;
    step = local_rate * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

The bias correction is folded into the rate and eps is added to the uncorrected sqrt(v), as
Caffe does (torch.optim.Adam adds eps after correcting v).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .base import register
from .sgd import SGDSolver

f32 = np.float32


@register("Adam")
class AdamSolver(SGDSolver):
    history_sets = 2
    frozen_is_noop = False
    scalar_inputs = None     # the recorded update's 0-d correction tensor (execution/recorded_update.py)

    def iteration_scalars(self) -> dict:
        """The bias correction of this iteration (t = iter + 1): Caffe's pow(float, int) is a
        double; the correction is stored as a float."""
        b1, b2 = f32(self.param.momentum), f32(self.param.momentum2)
        t = self.iter + 1
        return {"correction": f32(math.sqrt(1 - math.pow(float(b2), t)) / (1 - math.pow(float(b1), t)))}

    def _coefficients(self, local_rate):
        b1, b2 = f32(self.param.momentum), f32(self.param.momentum2)
        if isinstance(local_rate, torch.Tensor):     # recorded: float32 product of 0-d tensors
            step_rate = local_rate * self.scalar_inputs["correction"]
        else:
            step_rate = float(f32(local_rate) * self.iteration_scalars()["correction"])
        return float(b1), float(f32(1) - b1), float(b2), float(f32(1) - b2), step_rate

    def compute_update(self, i, param, grad, local_rate):
        n = len(self.net.learnable)
        m, v = self.history[i], self.history[n + i]
        b1, one_b1, b2, one_b2, step_rate = self._coefficients(local_rate)
        m.mul_(b1).add_(grad, alpha=one_b1)
        v.mul_(b2).addcmul_(grad, grad, value=one_b2)
        grad.copy_(m).div_(v.sqrt().add_(float(self.param.delta))).mul_(step_rate)

    def compute_updates(self, idx, params, grads, local_rate):
        n = len(self.net.learnable)
        m, v = [self.history[i] for i in idx], [self.history[n + i] for i in idx]
        b1, one_b1, b2, one_b2, step_rate = self._coefficients(local_rate)
        torch._foreach_mul_(m, b1)
        torch._foreach_add_(m, grads, alpha=one_b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=one_b2)
        root = torch._foreach_sqrt(v)
        torch._foreach_add_(root, float(self.param.delta))
        torch._foreach_copy_(grads, m)
        torch._foreach_div_(grads, root)
        torch._foreach_mul_(grads, step_rate)
