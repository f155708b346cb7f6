"""Caffe's SGD with momentum: the learning rate sits inside the history (``sgd_solver.cpp``).

    h <- momentum * h + local_rate * g;   step = h

Differs from torch.optim.SGD: torch keeps the rate outside the buffer, so the two part ways
whenever the rate changes.
"""
from __future__ import annotations

import torch

from .base import Solver, register
from .fused import FUSED_MIN, fused_sgd_matches, sgd_update


@register("SGD")
class SGDSolver(Solver):
    frozen_is_noop = True     # lr_mult 0 gives h = momentum * 0 + 0: nothing moves

    def compute_update(self, i, param, grad, local_rate):
        h = self.history[i]
        h.mul_(float(self.param.momentum)).add_(grad, alpha=local_rate)
        grad.copy_(h)

    def compute_updates(self, idx, params, grads, local_rate):
        h = [self.history[i] for i in idx]
        torch._foreach_mul_(h, float(self.param.momentum))
        torch._foreach_add_(h, grads, alpha=local_rate)
        torch._foreach_copy_(grads, h)

    def update_params(self, todo, l2, store_step):
        # L2 decay with momentum on the CPU: one fused pass (fused.py), the same numbers.
        momentum = float(self.param.momentum)
        if (type(self).compute_update is not SGDSolver.compute_update or not l2 or momentum == 0
                or not self.foreach or not fused_sgd_matches()):
            return super().update_params(todo, l2, store_step)
        # Small params: five _foreach ops for all of them cost less than the fused call and
        # its plain-op tail per param; the fused pass pays where memory traffic dominates.
        small = [e for e in todo if e[1].numel() < FUSED_MIN]
        if small:
            super().update_params(small, l2, store_step)
            todo = [e for e in todo if e[1].numel() >= FUSED_MIN]
            if not todo:
                return
        rest, pending = sgd_update(todo, self.history, momentum)
        self._pending_steps += pending
        if store_step:
            self._store_steps()
        if rest:
            super().update_params(rest, l2, store_step)
