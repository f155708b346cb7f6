"""The recorded fused step: K nets' forward, backward and updates as one recording of aten ops;
on CUDA captured once more as a CUDA graph, so a step of all K is one replay.

The recorded step's idea (``recorded_step.py``) for ``FusedSolvers``: the data layer is read
eagerly and its tops are inputs; the stacked params and histories are inputs updated in place;
the per-iteration numbers are in ``scalars`` ((2, K) float32: each stack position's rate and Adam
correction, computed on the host as the eager update does); clipping scales come from the device.
Recorded when the recorded step would be (``BREWNET_STEP_GRAPH``, ``recorded_step.MIN_ITERS``; on
CUDA only when asked: ``cuda_graph.DEFAULT_ON_CUDA``), kept only if its replay gives the eager
step's bits on the same state. Keyed on the running nets, the stacked tensors and the baked-in
solver fields; refused: iter_size > 1, a layer outside ``recorded_step.PURE``, a device without
CUDA graphs. Why, and the details: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import numpy as np
import torch

from . import determinism, recorded_step
from .fast_path import FastPath
from .recorded_step import PURE, _fold, as_param_grad, device_refusal, mode
from .recording import same_bits

log = logging.getLogger("brewnet")
f32 = np.float32


def refusal(fs) -> str | None:
    """Why ``fs``'s fused step cannot be recorded (None: it can)."""
    if mode() == "0":
        return "BREWNET_STEP_GRAPH=0"
    if fs.solvers[0].param.iter_size != 1:
        return "iter_size > 1"
    why = device_refusal(fs.fused.nets[0].device, asked=mode() == "1")
    if why:
        return why
    for layer in fs.fused.nets[0].layer_list:
        if layer.exact_bottoms == 0:
            continue
        if layer.type not in PURE or not type(layer).__module__.startswith("brewnet.layers"):
            return f"layer '{layer.name}' of type {layer.type}"
    if not any(p.requires_grad for p in fs.fused.params):
        return "no param to learn"
    return None


