"""Caffe's GradientChecker (``include/caffe/test/test_gradient_check_util.hpp``) for any brewnet
layer: built-in, plugin, or a pycaffe Python layer (through ``type: "Python"``).

    from brewnet.layers import create_layer
    from brewnet.testing import GradientChecker

    layer = create_layer('name: "n" type: "L2Normalize" bottom: "x" top: "y"')
    GradientChecker(1e-2, 1e-3).check_gradient_exhaustive(layer, [torch.randn(2, 3, 4)])

Caffe's semantics are ``GradientChecker``'s. Unlike Caffe, which logs each failed EXPECT_NEAR and
goes on, one ``GradientCheckError`` lists the mismatches; the layer's parameters and the caller's
RNG state are left as they were.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers.base import Layer

_SHOWN = 10  # mismatches spelled out in an error; the rest are counted


class GradientCheckError(AssertionError):
    """The analytic and numeric gradients differ; ``failures`` holds one dict per element."""

    def __init__(self, message: str, failures: list[dict]):
        super().__init__(message)
        self.failures = failures


@dataclass
class CheckResult:
    """The outcome of a gradient check that passed."""
    compared: int  # (element, objective) pairs compared
    skipped: int   # pairs in the kink region, not compared
    worst: float   # largest |analytic - numeric| / (threshold · scale): <= 1 when it passed


class GradientChecker:
    """Caffe's ``GradientChecker(stepsize, threshold, seed, kink, kink_range)``: numeric against
    analytic gradients of a layer, with Caffe's semantics:

    - The objective is a loss put on the tops: ``check_gradient`` uses ½·Σ top² over every top
      (top diff = top data); the single-output checks (``check_gradient_exhaustive`` runs one per
      top element, ``check_gradient_eltwise`` too) use ``2·top[top_id][j]`` (diff 2 there, else 0).
    - The analytic gradient is one backward from that top diff (autograd, or the layer's own
      backward); the numeric one is (f(x + h) - f(x - h)) / 2h per element, with torch's RNG
      reseeded to ``seed`` before every forward, so random layers (Dropout) draw the same values.
    - An element passes when |analytic - numeric| <= threshold · max(|analytic|, |numeric|, 1);
      one whose value x has kink - kink_range <= |x| <= kink + kink_range, a nonsmooth point, is
      not compared (ReLU: kink 0, a small kink_range); kink_range -1 compares everything.
    - ``check_bottom``: -1 checks every bottom and every parameter blob, i >= 0 bottom i and the
      parameters, < -1 the parameters only; the check runs in the bottoms' dtype (float64
      bottoms: parameters cast to it)."""
    def __init__(self, stepsize: float = 1e-2, threshold: float = 1e-3, seed: int = 1701,
                 kink: float = 0.0, kink_range: float = -1.0):
        self.stepsize, self.threshold, self.seed = stepsize, threshold, seed
        self.kink, self.kink_range = kink, kink_range

    # -- Caffe's four entry points ---------------------------------------------------------------
    def check_gradient(self, layer: Layer, bottoms, tops: list | None = None,
                       check_bottom: int = -1) -> CheckResult:
        """Set the layer up and check d(½·Σ top²)/d(checked blobs)."""
        bottoms = _set_up(layer, bottoms)
        return self.check_gradient_single(layer, bottoms, tops, check_bottom, -1, -1)

    def check_gradient_exhaustive(self, layer: Layer, bottoms, tops: list | None = None,
                                  check_bottom: int = -1) -> CheckResult:
        """Set the layer up and check the gradient of every top element on its own."""
        bottoms = _set_up(layer, bottoms, "exhaustive")
        outputs = [(i, j) for i, n in enumerate(_top_counts(layer, bottoms)) for j in range(n)]
        return self._check(layer, bottoms, tops, check_bottom, outputs, element_wise=False)

    def check_gradient_eltwise(self, layer: Layer, bottoms, tops: list | None = None) -> CheckResult:
        """For elementwise layers (top j depends on bottom element j only): numeric differences
        for the matching element, and every other analytic derivative must be 0."""
        bottoms = _set_up(layer, bottoms, "eltwise")
        outputs = [(i, j) for i, n in enumerate(_top_counts(layer, bottoms)) for j in range(n)]
        return self._check(layer, bottoms, tops, -1, outputs, element_wise=True)

    def check_gradient_single(self, layer: Layer, bottoms, tops: list | None, check_bottom: int,
                              top_id: int, top_data_id: int, element_wise: bool = False
                              ) -> CheckResult:
        """One objective on a layer already set up: top_id < 0 is ½·Σ top², else
        2·top[top_id].flat[top_data_id]."""
        bottoms = _tensors(bottoms)
        if element_wise and (top_id < 0 or top_data_id < 0):
            raise ValueError("element_wise checks need top_id >= 0 and top_data_id >= 0")
        outputs = [None] if top_id < 0 else [(top_id, top_data_id)]
        return self._check(layer, bottoms, tops, check_bottom, outputs, element_wise)

    # -- the check -------------------------------------------------------------------------------
    def _check(self, layer, bottoms, tops, check_bottom, outputs, element_wise) -> CheckResult:
        who = f"Layer '{layer.name}' (type {layer.type})"
        dtype = next((b.dtype for b in bottoms if b.is_floating_point()), torch.float32)
        if element_wise:
            if layer.blobs:
                raise ValueError(f"{who}: an eltwise check needs a layer without parameters")
            counts = _top_counts(layer, bottoms)
            if any(b.numel() != counts[i] for i, _ in outputs for b in bottoms):
                raise ValueError(f"{who}: an eltwise check needs bottoms as large as each top")
        if check_bottom >= len(bottoms):
            raise ValueError(f"{who}: check_bottom {check_bottom} with {len(bottoms)} bottoms")
        checked = list(range(len(bottoms))) if check_bottom == -1 else (
            [check_bottom] if check_bottom >= 0 else [])
        for i in checked:
            if not bottoms[i].is_floating_point() or not layer.allow_backward(i):
                raise ValueError(f"{who}: bottom {i} takes no gradient (labels, indices); pass "
                                 f"check_bottom with the bottom to check, as Caffe's tests do")
        saved = layer.blobs
        layer.blobs = [p.detach().to(dtype).clone().requires_grad_(True) for p in saved]
        xs = [b.detach().clone().requires_grad_(i in checked) for i, b in enumerate(bottoms)]
        blobs = [(f"param {k}", p) for k, p in enumerate(layer.blobs)] + [
            (_bottom_name(layer, i), xs[i]) for i in checked]
        if not blobs:
            raise ValueError(f"{who}: no blobs to check")
        try:
            with torch.random.fork_rng(devices=[]):
                return self._compare(layer, xs, tops, blobs, outputs, element_wise, dtype, who)
        finally:
            layer.blobs = saved

    def _forward(self, layer, xs):
        torch.manual_seed(self.seed)
        return layer.forward(list(xs))

    def _compare(self, layer, xs, tops, blobs, outputs, element_wise, dtype, who) -> CheckResult:
        out = self._forward(layer, xs)
        if tops is not None:
            tops[:] = [t.detach() for t in out]
        analytic = []  # per objective: one gradient tensor per checked blob
        for o in outputs:
            diffs = [t.detach().clone() if o is None else torch.zeros_like(t) for t in out]
            if o is not None:
                diffs[o[0]].view(-1)[o[1]] = 2
            for _, b in blobs:
                b.grad = None  # Caffe zeroes the parameter diffs before Backward
            live = [(t, d) for t, d in zip(out, diffs) if t.requires_grad]
            if live:
                torch.autograd.backward([t for t, _ in live], [d for _, d in live], retain_graph=True)
            analytic.append([torch.zeros_like(b) if b.grad is None else b.grad.detach().clone()
                             for _, b in blobs])
        h = torch.tensor(self.stepsize, dtype=dtype)
        failures, compared, skipped, worst = [], 0, 0, 0.0
        with torch.no_grad():
            for k, (name, b) in enumerate(blobs):
                flat = b.view(-1)
                for e in range(flat.numel()):
                    wanted = [n for n, o in enumerate(outputs) if not element_wise or o[1] == e]
                    if wanted:
                        orig = flat[e].clone()
                        flat[e] = orig + h
                        plus = _objectives(self._forward(layer, xs), outputs)
                        flat[e] = orig - h
                        minus = _objectives(self._forward(layer, xs), outputs)
                        flat[e] = orig  # exactly restored (Caffe adds h back, which may round)
                        numeric = (plus - minus) / h / 2
                    feature = float(flat[e])
                    in_kink = self.kink - self.kink_range <= abs(feature) <= self.kink + self.kink_range
                    for n, o in enumerate(outputs):
                        if in_kink:
                            skipped += 1
                            continue
                        est = float(numeric[n]) if n in wanted else 0.0
                        got = float(analytic[n][k].view(-1)[e])
                        tol = self.threshold * max(abs(got), abs(est), 1.0)
                        worst, compared = max(worst, abs(got - est) / tol), compared + 1
                        if not abs(got - est) <= tol:  # a NaN fails too
                            failures.append(dict(blob=name, index=_unravel(e, b.shape), flat=e,
                                                 analytic=got, numeric=est, feature=feature,
                                                 objective=o))
        if failures:
            raise GradientCheckError(self._message(who, failures, compared), failures)
        return CheckResult(compared, skipped, worst)

    def _message(self, who, failures, compared) -> str:
        lines = [f"{who}: gradient check failed at {len(failures)} of {compared} compared elements "
                 f"(stepsize {self.stepsize:g}, threshold {self.threshold:g} x max(|analytic|, "
                 f"|numeric|, 1)):"]
        for f in failures[:_SHOWN]:
            obj = "½·Σ top²" if f["objective"] is None else \
                f"2·top {f['objective'][0]}[{f['objective'][1]}]"
            lines.append(f"  {f['blob']} index {f['index']} (flat {f['flat']}): analytic "
                         f"{f['analytic']:.6g}, numeric {f['numeric']:.6g} (value {f['feature']:.6g}; "
                         f"objective {obj})")
        if len(failures) > _SHOWN:
            lines.append(f"  ... and {len(failures) - _SHOWN} more")
        return "\n".join(lines)


def _objectives(tops, outputs) -> torch.Tensor:
    if outputs == [None]:
        return (sum((t * t).sum() for t in tops) / 2).reshape(1)
    return torch.stack([2 * tops[i].reshape(-1)[j] for i, j in outputs])


def _tensors(bottoms) -> list[torch.Tensor]:
    return [torch.as_tensor(b) for b in bottoms]


def _set_up(layer: Layer, bottoms, mode: str | None = None) -> list[torch.Tensor]:
    bottoms = _tensors(bottoms)
    layer.set_up([tuple(b.shape) for b in bottoms])
    if mode and layer.num_tops == 0:
        raise ValueError(f"Layer '{layer.name}': {mode} mode requires at least one top blob")
    return bottoms


def _top_counts(layer: Layer, bottoms) -> list[int]:
    return [int(torch.Size(s).numel()) for s in layer.top_shapes([tuple(b.shape) for b in bottoms])]


def _bottom_name(layer: Layer, i: int) -> str:
    names = layer.param.bottom
    return f"bottom {i} ('{names[i]}')" if i < len(names) else f"bottom {i}"


def _unravel(e: int, shape) -> tuple[int, ...]:
    idx = []
    for d in reversed(tuple(shape)):
        idx.append(e % d)
        e //= d
    return tuple(reversed(idx))
