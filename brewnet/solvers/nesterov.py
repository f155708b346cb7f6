"""Caffe's Nesterov momentum (``nesterov_solver.cpp``):

    h' = momentum * h + local_rate * g;   step = (1 + momentum) * h' - momentum * h
"""
from __future__ import annotations

import numpy as np
import torch

from ..execution.recorded_update import scaled_add, scaled_add_
from .base import register
from .sgd import SGDSolver


@register("Nesterov")
class NesterovSolver(SGDSolver):
    def compute_update(self, i, param, grad, local_rate):
        h = self.history[i]
        m = float(self.param.momentum)
        prev = h.clone()
        scaled_add(h.mul_(m), grad, local_rate)
        grad.copy_(h).mul_(float(np.float32(1) + np.float32(self.param.momentum))).sub_(prev, alpha=m)

    def compute_updates(self, idx, params, grads, local_rate):
        h = [self.history[i] for i in idx]
        m = float(self.param.momentum)
        prev = [x.clone() for x in h]
        torch._foreach_mul_(h, m)
        scaled_add_(h, grads, local_rate)
        torch._foreach_copy_(grads, h)
        torch._foreach_mul_(grads, float(np.float32(1) + np.float32(self.param.momentum)))
        torch._foreach_sub_(grads, prev, alpha=m)
