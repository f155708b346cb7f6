"""Caffe's SGD update as one pass over memory on the CPU: torch's fused SGD kernel, used only
where it gives Caffe's float32 numbers bit for bit.

Caffe's sequence (``Regularize``, ``ComputeUpdateValue``, ``Update``) reads and writes every
parameter-sized buffer five times: g += decay p; h = momentum h + rate g; g = h; p -= g. For
CaffeNet's 60M parameters that is ~1.2 GB of memory traffic per step. ``torch._fused_sgd_``
computes h = m h + (1 - dampening) (g + decay p); p -= lr h in one pass; with lr 1 and dampening
1 - rate (exact in double for the float32 rates used) it is the same operations in the same
order. Its scalar tail rounds differently from its vector loop, so the last ``numel % VEC``
elements take the plain ops, and a first-use check compares it with them on this build and CPU.
"""
from __future__ import annotations

import functools

import torch

VEC = 64   # the fused kernel's vector loop covers whole multiples of 16 floats
FUSED_MIN = 1 << 16   # params smaller than this take the _foreach ops (solvers/sgd.py)


@functools.cache
def fused_sgd_matches() -> bool:
    """Whether the fused kernel gives exactly the plain ops' numbers here."""
    if not hasattr(torch, "_fused_sgd_"):
        return False
    g = torch.Generator().manual_seed(0)
    p, d, h = (torch.randn(4 * VEC, generator=g) for _ in range(3))
    p2, d2, h2 = p.clone(), d.clone(), h.clone()
    try:
        _fused([p2], [d2], [h2], 5e-4, 0.9, 0.01)
    except (RuntimeError, TypeError):
        return False
    d.add_(p, alpha=5e-4)
    h.mul_(0.9).add_(d, alpha=0.01)
    p.sub_(h)
    return torch.equal(p, p2) and torch.equal(h, h2)


def _fused(params, diffs, hist, decay: float, momentum: float, rate: float) -> None:
    torch._fused_sgd_(params, diffs, hist, weight_decay=decay, momentum=momentum, lr=1.0,
                      dampening=1.0 - rate, nesterov=False, maximize=False, is_first_step=False)


def sgd_update(todo, history, momentum: float):
    """Apply Caffe's L2 SGD update to the (index, param, diff, decay, rate) entries of ``todo``
    it can take (CPU float32, contiguous); returns (the entries left for the plain ops, the
    (diff, step) pairs whose step still has to be copied into the diff)."""
    rest, groups, pending = [], {}, []
    for i, t, g, decay, rate in todo:
        h = history[i]
        if not (t.device.type == "cpu" and t.dtype == g.dtype == h.dtype == torch.float32
                and t.is_contiguous() and g.is_contiguous() and h.is_contiguous()
                and 1.0 - (1.0 - rate) == rate):          # the rate survives the dampening
            rest.append((i, t, g, decay, rate))
            continue
        n = t.numel() - t.numel() % VEC
        tv, gv, hv = t.view(-1), g.view(-1), h.view(-1)
        if n:
            group = groups.setdefault((decay, rate), ([], [], []))
            for lst, x in zip(group, (tv[:n], gv[:n], hv[:n])):
                lst.append(x)
        if n < t.numel():                                 # the tail, with the plain ops
            tt, gt, ht = tv[n:], gv[n:], hv[n:]
            if decay:
                gt.add_(tt, alpha=decay)
            ht.mul_(momentum).add_(gt, alpha=rate)
            tt.sub_(ht)
        pending.append((g, h))
    for (decay, rate), (ps, ds, hs) in groups.items():
        _fused(ps, ds, hs, decay, momentum, rate)
    return rest, pending
