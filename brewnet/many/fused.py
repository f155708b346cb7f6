"""Fused training: K solvers over nets of one architecture as one net of wide operators, their
update rules applied in one pass over stacked parameters and histories (HFTA, MLSys 2021).

``FusedSolvers(solver_params, device=None)`` builds each net alone with its own solver (its own
``random_seed``), refuses nets of two architectures (``FuseError`` names the first layer and field
that differ) and stacks their parameters (``fused_layers.stack_params``): ``fs.solvers[k].net``,
its test nets and ``snapshot()`` see the fused values, no copy. Net 0's data layer is read once a
batch for all K; each net keeps its own solver, tests (its exact Test lines), snapshots and
``max_iter``, its log lines prefixed ``[sK] ``. ``exact`` (``brewnet train --fuse [wide|exact]``):
wide, the default, sums float32 in another order than a net alone; exact runs each net's own
kernels, bit for bit its run alone. Dropout and random transforms draw from one stream for all K.
Why, the step graph and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from ..solvers import SOLVERS
from ..solvers.guards import LossNotFiniteError
from ..solvers.logprefix import log_prefix
from ..solvers.lr_policy import policy
from ..solvers.nets import load_solver_param
from .fused_layers import FusedNet, FuseError
from .fused_rules import UPDATES, col, corrections, times

log = logging.getLogger("brewnet")
f32 = np.float32
__all__ = ["FusedSolvers", "FuseError"]


def net_prefix(k: int, prefixes=None):
    """While active, brewnet's log lines start with ``[sK] `` or ``prefixes[k]`` (the solvers'
    own mechanism)."""
    return log_prefix(prefixes[k] if prefixes else f"[s{k}] ")


def as_dtype(solver, dtype) -> None:
    """Cast a solver's nets and histories (float64 runs check the fused algorithm without
    float32 rounding in the way)."""
    solver.net.to(dtype=dtype)
    for net in solver.test_nets:
        net.to(dtype=dtype)
        solver.share_weights(net)
    solver.history = [h.to(dtype) for h in solver.history]


class FusedSolvers:
    """K solvers trained as one fused net; ``solvers[k]`` is net k's own Solver (``.iter``,
    ``.net``, ``.test_nets``, ``.snapshot()`` as alone). ``dtype``: cast the nets (float64 for
    checks; Caffe's numbers are float32, the default); ``exact``: each net's own kernels, bit for
    bit each net alone (see the module docstring). ``prefixes``: the nets' log prefixes (default
    ``[s0] ``, ``[s1] ``...). ``drop(k)`` takes net k out between iterations (a search prunes
    it); ``solving()`` is ``solve`` yielding after each iteration."""

    def __init__(self, solver_params, device=None, dtype=None, exact: bool = False, prefixes=None):
        sources = list(solver_params)            # messages or solver files
        params = [load_solver_param(p)[0] for p in sources]
        if not params:
            raise FuseError("FusedSolvers needs at least one solver")
        for k, p in enumerate(params):
            if p.type not in UPDATES:
                raise FuseError(f"solver {k}: type '{p.type}' has no fused update (fused: "
                                f"{', '.join(sorted(UPDATES))}); train it together instead")
            if p.iter_size != params[0].iter_size:
                raise FuseError(f"solvers 0 and {k} differ in iter_size ({params[0].iter_size} vs "
                                f"{p.iter_size}): one data stream cannot feed both")
            if p.snapshot_diff:
                raise FuseError(f"solver {k}: snapshot_diff is not kept by fused training")
        self.prefixes = list(prefixes) if prefixes else None
        self.dropped: set[int] = set()           # nets taken out (drop)
        self.finished: set[int] = set()          # nets solved to max_iter (solving)
        self._tested: dict[int, int] = {}        # net -> the iteration of its last test
        self.solvers = []
        for k, (src, p) in enumerate(zip(sources, params)):
            with self._prefix(k):                  # each net built alone: its own random_seed
                self.solvers.append(SOLVERS[p.type](src, device=device))
            if dtype is not None:
                as_dtype(self.solvers[-1], dtype)
        if len({s.device for s in self.solvers}) > 1:
            raise FuseError("fused solvers must all run on one device, got "
                            f"{sorted(str(s.device) for s in self.solvers)}")
        k_ = len(params)
        self.order = sorted(range(k_), key=lambda k: (params[k].type, -params[k].max_iter))
        self.exact = exact
        self._fuse(source=None)
        log.info("Fused %d nets into one: %s", k_, ", ".join(
            f"{t} x{b - a}" for t, a, b in self.groups))

    def _prefix(self, k: int):
        return net_prefix(k, self.prefixes)

    def _label(self, k: int) -> str:
        return self.prefixes[k] if self.prefixes else f"[s{k}] "

    def _fuse(self, source) -> None:
        """Stack the nets of ``self.order`` (parameters, histories, update groups); ``source``:
        the net whose data layers feed them (default the first)."""
        params = [s.param for s in self.solvers]
        labels = [f"net {k} ({params[k].net or params[k].train_net or 'net_param'})" for k in self.order]
        grads = [p.requires_grad for p in self.fused.params] if source is not None else None
        self.fused = FusedNet([self.solvers[k].net for k in self.order], labels, exact=self.exact,
                              source=source)
        for p, g in zip(self.fused.params, grads or []):   # the nets' rows are views by now:
            p.requires_grad_(g)                             # the flags come from the old stack
        self._stack_histories()
        self.groups = []                         # (type, first stack position, end)
        for pos, k in enumerate(self.order):
            if self.groups and self.groups[-1][0] == params[k].type:
                self.groups[-1][2] = pos + 1
            else:
                self.groups.append([params[k].type, pos, pos + 1])
        self._lr_masks = [self._lr_mask(i) for i in range(len(self.fused.params))]

    def drop(self, k: int) -> None:
        """Take net ``k`` out of the fused net between iterations (a pruned trial): the others
        are restacked from their current values and histories (copies, bit for bit) and go on
        as before; the data stays where it is (its reader stays the source). Net k keeps the
        values it had; it is trained no further."""
        if k in self.dropped or not 0 <= k < len(self.solvers):
            raise FuseError(f"cannot drop net {k}: not one of the running fused nets")
        self.dropped.add(k)
        self.order = [j for j in self.order if j != k]
        with self._prefix(k):
            log.info("Left the fused net at iteration %d", self.solvers[k].iter)
        if self.order:
            self._fuse(source=self.fused.source)

    def _stack_histories(self) -> None:
        n = len(self.fused.params)
        self.history = []                        # per set: per learnable, (K, *shape)
        sets = max(s.history_sets for s in self.solvers)
        for j in range(sets):
            row = []
            for i in range(n):
                h = torch.stack([self._hist(k, j, i) for k in self.order])
                row.append(h)
            self.history.append(row)
        for pos, k in enumerate(self.order):
            s = self.solvers[k]
            s.history = [self.history[j][i][pos] for j in range(s.history_sets) for i in range(n)]

    def _hist(self, k, j, i):
        s = self.solvers[k]
        n = len(self.fused.params)
        return s.history[j * n + i] if j < s.history_sets else torch.zeros_like(self.fused.params[i].detach()[0])

    def _lr_mask(self, i):
        """Rows of param i whose net has lr_mult 0 get no gradient (alone: requires_grad off)."""
        p = self.fused.params[i]
        mults = [self.solvers[k].net.lr_mults[i] for k in self.order]
        if all(mults) or not p.requires_grad:
            return None
        return col([1.0 if m else 0.0 for m in mults], p)

    # -- the loop --------------------------------------------------------------------------
    def step(self, iters: int) -> None:
        """Every net runs ``iters`` iterations (Caffe's ``Solver::Step``, K at once)."""
        self._run([s.iter + int(iters) for s in self.solvers], final=False)

    def solve(self) -> None:
        """Each net trains to its own ``max_iter`` (Caffe's ``Solver::Solve``)."""
        for _ in self.solving():
            pass

    def solving(self):
        """``solve`` as a generator that yields after each iteration (``drop`` may run between);
        ``finished`` holds the nets that are done (their last test run)."""
        for k, s in enumerate(self.solvers):
            with self._prefix(k):
                log.info("Solving %s", s.net.name)
                log.info("Learning Rate Policy: %s", s.param.lr_policy)
        yield from self._running([s.param.max_iter for s in self.solvers], final=True)

    def _run(self, stops, final: bool) -> None:
        for _ in self._running(stops, final):
            pass

    def _running(self, stops, final: bool):
        start = [s.iter for k, s in enumerate(self.solvers) if k not in self.dropped]
        if len(set(start)) > 1:
            raise FuseError(f"fused nets must be at one iteration, got {start}")
        start = [s.iter for s in self.solvers]
        for s in self.solvers:
            s._losses, s.smoothed_loss = [], f32(0)
        tic = {k: (time.perf_counter(), s.iter) for k, s in enumerate(self.solvers)}
        pending: list[int] = []                  # finished nets waiting for a last loss
        while True:
            active = [k for k, s in enumerate(self.solvers) if s.iter < stops[k] and k not in self.dropped]
            if not active:
                break
            for p in self.fused.params:
                p.grad = None
            for k in active:
                s = self.solvers[k]
                p = s.param
                if p.test_interval and s.iter % p.test_interval == 0 and (s.iter > 0 or p.test_initialization) \
                        and self._tested.get(k) != s.iter:      # (once, if an iteration is rerun)
                    with self._prefix(k):
                        s.test_all()
                    self._tested[k] = s.iter
            graph = self._step_graph()
            got = graph.forward_backward(active, min(stops[k] - self.solvers[k].iter for k in active)) \
                if graph is not None else None
            losses, outputs, first = got if got is not None else self._forward_backward()
            self._finish(pending, first, start)
            pending = []
            for k in active:
                s = self.solvers[k]
                s.loss = losses[self.order.index(k)]
                s._update_smoothed_loss(s.loss, start[k])
                if s.param.display and s.iter % s.param.display == 0:
                    t0, last = tic[k]
                    with self._prefix(k):
                        s._log_speed(s.iter - last, time.perf_counter() - t0)
                        s._log_outputs(s.net, "Train", {n: v[self.order.index(k)] for n, v in outputs.items()})
                    tic[k] = (time.perf_counter(), s.iter)
            if graph is None or not graph.finish(active):
                self._update(set(active))
            for k in active:
                s = self.solvers[k]
                s.iter += 1
                if s.param.snapshot and s.iter % s.param.snapshot == 0:
                    with self._prefix(k):
                        s.snapshot()
                if final and s.iter >= stops[k]:
                    pending.append(k)
                    with self._prefix(k):
                        if s.param.snapshot_after_train and (not s.param.snapshot or s.iter % s.param.snapshot != 0):
                            s.snapshot()
            yield
        if pending:
            with torch.no_grad():
                _, losses, _ = self.fused.forward()
            self._finish(pending, [f32(x) for x in losses.cpu().numpy()], start)
            yield

    def _step_graph(self):
        """The fused step as a recorded graph (``recorded_fused_step.py``) where it can be; None: eager."""
        from ..execution import recorded_fused_step

        g = getattr(self, "_graph", None)
        if g is not None and g.fused is self.fused:
            return g
        refused = getattr(self, "_graph_refused", None)
        if refused is not None and refused[0] is self.fused:
            return None
        why = recorded_fused_step.refusal(self)
        if why:
            log.debug("fused step graph: %s", why)
            self._graph_refused = (self.fused, why)
            return None
        g = self._graph = recorded_fused_step.FusedStepGraph(self)
        return g

    def _finish(self, pending, first_losses, start) -> None:
        """Solve's tail for nets that reached max_iter: the last display loss (the next batch,
        as alone), the last test, done."""
        for k in pending:
            s = self.solvers[k]
            with self._prefix(k):
                if s.param.display and s.iter % s.param.display == 0:
                    s._update_smoothed_loss(first_losses[self.order.index(k)], start[k])
                    s._log_loss()
                if s.param.test_interval and s.iter % s.param.test_interval == 0:
                    s.test_all()
                log.info("Optimization Done.")
            self.finished.add(k)

    def _forward_backward(self):
        """iter_size fused passes: each net's mean loss (float32, as alone), the last pass's
        outputs, and the first pass's losses (what a finished net's last display reads)."""
        iter_size = self.solvers[0].param.iter_size
        total = first = outputs = None
        for j in range(iter_size):
            loss, per, outputs = self.fused.forward()
            loss.backward()
            total = per if total is None else total + per
            if j == 0:
                first = [f32(x) for x in per.cpu().numpy()]
        values = [f32(x) / f32(iter_size) for x in total.cpu().numpy()]
        self._check_finite(values)
        return values, outputs, first

    def _check_finite(self, values) -> None:
        for pos, v in enumerate(values):
            if not math.isfinite(v):
                k = self.order[pos]
                err = LossNotFiniteError(f"{self._label(k)}Iteration {self.solvers[k].iter}: loss is {v}")
                err.solver_index = k             # which net (a search fails its trial alone)
                raise err

    def _update(self, active: set, grads=None, scalars=None):
        """One update of every running net (Caffe's ApplyUpdate: rate, clipping, iter_size
        normalisation, regularisation, the rule), group by group over stacked slices.
        ``grads``: the stacked params' gradients (default their ``.grad``); ``scalars``: a
        recorded step's (2, K) float32 tensor of each stack position's rate and Adam correction
        (default: computed here, with the lr log lines). Returns the clipping norms per group
        that clips, when ``scalars`` is given (their log lines are the caller's)."""
        ps = self.fused.params
        norms = []
        with torch.no_grad():
            if grads is None:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p.detach()) for p in ps]
            for i, g in enumerate(grads):
                if self._lr_masks[i] is not None:
                    g.mul_(self._lr_masks[i])
            for kind, a, b in self.groups:
                run = [k for k in self.order[a:b] if k in active]
                if not run:
                    continue
                b = a + len(run)                     # running nets are a prefix of the group
                solvers = [self.solvers[k] for k in run]
                if scalars is None:
                    rates, corr = self._rates(run), corrections(solvers)
                else:
                    rates, corr = scalars[0, a:b], scalars[1, a:b]
                norm = self._clip(run, [g[a:b] for g in grads], log_now=scalars is None)
                if norm is not None:
                    norms.append(norm)
                for i, p in enumerate(ps):
                    self._apply(UPDATES[kind], solvers, p.detach()[a:b], grads[i][a:b],
                                [h[i][a:b] for h in self.history[:solvers[0].history_sets]], i,
                                rates, corr)
        return norms

    def _rates(self, run, log_now: bool = True) -> list:
        out = []
        for k in run:
            s = self.solvers[k]
            rate, s.current_step = policy(s.param.lr_policy)(s.param, s.iter, s.current_step)
            if log_now:
                self._log_rate(k, rate)
            out.append(rate)
        return out

    def _log_rate(self, k: int, rate) -> None:
        s = self.solvers[k]
        if s.param.display and s.iter % s.param.display == 0:
            with self._prefix(k):
                s._log_rate(rate)

    def _clip(self, run, grads, log_now: bool = True):
        """Each net's gradients scaled to its clip_gradients norm. On tensors (``log_now``
        False: a recorded step) the scale is computed on the device and the norms (m,) are
        returned for ``log_clipping``; else they are read here and logged."""
        clips = [f32(self.solvers[k].param.clip_gradients) for k in run]
        if all(c < 0 for c in clips) or not grads:
            return None
        # Each net's norm summed as alone (per blob, then over blobs): the same float32 scale.
        sq = torch.stack([torch.stack([g[j].float().pow(2).sum() for g in grads]).sum()
                          for j in range(len(run))])
        if not log_now:
            norm = sq.double().sqrt().float()      # math.sqrt of the float32 sum, to float32
            c = torch.from_numpy(np.asarray(clips, dtype=np.float32)).to(norm.device)
            scale = torch.where((c >= 0) & (norm > c), c / norm, 1.0)
            for g in grads:
                g.mul_(col(scale, g))
            return norm
        scales = []
        for k, c, s2 in zip(run, clips, sq.cpu().numpy()):
            norm = f32(math.sqrt(float(s2)))
            scales.append(self.log_clipping(k, c, norm))
        if any(x != 1 for x in scales):
            for g in grads:
                g.mul_(col(scales, g))
        return None

    def log_clipping(self, k: int, clip, norm):
        """Caffe's clipping line for net ``k`` when its norm is over its clip; the scale."""
        if clip >= 0 and norm > clip:
            scale = clip / norm
            with self._prefix(k):
                log.info("Gradient clipping: scaling down gradients (L2 norm %g > %g) by "
                         "scale factor %g", norm, clip, scale)
            return scale
        return f32(1)

    def _apply(self, rule, solvers, p, g, hist, i, rates, corr) -> None:
        iter_size = solvers[0].param.iter_size
        if iter_size > 1:
            g.mul_(float(f32(1) / f32(iter_size)))
        decay = [f32(s.param.weight_decay) * f32(s.net.decay_mults[i]) for s in solvers]
        local = times(rates, [s.net.lr_mults[i] for s in solvers])
        if self.exact and rule is not UPDATES["SGD"]:
            # each net's own rule on its row, as alone (Adam's and Nesterov's stacked forms
            # round their per-net products in another order; SGD's rounds as alone)
            n = len(self.fused.params)
            for j, s in enumerate(solvers):
                if decay[j]:
                    l1 = s.param.regularization_type == "L1"
                    g[j].add_(torch.sign(p[j]) if l1 else p[j], alpha=float(decay[j]))
                own = s.history      # its rows of this slice (views made here: a recording
                s.history = list(own)     # sees them made from the stacked history)
                for set_j, h in enumerate(hist):
                    s.history[set_j * n + i] = h[j]
                try:
                    if isinstance(local, torch.Tensor):      # a recorded step: 0-d tensors
                        s.scalar_inputs = {"correction": corr[j]}
                        s.compute_update(i, p[j], g[j], local[j])
                    else:
                        s.compute_update(i, p[j], g[j], float(local[j]))
                finally:
                    s.history, s.scalar_inputs = own, None
                p[j].sub_(g[j])
            return
        if any(decay):
            l1 = [s.param.regularization_type == "L1" for s in solvers]
            reg = p if not any(l1) else torch.sign(p) if all(l1) else torch.where(
                col(l1, p).bool(), torch.sign(p), p)
            g.addcmul_(reg, col(decay, p))
        rule(solvers, p, g, hist, i, local, corr)
