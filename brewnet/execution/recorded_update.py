"""The recorded update: a solver's update (Caffe's ``ApplyUpdate``) as a recording of tensor ops.

The eager update (``Solver.apply_update``) takes its per-iteration numbers as Python floats, which
a capture would freeze. Here it is ``update(*grads, *params, *history, scalars)``: ``scalars``
holds each lr_mult group's rate and the rule's ``iteration_scalars`` (Adam's correction), computed
on the host as the eager update computes them; the clipping norm and scale come from the device;
what is fixed for a run is baked in and part of the key. The rules' own ``compute_updates`` run on
it in Caffe's order (clip; per param normalise, regularise, the rule, ``param -= diff``; the diff
keeps the step): the same bits as the eager update, checked at recording (``recording.py``, at the
first update with the recorded step in use; a mismatch keeps the eager update). On CUDA it is
captured with the step (``cuda_graph.CudaStepGraph``); the CPU keeps the eager one (``ON_CPU``).
Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..solvers.lr_policy import policy

log = logging.getLogger("brewnet")
f32 = np.float32
ON_CPU = False   # the recorded update replaces the eager one on the CPU too (measured: no gain)


def scaled_add_(hs: list, gs: list, rate) -> None:
    """``h += rate * g`` for each pair (Caffe's axpy), ``rate`` a float or a 0-d tensor.
    ``addcmul`` by the 0-d tensor gives ``add``'s ``alpha=`` bits in the vector lanes and the
    scalar tail (tests/test_graph_update.py); ``add_(g * rate)`` rounds the product first and
    differs in the vector lanes (55 of 1000 elements, AVX2)."""
    if isinstance(rate, torch.Tensor):
        torch._foreach_addcmul_(hs, gs, [rate] * len(hs))
    else:
        torch._foreach_add_(hs, gs, alpha=rate)


def _iteration_scalars(solver) -> dict:
    """The rule's per-iteration values besides the rate (Adam: its bias correction)."""
    fn = getattr(solver, "iteration_scalars", None)
    return fn() if fn is not None else {}


def scaled_add(h: torch.Tensor, g: torch.Tensor, rate) -> torch.Tensor:
    """``scaled_add_`` for one tensor (``h += rate * g``; the per-param rules)."""
    if isinstance(rate, torch.Tensor):
        return h.addcmul_(g, rate)
    return h.add_(g, alpha=rate)


def _ours(kind: type, method: str) -> bool:
    """``kind``'s ``method`` is one of brewnet's solver modules' (not a user's override)."""
    owner = next((c for c in kind.__mro__ if method in c.__dict__), None)
    return owner is not None and owner.__module__.startswith("brewnet.solvers.")


def refusal(solver) -> str | None:
    """Why ``solver``'s update cannot be recorded (None: it can)."""
    kind = type(solver)
    if not all(_ours(kind, name) for name in ("update_params", "compute_updates")):
        return f"{kind.__name__}: an update rule of its own (not one of brewnet's)"
    if not solver._foreach_ok():
        return "the per-param update (Solver.foreach is False)"
    if any(on_gradients for _, on_gradients in solver._callbacks):
        return "an on_gradients callback (it may change the gradients before the update)"
    if solver.replicas is not None:
        return "data parallel (the gradients are averaged between the workers first)"
    return None


class UpdateGraph:
    """``solver``'s update as a recorded graph (see the module docstring). ``run(grads)``
    replays it on the solver's current params and history; ``host_scalars()`` is what a
    caller that replays it itself (the CUDA step graph) feeds as ``scalars``."""

    def __init__(self, solver):
        self.solver = solver
        self.gm, self.key = None, None
        self.tries = 0
        self.clipping = False       # the graph returns the gradients' norm (for the log line)
        self.rate = None            # the lr policy's rate of the last host_scalars() call
        self.lr_mults: list = []    # the float32 lr_mult of each scalar slot

    # -- what is fixed, what changes ---------------------------------------------------------
    def current_key(self) -> tuple:
        s = self.solver
        p, net = s.param, s.net
        return (type(s), p.momentum, p.momentum2, p.delta, p.rms_decay, p.weight_decay,
                p.regularization_type, f32(p.clip_gradients), p.iter_size,
                tuple(net.lr_mults), tuple(net.decay_mults),
                tuple((tuple(t.shape), t.dtype, t.device) for t in net.learnable),
                tuple((tuple(h.shape), h.dtype) for h in s.history))

    def usable(self) -> bool:
        """Whether the recorded graph fits the solver as it is now."""
        s = self.solver
        return (self.gm is not None and self.skip <= s._zero_history
                and not any(on_gradients for _, on_gradients in s._callbacks)
                and s.replicas is None and self.current_key() == self.key)

    def host_scalars(self) -> torch.Tensor:
        """This iteration's scalars (float32, on the host): the local rate of each lr_mult
        group, then the rule's ``iteration_scalars``. Calls the lr policy (which moves
        ``current_step``, as the eager update's call does): once per iteration."""
        s = self.solver
        rate, s.current_step = policy(s.param.lr_policy)(s.param, s.iter, s.current_step)
        self.rate = rate
        values = [f32(rate) * m for m in self.lr_mults] + list(_iteration_scalars(s).values())
        return torch.from_numpy(np.array(values, dtype=np.float32))

    # -- recording -------------------------------------------------------------------------
    def _plan(self) -> None:
        s = self.solver
        mults = s._mults()
        self.skip = {i for i, (m, _) in enumerate(mults)
                     if m == 0 and s.frozen_is_noop and s._history_is_zero(i)}
        self.lr_mults = list(dict.fromkeys(m for i, (m, _) in enumerate(mults) if i not in self.skip))
        self.names = list(_iteration_scalars(s))
        self.clipping = f32(s.param.clip_gradients) >= 0 and bool(mults)

    def _update(self, *args, defer: bool = False):
        """The update on tensors: ``args`` = (*grads, *params, *history, scalars), the params
        and history being the solver's own (the rules read ``solver.history`` by identity).
        ``defer``: a rule may leave the step in the diff to later (kept in ``self.deferred``)."""
        s = self.solver
        n, p = len(s.net.learnable), s.param
        grads, params, scalars = list(args[:n]), args[n:2 * n], args[-1]
        out = []
        if self.clipping:
            clip = f32(p.clip_gradients)
            sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
            norm = sq.double().sqrt().float()   # the eager update: math.sqrt, then float32
            scale = torch.where(norm > clip, torch.full_like(norm, clip) / norm, 1.0)
            torch._foreach_mul_(grads, scale)
            out.append(norm)
        rates = {m: scalars[j] for j, m in enumerate(self.lr_mults)}
        s.scalar_inputs = {name: scalars[len(self.lr_mults) + j] for j, name in enumerate(self.names)}
        norm_f = float(f32(1) / f32(p.iter_size)) if p.iter_size > 1 else None
        todo = []
        for i, (t, g, (lr_mult, decay)) in enumerate(zip(params, grads, s._mults())):
            if i in self.skip:
                g.zero_()
                continue
            if norm_f is not None:
                g.mul_(norm_f)
            todo.append((i, t, g, decay, rates[lr_mult]))
        pending, s._pending_steps = s._pending_steps, []
        try:
            s.update_params(todo, p.regularization_type == "L2", store_step=not defer)
            self.deferred = s._pending_steps
        finally:
            s.scalar_inputs, s._pending_steps = None, pending
        return tuple(out)

    def _inputs(self, grads, scalars) -> list:
        s = self.solver
        return [*grads, *[t.detach() for t in s.net.learnable], *s.history,
                scalars.to(s.net.device)]

    def record(self, grads) -> bool:
        """Record the update on this iteration's ``grads`` (the params' diffs, before the
        update) and check the recorded graph's replay against the eager update on the same
        state: either way the update of this iteration is done when it returns (True: by the
        graph, which is kept)."""
        from .recording import RecordError, same_bits, unbox
        from .recording import record as record_graph

        s = self.solver
        self.tries += 1
        self._plan()
        state = [t.detach() for t in s.net.learnable] + list(s.history) + list(grads)
        before = [t.clone() for t in state]
        step = s.current_step

        def restore():
            with torch.no_grad():
                for t, b in zip(state, before):
                    t.copy_(b)
        with torch.no_grad():
            s.apply_update(store_step=True)          # the eager update: the reference
            eager = [t.clone() for t in state]
        restore()
        s.current_step = step
        self.gm, self.key = None, None
        scalars = self.host_scalars()
        try:
            with torch.no_grad():
                gm = record_graph(self._update, self._inputs(grads, scalars), made=True)
            restore()
            unbox(gm)
            self.gm = gm
            self.run(grads, scalars)                 # the replay, as later iterations run it
        except (RecordError, RuntimeError) as e:
            log.debug("update graph: recording failed: %s: %s", type(e).__name__, e)
            self.gm = None
        if self.gm is None or not all(same_bits(a, b) for a, b in zip(state, eager)):
            if self.gm is not None:
                log.warning("update graph: the recorded update differs from the eager one; "
                            "solver of net '%s' keeps the eager update", s.net.name)
            with torch.no_grad():
                for t, e in zip(state, eager):
                    t.copy_(e)
            self.gm, self.tries = None, 3
            return False
        self.key = self.current_key()
        log.info("Net '%s': the %s update recorded as one graph (%d ops)", s.net.name,
                 type(s).solver_type or type(s).__name__,
                 sum(n.op == "call_function" for n in self.gm.graph.nodes))
        return True

    def run(self, grads, scalars: torch.Tensor | None = None) -> tuple:
        """Replay the update on ``grads`` (in place: they hold the steps after)."""
        if scalars is None:
            scalars = self.host_scalars()
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self.gm.forward(*self._inputs(grads, scalars))
        finally:
            torch._C._set_grad_enabled(grad_mode)

    def log_clipping(self, out: tuple) -> None:
        """Caffe's clipping line, from the norm the graph returned (a host read: only when
        clip_gradients is set)."""
        if self.clipping and out:
            clip = f32(self.solver.param.clip_gradients)
            norm = f32(out[0].item())
            if norm > clip:
                log.info("Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale "
                         "factor %g", norm, clip, clip / norm)


def grads_of(solver) -> list:
    """The learnable params' diffs, a zero tensor where none was made (the eager update's)."""
    out = []
    for t in solver.net.learnable:
        if t.grad is None:
            t.grad = torch.zeros_like(t.detach())
        out.append(t.grad)
    return out


def applied(solver, display: bool) -> bool:
    """The loop's update of this iteration through the recorded graph, when the step graph is
    in use and wants it (``StepGraph.wants_update``): done already by the step graph's replay
    (a CUDA graph of forward, backward and update), or replayed here, or recorded (and
    checked) now. False: the caller runs the eager ``apply_update``."""
    graph = getattr(solver, "_graph", None)
    if graph is None or graph.gm is None or graph.net is not solver.net:
        return False
    upd = graph.update
    if upd is None:
        if not graph.wants_update():
            return False
        why = refusal(solver)
        if why:
            graph.update = False                 # asked once per step graph
            log.debug("update graph: %s", why)
            return False
        upd = graph.update = UpdateGraph(solver)
    if upd is False:
        return False
    if graph.updated_at == solver.iter:          # done in the step graph's replay
        graph.updated_at = None
        out = graph.update_out
    elif upd.usable():
        out = upd.run(grads_of(solver), upd.host_scalars())
    elif upd.tries < 3:
        if display:                              # the rate the update will use, logged first
            p = solver.param
            solver._log_rate(policy(p.lr_policy)(p, solver.iter, solver.current_step)[0])
        upd.record(grads_of(solver))
        return True
    else:
        return False
    if display:
        solver._log_rate(upd.rate)
    upd.log_clipping(out)
    return True
