"""Seeded backward passes straight into autograd's engine.

``torch.autograd.backward`` and ``torch.autograd.grad`` first check each seed against its output
(``_make_grads``), and that check imports ``torch.fx.experimental.symbolic_shapes`` and with it
sympy: 0.8-0.9 s at the first backward of every training process here (most of the first step
of a small net). A Net's seeds are its blobs' diffs, made in the output's shape, dtype and
device, so the engine is called as those functions call it once their checks pass. Any seed
that does not match, or a torch without the engine entry point, takes the public function (and
its error message).
"""
from __future__ import annotations

import torch

try:
    from torch.autograd.graph import _engine_run_backward as _engine
except ImportError:          # pragma: no cover - a torch that moved it: the public API
    _engine = None


def _direct(outputs, grads) -> bool:
    return _engine is not None and all(
        isinstance(g, torch.Tensor) and g.shape == t.shape and g.dtype == t.dtype
        and g.device == t.device and t.requires_grad and not t.is_nested
        for t, g in zip(outputs, grads)) and len(outputs) == len(grads)


def backward(outputs, grads, inputs) -> None:
    """``torch.autograd.backward(outputs, grads, inputs=inputs)``: ``.grad`` accumulated."""
    outputs, grads, inputs = tuple(outputs), tuple(grads), tuple(inputs)
    if not _direct(outputs, grads):
        return torch.autograd.backward(outputs, grads, inputs=inputs or None)
    _engine(outputs, grads, False, False, inputs, allow_unreachable=True, accumulate_grad=True)


def grad(outputs, inputs, grads, retain_graph: bool = False):
    """``torch.autograd.grad(outputs, inputs, grads, allow_unused=True)``."""
    outputs, grads, inputs = tuple(outputs), tuple(grads), tuple(inputs)
    if not _direct(outputs, grads):
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True,
                                   retain_graph=retain_graph)
    return _engine(outputs, grads, retain_graph, False, inputs, True, accumulate_grad=False)
