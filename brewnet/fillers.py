"""Caffe's weight fillers (``include/caffe/filler.hpp``), keyed by FillerParameter.type.

Each filler writes into a tensor in place using torch's default generator, so
``brewnet.set_random_seed`` (or a solver's ``random_seed``) makes runs repeat exactly.
Caffe's own random stream is not reproduced; its distributions are.
"""
from __future__ import annotations

import math

import torch

FAN_IN, FAN_OUT, AVERAGE = 0, 1, 2  # FillerParameter.VarianceNorm


def _fans(t: torch.Tensor) -> tuple[float, float]:
    # Caffe: fan_in = count / shape(0); fan_out = count / shape(1) (count if 1-D).
    n = t.numel()
    fan_in = n / t.shape[0]
    fan_out = n / t.shape[1] if t.dim() > 1 else n
    return fan_in, fan_out


def _norm(t: torch.Tensor, p) -> float:
    fan_in, fan_out = _fans(t)
    return {FAN_IN: fan_in, FAN_OUT: fan_out, AVERAGE: (fan_in + fan_out) / 2}[p.variance_norm]


def constant(t, p):
    t.fill_(p.value)


def uniform(t, p):
    t.uniform_(p.min, p.max)


def gaussian(t, p):
    t.normal_(p.mean, p.std)
    if p.sparse >= 0:
        # Keep each weight with probability sparse / num_outputs (num_outputs = shape(0)).
        if t.dim() < 1:
            raise ValueError("gaussian filler with sparse needs a blob with at least 1 axis")
        keep = p.sparse / t.shape[0]
        if keep > 1:
            raise ValueError(f"gaussian filler: sparse {p.sparse} exceeds the number of outputs "
                             f"(shape(0) = {t.shape[0]}) of a blob of shape {tuple(t.shape)}")
        t.mul_(torch.bernoulli(torch.full_like(t, keep)))


def positive_unitball(t, p):
    t.uniform_(0, 1)
    rows = t.view(t.shape[0], -1)
    rows.div_(rows.sum(1, keepdim=True))


def xavier(t, p):
    a = math.sqrt(3.0 / _norm(t, p))
    t.uniform_(-a, a)


def msra(t, p):
    t.normal_(0.0, math.sqrt(2.0 / _norm(t, p)))


def bilinear(t, p):
    if t.dim() != 4 or t.shape[2] != t.shape[3]:
        raise ValueError(f"bilinear filler needs a 4-D blob with square kernels, got {tuple(t.shape)}")
    k = t.shape[3]
    f = math.ceil(k / 2.0)
    c = (k - 1) / (2.0 * f)
    x = torch.arange(k, dtype=torch.float64)
    w = 1 - torch.abs(x / f - c)
    t.copy_((w[:, None] * w[None, :]).to(t.dtype).expand_as(t))


FILLERS = {
    "constant": constant,
    "uniform": uniform,
    "gaussian": gaussian,
    "positive_unitball": positive_unitball,
    "xavier": xavier,
    "msra": msra,
    "bilinear": bilinear,
}


def fill(t: torch.Tensor, p) -> torch.Tensor:
    """Fill ``t`` in place as the FillerParameter ``p`` says; returns ``t``."""
    try:
        fn = FILLERS[p.type]
    except KeyError:
        raise ValueError(f"Unknown filler type '{p.type}'. Known: {', '.join(sorted(FILLERS))}") from None
    if p.sparse >= 0 and p.type != "gaussian":
        raise ValueError(f"filler '{p.type}': sparse is only supported by the gaussian filler")
    with torch.no_grad():
        fn(t, p)
    return t
