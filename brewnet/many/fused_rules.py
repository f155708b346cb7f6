"""The fused engine's update rules (Caffe's ComputeUpdateValue for K nets at once, over stacked
slices: ``brewnet/many/fused.py``), and the per-net columns they broadcast. A rule's per-net
values come as lists (the eager step: numpy float32, computed on the host) or as float32
tensors (a recorded fused step, ``execution/recorded_fused_step.py``: inputs of the recording,
the same products)."""
from __future__ import annotations

import numpy as np
import torch

f32 = np.float32


def col(values, like: torch.Tensor) -> torch.Tensor:
    """Per-net float32 scalars as a (m, 1, ...) column broadcasting over ``like`` (m, ...);
    ``values`` a list, or a float32 tensor (m,) (a recorded step's per-iteration values)."""
    if isinstance(values, torch.Tensor):
        return values.to(dtype=like.dtype).view(-1, *([1] * (like.dim() - 1)))
    col = torch.from_numpy(np.asarray(values, dtype=np.float32))
    return col.to(device=like.device, dtype=like.dtype).view(-1, *([1] * (like.dim() - 1)))


def times(a, b):
    """Per-net float32 products: of lists (numpy float32), or of a float32 tensor by a list."""
    if isinstance(a, torch.Tensor):
        return a * torch.from_numpy(np.asarray(b, dtype=np.float32)).to(a.device)
    return [f32(x) * f32(y) for x, y in zip(a, b)]


# -- update rules over a slice of stacked nets (Caffe's ComputeUpdateValue, K at once): p, g
# and the history sets are (m, ...) slices, ``rate`` the m nets' float32 local rates ----------
def _sgd(solvers, p, g, hist, i, rate, corr):
    h, rate = hist[0], col(rate, p)
    h.mul_(col([s.param.momentum for s in solvers], h)).addcmul_(g, rate)
    p.sub_(h)


def _nesterov(solvers, p, g, hist, i, rate, corr):
    h, rate = hist[0], col(rate, p)
    m = col([s.param.momentum for s in solvers], h)
    prev = h.clone()
    h.mul_(m).addcmul_(g, rate)
    p.sub_(h * col([f32(1) + f32(s.param.momentum) for s in solvers], h) - prev * m)


def _adam(solvers, p, g, hist, i, rate, corr):
    m, v = hist
    b1 = [f32(s.param.momentum) for s in solvers]
    b2 = [f32(s.param.momentum2) for s in solvers]
    m.mul_(col(b1, m)).addcmul_(g, col([f32(1) - x for x in b1], m))
    v.mul_(col(b2, v)).addcmul_(g * g, col([f32(1) - y for y in b2], v))
    step = m / v.sqrt().add_(col([s.param.delta for s in solvers], v))
    p.sub_(step.mul_(col(rate * corr if isinstance(rate, torch.Tensor)
                          else [r * c for r, c in zip(rate, corr)], p)))


def corrections(solvers) -> list:
    """Adam's bias corrections of this iteration, per net (1 for the other rules)."""
    out = []
    for s in solvers:
        fn = getattr(s, "iteration_scalars", None)
        out.append(fn()["correction"] if fn is not None else f32(1))
    return out


UPDATES = {"SGD": _sgd, "Nesterov": _nesterov, "Adam": _adam}
