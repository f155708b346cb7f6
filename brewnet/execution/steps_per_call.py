"""Several training iterations per Python call: K recorded steps and updates in one TorchScript loop.

A launch-bound net (one the recorded step replays, recorded_step.py) pays Python for every op of
every iteration. Between two observable points (a display, a test, a snapshot, the call's end)
``solver.step``/``solve`` run the K iterations as one call: the data layers' next K batches read
ahead as tensors, the K rates (and a rule's iteration scalars) computed ahead on the host, and the
recorded forward-backward and recorded update (recorded_update.py) traced into one TorchScript
body that a scripted loop runs K times unoptimised (its graph passes: loop_passes.py; in inference
mode): the same aten kernels, no fusion. The K losses come back and the smoothed loss is updated
on the host as the loop does. Invariant: the bits of K single steps, compared at the first call
(a difference keeps single steps, logged; a loop with its batches' ops batched is rebuilt without
them first). Refused: a callback, a train_feed, clipping (a log line each iteration), a rule of the
user's, data parallel, a numpy view of a diff, a device other than the CPU. A bad label or
non-finite loss in the K restores the state and runs the K as single steps on the batches read,
which raise where they would. ``BREWNET_STEPS_PER_CALL=0`` off. Measurements: docs/performance.md, *Tiny nets*.
"""
from __future__ import annotations

import logging
import warnings
from typing import List

import numpy as np
import torch

from ..blob import diff_viewed
from ..solvers.lr_policy import policy
from . import determinism, loop_passes, recorded_update, traceable
from .fast_path import FAILED, FastPath
from .process import env_switch
from .recorded_step import as_param_grad
from .recording import same_bits

log = logging.getLogger("brewnet")
f32 = np.float32
MIN_K = 16             # fewer iterations to the next observable point: single steps
MAX_K = 2000           # at most per call (a signal's stop or snapshot waits for the call's end)
MAX_STAGED = 16 << 20  # bytes of batches read ahead at most
CHECK_K = 3            # iterations compared with single steps at the first call


def mode() -> str:
    return env_switch("BREWNET_STEPS_PER_CALL", "auto", ("auto", "0"))


def refusal(solver) -> str | None:
    """Why ``solver``'s iterations cannot run several per call now (None: they can)."""
    if mode() == "0":
        return "BREWNET_STEPS_PER_CALL=0"
    if solver.net.device.type != "cpu":
        return f"device {solver.net.device} (a CUDA step graph holds the update there)"
    if solver._callbacks:
        return "callbacks (they run between the iterations)"
    if solver.train_feed is not None:
        return "a train_feed (it is called before each iteration)"
    if f32(solver.param.clip_gradients) >= 0:
        return "clip_gradients (it may log a line at any iteration)"
    if any(diff_viewed(t) for t in solver.net.learnable):
        return "a numpy view of a param diff"
    return recorded_update.refusal(solver)


