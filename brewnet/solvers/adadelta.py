"""Caffe's AdaDelta (``adadelta_solver.cpp``), ``momentum`` as the decay; history holds the
squared-gradient averages h for every param, then the squared-update averages u:

    h <- m*h + (1-m)*g^2;  d = g * sqrt((u + delta) / (h + delta));  u <- m*u + (1-m)*d^2;
    step = local_rate * d
"""
from __future__ import annotations

import numpy as np
import torch

from .base import register
from .sgd import SGDSolver


@register("AdaDelta")
class AdaDeltaSolver(SGDSolver):
    history_sets = 2
    frozen_is_noop = False

    def compute_update(self, i, param, grad, local_rate):
        n = len(self.net.learnable)
        h, u = self.history[i], self.history[n + i]
        m = np.float32(self.param.momentum)
        one_m, delta = float(np.float32(1) - m), float(self.param.delta)
        h.mul_(float(m)).addcmul_(grad, grad, value=one_m)
        grad.mul_((u + delta).div_(h + delta).sqrt_())
        u.mul_(float(m)).addcmul_(grad, grad, value=one_m)
        grad.mul_(local_rate)

    def compute_updates(self, idx, params, grads, local_rate):
        n = len(self.net.learnable)
        h, u = [self.history[i] for i in idx], [self.history[n + i] for i in idx]
        m = np.float32(self.param.momentum)
        one_m, delta = float(np.float32(1) - m), float(self.param.delta)
        torch._foreach_mul_(h, float(m))
        torch._foreach_addcmul_(h, grads, grads, value=one_m)
        ratio = torch._foreach_add(u, delta)
        torch._foreach_div_(ratio, torch._foreach_add(h, delta))
        torch._foreach_sqrt_(ratio)
        torch._foreach_mul_(grads, ratio)
        torch._foreach_mul_(u, float(m))
        torch._foreach_addcmul_(u, grads, grads, value=one_m)
        torch._foreach_mul_(grads, local_rate)