class FusedStepGraph:
    """A ``FusedSolvers``' step as a recorded graph (see the module docstring). The loop calls
    ``forward_backward(active, iters_left)``: None leaves the iteration to the eager step; else
    (losses, outputs, first) as ``FusedSolvers._forward_backward`` gives them, and ``finish``
    then does the update part (the recording, or the replay's log lines)."""

    def __init__(self, fs):
        self.fs, self.fused = fs, fs.fused
        self.gm, self.key, self.captured = None, None, None
        self.tries, self.eager_calls = 0, 0
        self.checks: list[tuple] = []     # (layer, input index, k, ignore)
        self._pending = None              # what finish() does: ("record", ...) or ("log", ...)
        self._last_s = 1e9                # seconds the last iteration took
        self.guard = FastPath("the fused step's recorded graph",
                              "+".join(n.name for n in fs.fused.nets))

    # -- what the graph reads ------------------------------------------------------------
    def _sources(self) -> list[int]:
        from ..many.fused_layers import _is_source
        return [i for i, layer in enumerate(self.fs.fused.nets[0].layer_list) if _is_source(layer)]

    def _read(self) -> list[torch.Tensor]:
        """The data layers' tops, read once as the eager step reads them."""
        from ..many.fused_layers import _share_position
        fused, xs = self.fs.fused, []
        for i in self._sources():
            reader = fused.source.layer_list[i]
            xs += reader.forward([])
            _share_position(reader, [n.layer_list[i] for n in fused.nets if n is not fused.source])
        return xs

    @contextmanager
    def _fed(self, xs):
        """The data layers hand out ``xs`` instead of reading."""
        fused, it, saved = self.fs.fused, iter(xs), {}
        for i in self._sources():
            reader = fused.source.layer_list[i]
            tops = [next(it) for _ in fused.nets[0].top_lists[i]]
            saved[i] = reader.__dict__.get("forward")
            reader.forward = lambda bottoms, tops=tops: list(tops)
        try:
            yield
        finally:
            for i, f in saved.items():
                reader = fused.source.layer_list[i]
                if f is None:
                    del reader.forward
                else:
                    reader.forward = f

    def _state(self) -> list[torch.Tensor]:
        """The tensors the step writes in place: the stacked params, then the histories."""
        fs = self.fs
        return [p.detach() for p in fs.fused.params] + [h for row in fs.history for h in row]

    def current_key(self, active, xs) -> tuple:
        fs = self.fs
        fields = tuple((type(s), s.param.momentum, s.param.momentum2, s.param.delta,
                        s.param.weight_decay, s.param.regularization_type,
                        f32(s.param.clip_gradients), tuple(s.net.lr_mults), tuple(s.net.decay_mults))
                       for s in fs.solvers)
        return (tuple(active), tuple(fs.order), fs.exact, fields,
                tuple(id(p) for p in fs.fused.params), tuple(id(h) for row in fs.history for h in row),
                tuple((tuple(x.shape), x.dtype) for x in xs))

    def _scalars(self, active) -> torch.Tensor:
        """(2, K): each stack position's rate and Adam correction (1 elsewhere); the rates of the
        running nets come from their lr policies (moving current_step, once per iteration)."""
        from ..many.fused_rules import corrections
        fs = self.fs
        values = np.ones((2, len(fs.order)), np.float32)
        run = [k for k in fs.order if k in active]
        rates = fs._rates(run, log_now=False)
        for k, r, c in zip(run, rates, corrections([fs.solvers[k] for k in run])):
            values[:, fs.order.index(k)] = (r, c)
        self.rates = dict(zip(run, rates))
        return torch.from_numpy(values)

    # -- the step --------------------------------------------------------------------------
    def _step(self, active, *args):
        """The recorded function: args = (*xs, *state, scalars)."""
        fs = self.fs
        n_x = len(args) - len(self._state()) - 1
        xs, scalars = args[:n_x], args[-1]
        with self._fed(xs):
            total, losses, outputs = fs.fused.forward()
        learn = [p for p in fs.fused.params if p.requires_grad]
        got = iter(torch.autograd.grad(total, learn))
        grads = [as_param_grad(next(got), p) if p.requires_grad else torch.zeros_like(p.detach())
                 for p in fs.fused.params]
        norms = fs._update(set(active), grads=grads, scalars=scalars)
        flat = [t for name in fs.fused.nets[0].outputs for t in outputs[name]]
        return (losses, *flat, *grads, *norms)

    def _run(self, xs, scalars) -> tuple:
        args = [*xs, *self._state(), scalars.to(xs[0].device if xs else scalars.device)]
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            with determinism.blas_on_torch_threads():
                if self.captured is not None:
                    return self.captured([*xs, args[-1]])
                return self.gm.forward(*args)
        finally:
            torch._C._set_grad_enabled(grad_mode)

    def _results(self, out):
        """(losses, outputs, first, grads, norms) from the graph's outputs."""
        fs = self.fs
        k, names = len(fs.order), fs.fused.nets[0].outputs
        values = [f32(x) for x in out[0].cpu().numpy()]
        flat, i = out[1:1 + k * len(names)], 1 + k * len(names)
        outputs = {n: list(flat[j * k:(j + 1) * k]) for j, n in enumerate(names)}
        n = len(fs.fused.params)
        return values, outputs, list(values), out[i:i + n], out[i + n:]

    def forward_backward(self, active, iters_left: int):
        """This iteration's (losses, outputs, first) with the graph (replayed: the update is
        done too), or from the eager step on inputs read here when the graph is recorded at
        ``finish``; None: the eager step does the iteration."""
        fs = self.fs
        self._pending = None
        now = time.perf_counter()
        self._last_s, self._t0 = now - getattr(self, "_t0", now - 1e9), now   # the last step
        if self.gm is None and not self._worth(iters_left):
            self.eager_calls += 1
            return None
        xs = self._read()
        if self.gm is not None and self.current_key(active, xs) == self.key:
            from ..layers.loss import check_labels
            for layer, j, kk, ignore in self.checks:
                check_labels(layer, xs[j], kk, ignore)
            scalars = self._scalars(active)
            values, outputs, first, grads, norms = self._results(self._run(xs, scalars))
            for p, g in zip(fs.fused.params, grads):
                p.grad = g if p.requires_grad else None
            self._pending = ("log", active, norms)
            fs._check_finite(values)
            return values, outputs, first
        self.gm, self.captured = None, None
        if self.tries >= 3:
            with self._fed(xs):
                return fs._forward_backward()   # the eager step on what was read
        before = [t.clone() for t in self._state()]
        steps = [s.current_step for s in fs.solvers]
        with self._fed(xs):
            got = fs._forward_backward()
        self._pending = ("record", active, xs, got, before, steps)
        return got

    def _worth(self, iters_left: int) -> bool:
        if self.tries >= 3 or self.guard.off is not None:
            return False
        if mode() == "1":
            return True
        return (iters_left >= recorded_step.MIN_ITERS and self.eager_calls >= 2
                and self._last_s < recorded_step.MAX_EAGER_S)

    def finish(self, active) -> bool:
        """The update part of an iteration ``forward_backward`` took: the replay's lr and
        clipping lines, or the eager update then the recording and its check. False: none
        (the caller runs the eager update)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        fs = self.fs
        if pending[0] == "log":
            _, active, norms = pending
            self._log(active, norms)
            return True
        _, active, xs, (values, outputs, _), before, steps = pending
        fs._update(set(active))                          # the eager update: the reference
        eager = [t.clone() for t in self._state()]
        ref = (values, outputs, [p.grad for p in fs.fused.params])
        self._record(active, xs, before, steps, eager, ref)
        return True

    def _log(self, active, norms) -> None:
        """The eager update's lines, in its order: per group, each running net's rate, then
        its clipping line."""
        fs, norms = self.fs, list(norms)
        for _, a, b in fs.groups:
            run = [k for k in fs.order[a:b] if k in active]
            for k in run:
                fs._log_rate(k, self.rates[k])
            clips = [f32(fs.solvers[k].param.clip_gradients) for k in run]
            if run and any(c >= 0 for c in clips):
                for k, c, nv in zip(run, clips, norms.pop(0).cpu().numpy()):
                    fs.log_clipping(k, c, f32(nv))

    def _record(self, active, xs, before, steps, eager, ref) -> None:
        """Record the step on ``xs`` from the state ``before`` and keep it if its replay gives
        the eager step's bits (``eager``: the state after; ``ref``: losses, outputs, grads)."""
        from .recorded_step import _deferred_label_checks
        from .recording import RecordError, record, unbox

        fs, state = self.fs, self._state()
        self.tries += 1
        t0 = time.perf_counter()

        def reset():
            with torch.no_grad():
                for t, b in zip(state, before):
                    t.copy_(b)
            for s, c in zip(fs.solvers, steps):
                s.current_step = c
        reset()
        scalars = self._scalars(active)
        checks: list = []
        same = False
        try:
            with _deferred_label_checks(checks):
                gm = record(lambda *a: self._step(active, *a), [*xs, *state, scalars], made=True)
            reset()
            scalars = self._scalars(active)
            self.checks = []
            for layer, label, k, ignore in checks:
                idx = [j for j, x in enumerate(xs) if x.data_ptr() == label.data_ptr()
                       and x.numel() == label.numel()]
                if not idx:
                    raise RecordError(f"layer '{layer.name}' checks labels computed inside the net")
                if not any(c[1:] == (idx[0], k, ignore) for c in self.checks):
                    self.checks.append((layer, idx[0], k, ignore))
            consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
            _fold(gm, consts)
            gm.recompile()
            unbox(gm)
            self.gm = gm
            if self._captures(xs):
                self._capture(xs, scalars, state)
            out = self._results(self._run(xs, scalars))
            same = (all(same_bits(a, b) for a, b in zip(state, eager))
                    and np.array_equal(out[0], ref[0], equal_nan=True)
                    and all(same_bits(x, y) for n in ref[1] for x, y in zip(out[1][n], ref[1][n]))
                    and all(g is None or same_bits(x, g) for x, g in zip(out[3], ref[2])))
        except RecordError as e:          # the step branched on a value: declined by design
            log.debug("fused step graph: recording declined: %s", e)
        except Exception as e:           # noqa: BLE001 - the guard: the eager step goes on
            self.gm = None
            self.guard.fail(e)
        if not same:
            if self.gm is not None:
                self.guard.fail("the recorded step differs from the eager one")
            with torch.no_grad():
                for t, e in zip(state, eager):
                    t.copy_(e)
            for p, g in zip(fs.fused.params, ref[2]):
                p.grad = g
            self.gm, self.captured, self.tries = None, None, 3
            return
        self.key = self.current_key(active, xs)
        log.info("Fused nets: forward, backward and update of %d nets replayed as one %s (%d ops, "
                 "recorded in %.2g s)", len(active), "CUDA graph" if self.captured else "recorded graph",
                 sum(n.op == "call_function" for n in gm.graph.nodes), time.perf_counter() - t0)

    def _captures(self, xs) -> bool:
        """Whether the recorded graph is captured as a CUDA graph (its inputs are on CUDA)."""
        return bool(xs) and xs[0].is_cuda

    def _capture(self, xs, scalars, state) -> None:
        """The recorded graph captured as a CUDA graph, its first replay checked against the
        recorded graph's run on the same state (which the caller then checks against eager)."""
        from .cuda_graph import CapturedGraph

        before = [t.clone() for t in state]
        ref = [t.clone() for t in self._run(xs, scalars)]
        ref_state = [t.clone() for t in state]
        with torch.no_grad():
            for t, b in zip(state, before):
                t.copy_(b)
        n_x, gm = len(xs), self.gm
        self.captured = CapturedGraph(lambda *a: gm.forward(*a[:n_x], *state, a[-1]),
                                      [*xs, scalars.to(xs[0].device)], state=state)
        got = self.captured([*xs, scalars.to(xs[0].device)])
        if not (all(same_bits(a, b) for a, b in zip(got, ref)) and
                all(same_bits(a, b) for a, b in zip(state, ref_state))):
            self.captured = None
            raise RuntimeError("the CUDA graph's replay differs from the recorded graph's run")
        with torch.no_grad():
            for t, b in zip(state, before):
                t.copy_(b)
