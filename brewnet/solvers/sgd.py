"""Caffe's SGD with momentum: the learning rate sits inside the history (``sgd_solver.cpp``).

    h <- momentum * h + local_rate * g;   step = h

Differs from torch.optim.SGD: torch keeps the rate outside the buffer, so the two part ways
whenever the rate changes.
"""
from __future__ import annotations

import functools

import torch

from .base import Solver, register

VEC = 64   # _fused_sgd_'s vector loop covers whole multiples of 16 floats; its scalar tail rounds
           # differently, so the last numel % VEC elements take the plain ops


@functools.cache
def fused_sgd_matches() -> bool:
    """Whether torch's fused CPU SGD kernel (one pass: weight decay, momentum, param update)
    gives exactly the numbers of Caffe's sequence of float32 ops below, on this build and CPU."""
    if not hasattr(torch, "_fused_sgd_"):
        return False
    g = torch.Generator().manual_seed(0)
    p, d, h = (torch.randn(4 * VEC, generator=g) for _ in range(3))
    p2, d2, h2 = p.clone(), d.clone(), h.clone()
    try:
        _fused(p2, d2, h2, 5e-4, 0.9, 0.01)
    except (RuntimeError, TypeError):
        return False
    d.add_(p, alpha=5e-4)
    h.mul_(0.9).add_(d, alpha=0.01)
    p.sub_(h)
    return torch.equal(p, p2) and torch.equal(h, h2)


def _fused(params, diffs, hist, decay: float, momentum: float, rate: float) -> None:
    # torch's rule is h = m h + (1 - dampening) g; p -= lr h. With lr 1 and dampening 1 - rate
    # (exact in double for any float32 rate) it is Caffe's, operation for operation.
    as_list = (lambda x: x) if isinstance(params, list) else (lambda x: [x])
    torch._fused_sgd_(as_list(params), as_list(diffs), as_list(hist), weight_decay=decay,
                      momentum=momentum, lr=1.0, dampening=1.0 - rate, nesterov=False,
                      maximize=False, is_first_step=False)


@register("SGD")
class SGDSolver(Solver):
    frozen_is_noop = True     # lr_mult 0 gives h = momentum * 0 + 0: nothing moves

    def compute_update(self, i, param, grad, local_rate):
        h = self.history[i]
        h.mul_(float(self.param.momentum)).add_(grad, alpha=local_rate)
        grad.copy_(h)

    def update_params(self, todo, l2, store_step):
        """On the CPU, float32 SGD with L2 decay and momentum runs as one fused pass per group of
        params sharing (decay, rate), instead of five (decay, momentum scale, momentum add, step
        copy, param update), with the same numbers; the step is copied into the diffs after."""
        momentum = float(self.param.momentum)
        if (type(self).compute_update is not SGDSolver.compute_update or not l2 or momentum == 0
                or not fused_sgd_matches()):
            return super().update_params(todo, l2, store_step)
        rest, groups, pending = [], {}, []
        for i, t, g, decay, rate in todo:
            h = self.history[i]
            if not (t.device.type == "cpu" and t.dtype == g.dtype == h.dtype == torch.float32
                    and t.is_contiguous() and g.is_contiguous() and h.is_contiguous()
                    and 1.0 - (1.0 - rate) == rate):     # the rate survives the dampening
                rest.append((i, t, g, decay, rate))
                continue
            n = t.numel() - t.numel() % VEC
            tv, gv, hv = t.view(-1), g.view(-1), h.view(-1)
            if n:
                group = groups.setdefault((decay, rate), ([], [], []))
                for lst, x in zip(group, (tv[:n], gv[:n], hv[:n])):
                    lst.append(x)
            if n < t.numel():          # the tail, as compute_update does it
                tt, gt, ht = tv[n:], gv[n:], hv[n:]
                if decay:
                    gt.add_(tt, alpha=decay)
                ht.mul_(momentum).add_(gt, alpha=rate)
                tt.sub_(ht)
            pending.append((g, h))
        for (decay, rate), (ps, ds, hs) in groups.items():
            _fused(ps, ds, hs, decay, momentum, rate)
        self._pending_steps += pending
        if store_step:
            self._store_steps()
        if rest:
            super().update_params(rest, l2, store_step)
