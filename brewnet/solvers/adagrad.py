"""Caffe's AdaGrad (``adagrad_solver.cpp``): h <- h + g^2; step = local_rate * g / (sqrt(h) + delta)."""
from __future__ import annotations

import torch

from .base import SolverError, register
from .sgd import SGDSolver


@register("AdaGrad")
class AdaGradSolver(SGDSolver):
    frozen_is_noop = False    # h still grows by the weight decay term squared

    def check_param(self, p):
        if p.momentum != 0:
            raise SolverError(f"Momentum cannot be used with AdaGrad (momentum: {p.momentum})")

    def compute_update(self, i, param, grad, local_rate):
        h = self.history[i]
        h.addcmul_(grad, grad)
        grad.div_(h.sqrt().add_(float(self.param.delta))).mul_(local_rate)

    def compute_updates(self, idx, params, grads, local_rate):
        h = [self.history[i] for i in idx]
        torch._foreach_addcmul_(h, grads, grads)
        root = torch._foreach_sqrt(h)
        torch._foreach_add_(root, float(self.param.delta))
        torch._foreach_div_(grads, root)
        torch._foreach_mul_(grads, local_rate)
