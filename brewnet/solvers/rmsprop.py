"""Caffe's RMSProp (``rmsprop_solver.cpp``):

    h <- rms_decay * h + (1 - rms_decay) * g^2;   step = local_rate * g / (sqrt(h) + delta)
"""
from __future__ import annotations

import numpy as np
import torch

from .base import SolverError, register
from .sgd import SGDSolver


@register("RMSProp")
class RMSPropSolver(SGDSolver):
    frozen_is_noop = False

    def check_param(self, p):
        if p.momentum != 0:
            raise SolverError(f"Momentum cannot be used with RMSProp (momentum: {p.momentum})")
        if not 0 <= p.rms_decay < 1:
            raise SolverError(f"RMSProp needs 0 <= rms_decay < 1, got {p.rms_decay}")

    def compute_update(self, i, param, grad, local_rate):
        h = self.history[i]
        d = np.float32(self.param.rms_decay)
        h.mul_(float(d)).addcmul_(grad, grad, value=float(np.float32(1) - d))
        grad.div_(h.sqrt().add_(float(self.param.delta))).mul_(local_rate)

    def compute_updates(self, idx, params, grads, local_rate):
        h = [self.history[i] for i in idx]
        d = np.float32(self.param.rms_decay)
        torch._foreach_mul_(h, float(d))
        torch._foreach_addcmul_(h, grads, grads, value=float(np.float32(1) - d))
        root = torch._foreach_sqrt(h)
        torch._foreach_add_(root, float(self.param.delta))
        torch._foreach_div_(grads, root)
        torch._foreach_mul_(grads, local_rate)