def span(solver, stop_iter: int, per_iter_bytes: int) -> int:
    """Iterations from ``solver.iter`` up to the next observable point: a display iteration
    (run alone), a test (at the start of its iteration), a snapshot (after its iteration)."""
    p, i = solver.param, solver.iter
    end = min(stop_iter, i + MAX_K, i + MAX_STAGED // max(1, per_iter_bytes))
    for every in (p.display, p.test_interval, p.snapshot):
        if every > 0:
            end = min(end, (i // every + 1) * every)
    return end - i


def run(solver, start_iter: int, stop_iter: int) -> int:
    """Run the iterations from ``solver.iter`` to the next observable point as one call, when
    they can be, and update the smoothed loss for each: how many (0: single steps take them).
    ``solver.iter`` is the caller's to move."""
    graph = getattr(solver, "_graph", None)
    if (graph is None or graph.gm is None or graph.net is not solver.net or graph.staged
            or solver._requests):
        return 0
    runner = getattr(solver, "_steps_runner", None)
    if runner is None or runner.graph is not graph:
        runner = solver._steps_runner = Runner(solver, graph)
    if runner.guard.off is not None:
        return 0
    why = refusal(solver)
    if why:
        if why != runner.refused:
            runner.refused = why
            log.debug("several steps per call: %s", why)
        return 0
    per_iter = sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d in graph.key[0])
    k = span(solver, stop_iter, per_iter)
    if k < MIN_K:
        return 0
    with solver.threads:
        determinism.blas_on_one_thread()
        solver.threads.discard()          # not one iteration: left out of the thread timing
        done, losses = runner(k)
    smooth(solver, losses, start_iter)
    if done:
        solver.loss = f32(losses[-1])
    return done


def smooth(solver, losses: np.ndarray, start_iter: int) -> None:
    """``solver._update_smoothed_loss`` for each of the float32 ``losses`` in turn (iterations
    ``solver.iter`` on), vectorised once the window is full: each iteration's increment
    (loss - the loss it replaces) / n is elementwise, and their running float32 sum in order
    (``np.add.accumulate`` adds one after another) is the same arithmetic as the loop's."""
    n, buf, i0, j = solver.param.average_loss, solver._losses, solver.iter, 0
    try:
        while j < len(losses) and len(buf) < n:
            solver.iter = i0 + j
            solver._update_smoothed_loss(losses[j], start_iter)
            j += 1
    finally:
        solver.iter = i0
    new = np.asarray(losses[j:], dtype=f32)
    k = len(new)
    if k == 0:
        return
    idx = (i0 + j - start_iter) % n
    ring = np.asarray(buf[idx:] + buf[:idx], dtype=f32)       # the losses in replacing order
    replaced = np.concatenate([ring, new])[:k]
    steps = np.empty(k + 1, dtype=f32)
    steps[0] = solver.smoothed_loss
    np.divide(new - replaced, f32(n), out=steps[1:])
    solver.smoothed_loss = np.add.accumulate(steps, dtype=f32)[-1]
    window = np.concatenate([ring, new])[-n:]                  # idx + k onwards, in order
    at = (idx + k) % n
    buf[:] = [f32(v) for v in np.roll(window, at)]


def stage(graph, k: int) -> tuple[list[torch.Tensor], list, BaseException | None]:
    """The bottomless layers' next ``k`` batches, each top as a (k, ...) tensor (an Input
    layer's blob, which nothing writes between the iterations, repeated as a view); per data
    layer (layer, [origin(j) of each batch j]) for the single steps' label messages; and the
    error a read raised (then only the iterations read before it, [] for none). Read in the
    order single steps read (iteration by iteration across layers; one layer alone may take
    its batches at once, ``take_batches``)."""
    net = graph.net
    data = [i for i in graph.sources if net.layer_list[i].type != "Input"]
    parts = {i: [[] for _ in net.top_lists[i]] for i in data}
    origins = {i: _Origins() for i in data}
    take = getattr(net.layer_list[data[0]], "take_batches", None) if len(data) == 1 else None
    n, error = 0, None
    while n < k:
        try:
            got = take(k - n) if take is not None else None
            if got is not None:
                tops, origin = got
                for p, t in zip(parts[data[0]], tops):
                    p.append(t)
                origins[data[0]].add(origin, tops[0].shape[0])
                n += tops[0].shape[0]
                continue
            for i in data:
                layer = net.layer_list[i]
                tops = [t.unsqueeze(0) for t in layer.forward([])]
                for p, t in zip(parts[i], tops):
                    p.append(t)
                noted = getattr(layer, "batch_origin", None)
                origins[i].add(lambda j, o=noted and noted[0]: o, 1)
            n += 1
        except Exception as e:     # noqa: BLE001 - raised again at its iteration (StepGraph._inputs)
            error = e
            break
    if n == 0:
        return [], [], error
    out = []
    for i in graph.sources:
        names = net.top_lists[i]
        if i in parts:
            out += [torch.cat(p)[:n] if len(p) > 1 else p[0][:n] for p in parts[i]]
        else:
            out += [net.blobs[m].tensor.detach().unsqueeze(0).expand(n, *net.blobs[m].shape)
                    for m in names]
    return out, [(net.layer_list[i], origins[i]) for i in data], error


class _Origins:
    """A data layer's staged batches' origins as runs (a function of the batch's index in its
    run, the run's length): nothing is made per batch unless single steps take the batches."""

    def __init__(self):
        self.runs: list = []

    def add(self, origin, count: int) -> None:
        self.runs.append((origin, count))

    def __getitem__(self, j: int):
        """Batch ``j``'s origin, as a callable of one (unread) argument, as _inputs calls it."""
        for origin, count in self.runs:
            if j < count:
                return lambda b, f=origin, j=j: f(j)
            j -= count
        raise IndexError(j)


def labels_ok(graph, xs) -> bool:
    """The label checks of every staged batch at once (check_labels' test, without raising)."""
    for _, j, k, ignore in graph.checks:
        lab = xs[j].reshape(-1).trunc()
        ok = (lab >= 0) & (lab < k)
        if ignore is not None:
            ok |= lab.long() == ignore
        if not bool(ok.all()):
            return False
    return True


class _Body(torch.nn.Module):
    """One iteration: the recorded step's graph, then the recorded update on its gradients;
    every tensor the graphs read is an input (the traced graph holds none by value)."""

    def __init__(self, graph, gm, update, learnable):
        super().__init__()
        self.graph, self.gm, self.update, self.learnable = graph, gm, update, learnable

    def forward(self, xs, scalars, consts, params, hist):
        g, u = self.graph, self.update
        for name, t in zip(attrs(self.gm), consts):
            _set(self.gm, name, t)
        out = self.gm.forward(*xs)
        n = 1 + len(g._core_tops)
        made, i = {}, n
        for p, h in zip(g.params, g.has_grad):
            if h:
                made[id(p)] = out[i]
                i += 1
        cut = out[i:]
        grads = [as_param_grad(made[id(t)], q) if id(t) in made else torch.zeros_like(q)
                 for t, q in zip(self.learnable, params)]
        u._update(*grads, *params, *hist, scalars, defer=True)
        # the steps a rule left to store later (SGD: the history): (diff index, history index)
        self.deferred = [(next(i for i, g in enumerate(grads) if g is d),
                          next(j for j, h in enumerate(hist) if h is t)) for d, t in u.deferred]
        return [*out[:n], *cut, *grads]


class _Loop(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, xs: List[torch.Tensor], scalars: torch.Tensor, start: int, stop: int,
                consts: List[torch.Tensor], params: List[torch.Tensor],
                hist: List[torch.Tensor]) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        losses: List[torch.Tensor] = []
        for k in range(start, stop):
            out = self.body([x[k] for x in xs], scalars[k], consts, params, hist)
            losses.append(out[0])
        out.append(torch.stack(losses))
        return out


def attrs(gm) -> list[str]:
    return list(dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "get_attr"))


def _set(gm, name: str, t: torch.Tensor) -> None:
    """Point ``gm``'s attribute ``name`` at ``t`` (a param's slot takes a plain tensor too)."""
    for slots in (gm._parameters, gm._buffers):
        if name in slots:
            slots[name] = t
            return
    object.__setattr__(gm, name, t)


class Runner:
    """One step graph's K-iteration loop: built at the first call, checked, then reused."""

    def __init__(self, solver, graph):
        self.solver, self.graph = solver, graph
        self.guard = FastPath("several iterations per call", solver.net.name)
        self.refused: str | None = None
        self.update = None          # recorded_update.UpdateGraph
        self.loop, self.key, self.checked = None, None, False
        self.batch = True           # the batches' ops batched (loop_passes); off if that differs

    def _state(self) -> list[torch.Tensor]:
        return [t.detach() for t in self.solver.net.learnable] + list(self.solver.history)

    def _build(self, xs) -> bool:
        s, g = self.solver, self.graph
        upd = self.update
        if upd is None or not upd.usable():
            upd = self.update = recorded_update.UpdateGraph(s)
            state = self._state()
            before, step = [t.clone() for t in state], s.current_step
            ok = upd.record(recorded_update.grads_of(s))   # updates the state: undone below
            with torch.no_grad():
                for t, b in zip(state, before):
                    t.copy_(b)
            s.current_step = step
            for t in s.net.learnable:
                t.grad = None
            if not ok:
                self.guard.off = "the update could not be recorded"
                return False
        xs = [x[0].clone() for x in xs]
        gm = traceable.with_scripted_calls(g.gm)         # (its get_attr nodes are g.gm's)
        body = _Body(g, gm, upd, list(s.net.learnable))
        consts = [getattr(gm, n) for n in attrs(gm)]
        scalars = torch.zeros(len(upd.lr_mults) + len(upd.names), dtype=torch.float32)
        hist = [h.clone() for h in s.history]
        example = (xs, scalars, [c.detach().clone() for c in consts],
                   [t.detach().clone() for t in s.net.learnable], hist)
        history, s.history = s.history, hist       # the rules read solver.history: the trace's
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)   # torch.jit's own notice
                for batch in ((True, False) if self.batch else (False,)):
                    # a new trace each time: a script of the same module types shares its graph
                    traced = torch.jit.trace(body, example, check_trace=False, strict=False)
                    loop = torch.jit.script(_Loop(traced))
                    try:
                        loop_passes.hoist(loop.forward.graph, batch)
                        break
                    except RuntimeError as e:
                        if not batch:
                            raise
                        log.debug("several steps per call: the batches' ops stay: %s", e)
                self.batch = batch
        finally:
            s.history = history
            for name, c in zip(attrs(gm), consts):
                _set(gm, name, c)
        self.loop, self.deferred = loop, body.deferred
        self.key, self.checked = (g.gm, g.key, upd.gm, upd.key), False    # a new loop: checked anew
        return True

    def _scalars(self, k: int):
        """The K iterations' scalars (UpdateGraph.host_scalars' values) and the lr step after."""
        s, upd = self.solver, self.update
        p, fn, step, i0 = s.param, policy(s.param.lr_policy), s.current_step, s.iter
        extra = getattr(s, "iteration_scalars", None)
        mults = np.array(upd.lr_mults, dtype=np.float32)
        if extra is None and (p.lr_policy == "fixed" or (p.lr_policy == "step" and p.stepsize > 0)):
            # a rate per step of the policy (the same call for each iteration of a step)
            its = np.arange(i0, i0 + k)
            keys = its // p.stepsize if p.lr_policy == "step" else np.zeros(k, np.int64)
            _, first, which = np.unique(keys, return_index=True, return_inverse=True)
            rates = []
            for j in first:
                rate, step = fn(p, int(its[j]), step)
                rates.append(rate)
            table = np.array(rates, dtype=np.float32)[:, None] * mults[None, :]
            rows = table[which.reshape(-1)]
        else:
            rows = []
            try:
                for j in range(k):
                    s.iter = i0 + j
                    rate, step = fn(p, s.iter, step)
                    row = [f32(rate) * m for m in upd.lr_mults]
                    rows.append(row + list(extra().values()) if extra is not None else row)
            finally:
                s.iter = i0
            rows = np.array(rows, dtype=np.float32).reshape(k, -1)
        upd.rate = rate
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)), step

    def _loop(self, xs, scalars, start: int, stop: int) -> tuple[list, torch.Tensor]:
        """The loop over iterations ``start`` to ``stop`` of the staged ``xs`` and ``scalars``:
        (the last iteration's outputs, the losses)."""
        s, g = self.solver, self.graph
        consts = [getattr(g.gm, n).detach() for n in attrs(g.gm)]
        params = [t.detach() for t in s.net.learnable]
        # inference mode: no autograd bookkeeping per op (the same kernels); the params and
        # history stay normal tensors updated in place, the outputs leave as normal tensors
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            out = self.loop(xs, scalars, start, stop, consts, params, list(s.history))
        out = [t.clone() if t.is_inference() else t for t in out]
        return out[:-1], out[-1]

    def __call__(self, k: int) -> tuple[int, list]:
        s, g = self.solver, self.graph
        xs, self.notes, error = stage(g, k)
        if error is not None or g._key([x[0] for x in xs]) != g.key or not labels_ok(g, xs):
            return self._leave(xs, error)
        upd = self.update
        if (self.loop is None or upd is None or not upd.usable()
                or self.key != (g.gm, g.key, upd.gm, upd.key)):
            if self.guard.attempt(self._build, xs) in (FAILED, False):
                return self._leave(xs)
        state = self._state()
        before, step0 = [t.clone() for t in state], s.current_step
        scalars, step = self._scalars(k)
        start, first = 0, None
        if not self.checked:
            start = self.guard.attempt(self._check, xs, scalars, before, step0)
            if start == -1:         # the batched loop differs: these single steps, then without
                self.batch, self.loop = False, None
            if start is FAILED or start <= 0:
                return self._undo(xs, before, step0)
            self.checked, first = True, self._first
        got = self.guard.attempt(self._loop, xs, scalars, start, k)
        if got is FAILED:
            return self._undo(xs, before, step0)
        out, losses = got
        if first is not None:
            losses = torch.cat([first, losses])
        if not bool(torch.isfinite(losses).all()):
            return self._undo(xs, before, step0)
        s.current_step = step
        self._finish(xs, out)
        return k, losses.numpy()

    def _steps(self, out) -> list[torch.Tensor]:
        """The param diffs of the loop's last iteration, holding its steps (as a store would)."""
        m = len(self.solver.net.learnable)
        grads = list(out[len(out) - m:])
        for i, j in self.deferred:
            grads[i] = grads[i].clone().copy_(self.solver.history[j])
        return grads

    def _check(self, xs, scalars, before, step0) -> int:
        """The first CHECK_K iterations through the loop and as single steps (the replayed
        step, the eager update), from the same state: their count if the bits agree, else 0
        (-1 where the loop batched its batches' ops: the next one is built without)."""
        s, g = self.solver, self.graph
        n = CHECK_K
        state = self._state()
        try:
            out, self._first = self._loop(xs, scalars, 0, n)
        except Exception as e:     # noqa: BLE001 - the batched loop's fault: tried without it
            if not self.batch:
                raise
            log.info("Net '%s': the loop with its batches' ops batched failed (%s): tried "
                     "without them", s.net.name, e)
            return -1
        mine = [t.clone() for t in state] + self._steps(out)
        with torch.no_grad():
            for t, b in zip(state, before):
                t.copy_(b)
        s.current_step, i0 = step0, s.iter
        ref = []
        try:
            for j in range(n):
                s.iter = i0 + j
                ref.append(g._replay([x[j] for x in xs]).clone())
                s.apply_update(store_step=True)
        finally:
            s.iter = i0
        theirs = state + recorded_update.grads_of(s)
        same = (all(same_bits(a, b) for a, b in zip(mine, theirs))
                and same_bits(self._first, torch.stack(ref).float()))
        if not same and self.batch:
            log.info("Net '%s': the loop with its batches' ops batched differs from single "
                     "steps: tried without them", s.net.name)
            return -1
        if not same:
            self.guard.fail("the loop's iterations differ from single steps")
            return 0
        log.info("Net '%s': up to %d iterations a call, in one TorchScript loop", s.net.name, MAX_K)
        return n

    def _undo(self, xs, before, step0) -> tuple[int, list]:
        s = self.solver
        with torch.no_grad():
            for t, b in zip(self._state(), before):
                t.copy_(b)
        s.current_step = step0
        for t in s.net.learnable:
            t.grad = None
        return self._leave(xs)

    def _leave(self, xs, error: BaseException | None = None) -> tuple[int, list]:
        """The staged batches, for single steps to take (StepGraph._inputs), then the error a
        read raised, raised by the single step that would have read it."""
        g = self.graph
        g.staged = [list(t) for t in zip(*[x.unbind(0) for x in xs])]
        g.staged_notes = [[(layer, fs[j]) for layer, fs in self.notes] for j in range(len(g.staged))]
        if error is not None:
            g.staged.append(error)
            g.staged_notes.append([])
        return 0, []

    def _finish(self, xs, out) -> None:
        """The net as the last single step would leave it: tops, lazy side tops, param diffs
        (their steps stored later where a rule defers it), the data layers' tops."""
        s, g = self.solver, self.graph
        net = g.net
        n = 1 + len(g._core_tops)
        g.drop()
        for name, t in zip(g._core_tops, out[1:n]):
            net.blobs[name].write(t)
        m = len(s.net.learnable)
        if g.side is not None:
            g._mark_stale(out[n:len(out) - m])
        grads = list(out[len(out) - m:])
        for t, grad in zip(s.net.learnable, grads):
            t.grad = grad
        s._pending_steps = [(grads[i], s.history[j]) for i, j in self.deferred]
        it = iter(xs)
        for i in g.sources:
            for name in net.top_lists[i]:
                x = next(it)
                if net.layer_list[i].type != "Input":
                    net.blobs[name].write(x[-1].clone())
        net._ran, net._fed = {}, {}
