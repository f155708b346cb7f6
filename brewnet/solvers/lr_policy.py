"""Caffe's learning-rate policies (``SGDSolver::GetLearningRate``), keyed by ``lr_policy``.

Each policy maps (SolverParameter, iter, current_step) to (rate, current_step), with ``iter``
the number of updates done so far. The rate is a float32 computed with Caffe's own precision:
``pow(float, int)`` promotes to double (step, exp, multistep) while ``pow(float, float)`` and
``exp(float)`` are float functions (inv, poly, sigmoid); a correctly rounded double result cast
to float32 stands for those. That reproduces the real Caffe's rates bit for bit.
"""
from __future__ import annotations

import math

import numpy as np

f32 = np.float32


def _powf(x, y) -> np.float32:
    # powf's domain: a negative base with a fractional power is NaN and 0 to a negative power
    # is inf (poly past max_iter) - math.pow would raise instead. A result in (0, 1] (inv's
    # and poly's every step) can do neither: the same call without errstate's cost.
    if 0 < x and (x <= 1) == (y >= 0):
        return f32(np.power(np.float64(x), np.float64(y)))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return f32(np.power(np.float64(x), np.float64(y)))


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"lr_policy: {what}")


def fixed(p, it, step):
    return f32(p.base_lr), step


def step_(p, it, step):
    _check(p.stepsize > 0, f"'step' needs stepsize > 0, got {p.stepsize}")
    _check(p.gamma >= 0, f"'step' needs gamma >= 0, got {p.gamma}")
    step = it // p.stepsize
    return f32(float(f32(p.base_lr)) * math.pow(float(f32(p.gamma)), step)), step


def exp(p, it, step):
    _check(p.gamma >= 0, f"'exp' needs gamma >= 0, got {p.gamma}")
    return f32(float(f32(p.base_lr)) * math.pow(float(f32(p.gamma)), it)), step


def inv(p, it, step):
    _check(p.gamma >= 0, f"'inv' needs gamma >= 0, got {p.gamma}")
    base = f32(1) + f32(p.gamma) * f32(it)
    return f32(p.base_lr) * _powf(base, -f32(p.power)), step


def multistep(p, it, step):
    # One step per call at most, as Caffe does (it is called once per iteration).
    if step < len(p.stepvalue) and it >= p.stepvalue[step]:
        step += 1
    _check(p.gamma >= 0, f"'multistep' needs gamma >= 0, got {p.gamma}")
    return f32(float(f32(p.base_lr)) * math.pow(float(f32(p.gamma)), step)), step


def poly(p, it, step):
    frac = f32(1) - f32(it) / f32(p.max_iter)
    return f32(p.base_lr) * _powf(frac, f32(p.power)), step


def sigmoid(p, it, step):
    _check(p.gamma >= 0, f"'sigmoid' needs gamma >= 0, got {p.gamma}")
    _check(p.stepsize > 0, f"'sigmoid' needs stepsize > 0, got {p.stepsize}")
    x = float(-f32(p.gamma) * (f32(it) - f32(p.stepsize)))
    with np.errstate(over="ignore"):                      # expf overflows to inf: rate 0
        e = f32(math.exp(min(x, 700.0)))
    return f32(p.base_lr) * (f32(1) / (f32(1) + e)), step


LR_POLICIES = {
    "fixed": fixed,
    "step": step_,
    "exp": exp,
    "inv": inv,
    "multistep": multistep,
    "poly": poly,
    "sigmoid": sigmoid,
}


def policy(name: str):
    """The policy function for ``name``; an unknown name lists the known ones."""
    try:
        return LR_POLICIES[name]
    except KeyError:
        if not name:
            raise ValueError(f"lr_policy is not set. Known: {', '.join(sorted(LR_POLICIES))}") from None
        raise ValueError(f"Unknown lr_policy '{name}'. Known: {', '.join(sorted(LR_POLICIES))}") from None
