"""Caffe's SGD with momentum: the learning rate sits inside the history (``sgd_solver.cpp``).

    h <- momentum * h + local_rate * g;   step = h

Differs from torch.optim.SGD: torch keeps the rate outside the buffer, so the two part ways
whenever the rate changes.
"""
from __future__ import annotations

from .base import Solver, register


@register("SGD")
class SGDSolver(Solver):
    frozen_is_noop = True     # lr_mult 0 gives h = momentum * 0 + 0: nothing moves

    def compute_update(self, i, param, grad, local_rate):
        h = self.history[i]
        h.mul_(float(self.param.momentum)).add_(grad, alpha=local_rate)
        grad.copy_(h)
