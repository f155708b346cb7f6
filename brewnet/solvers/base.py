"""The Solver: Caffe's training loop (``Solver::Step/Solve/Test/Snapshot/Restore``).

A subclass supplies one hook, ``compute_update(i, param, grad, local_rate)``, which turns the
regularised gradient (in ``param.grad``, Caffe's param diff) into the step ``param -= grad``,
keeping its state in ``self.history`` (Caffe's history blobs, in ``.solverstate`` order).
Everything else - lr policy, clipping, iter_size normalisation, weight decay, testing, display,
snapshots, signals - lives here. Numbers follow Caffe's float32 arithmetic.
"""
from __future__ import annotations

import logging
import math
import os
import time

import numpy as np
import torch

from ..blob import diff_viewed
from ..data import cursors
from ..execution import determinism, process, recorded_step, recorded_update, steps_per_call, threads
from ..net import Net
from ..proto import caffe_pb2 as pb
from . import detection_eval
from . import snapshot as ss
from .guards import LossNotFiniteError, nonfinite_origin, signal_effects
from .logprefix import prefixed
from .lr_policy import policy
from .nets import SolverError, load_solver_param, make_test_nets, make_train_net, pick_device, share_weights
from .nets import resolve as _resolve

log = logging.getLogger("brewnet")
f32 = np.float32
SOLVERS: dict[str, type["Solver"]] = {}
__all__ = ["SOLVERS", "Solver", "SolverError", "LossNotFiniteError", "register",
           "load_solver_param", "_resolve"]


def register(type_name: str):
    """``@register("Adam")``: the class is the solver for SolverParameter.type ``Adam``."""
    def wrap(cls):
        cls.solver_type = type_name
        SOLVERS[type_name] = cls
        return cls
    return wrap


def regularized_groups(todo, l2: bool):
    """The (index, param, diff, decay, rate) entries of ``todo`` grouped by (decay, rate), each
    group's diffs regularised in one ``_foreach`` op: yields (indices, params, diffs, rate)."""
    groups: dict[tuple[float, float], list] = {}
    for i, t, g, decay, rate in todo:
        groups.setdefault((decay, rate), []).append((i, t, g))
    for (decay, rate), items in groups.items():
        idx, ts, gs = (list(x) for x in zip(*items))
        if decay:
            torch._foreach_add_(gs, ts if l2 else torch._foreach_sign(ts), alpha=decay)
        yield idx, ts, gs, rate


class Solver:
    """Caffe's solver over a train net and its test nets (pycaffe's ``caffe.SGDSolver`` etc.).

    ``Solver(solver_prototxt_or_param, train_feed=None, test_feeds=None, device=None)``.
    Nets whose inputs are ``Input`` layers are fed by ``train_feed(i)`` / ``test_feeds[k](i)``:
    called before the i-th forward pass of that net, returning ``{blob name: array}`` (or None
    to keep what the blobs hold, e.g. written through ``solver.net.blobs[...].data``).
    """

    solver_type = ""
    net_class = Net            # pycaffe's solvers build pycaffe Nets
    history_sets = 1           # history blobs per learnable param
    frozen_is_noop = False     # lr_mult 0 leaves param and history untouched: skip it
    log_prefix = ""            # starts each log line of step/solve/test/snapshot ("[s1] ")

    def __init__(self, param, train_feed=None, test_feeds=None, device=None):
        self.param, self._path = load_solver_param(param)
        p = self.param
        if p.type != self.solver_type:
            log.warning("%s built from a solver file of type '%s'", type(self).__name__, p.type)
        policy(p.lr_policy)
        if p.average_loss < 1:
            raise SolverError(f"average_loss must be >= 1, got {p.average_loss}")
        if p.iter_size < 1:
            raise SolverError(f"iter_size must be >= 1, got {p.iter_size}")
        if p.regularization_type not in ("L1", "L2"):
            raise SolverError(f"Unknown regularization type '{p.regularization_type}'. Known: L1, L2")
        self.check_param(p)
        if p.snapshot > 0:
            ss.check_prefix(self.param)
        if p.random_seed >= 0:
            process.set_random_seed(p.random_seed)
        self.device = pick_device(p, device)
        process.configure(self.device, keep_memory=True)   # training: true float32, reused memory
        self.train_feed, self.test_feeds = train_feed, list(test_feeds or [])
        self.net = make_train_net(p, self._path, self.device, self.net_class)
        self.test_nets = make_test_nets(p, self._path, self.device, self.net_class)
        for w in p.weights:
            for path in w.split(","):
                for n in [self.net, *self.test_nets]:
                    n.copy_from(path)
        for n in self.test_nets:
            self.share_weights(n)
        detection_eval.check(p, self.test_nets)
        self.iter, self.current_step = 0, 0
        self.loss = self.smoothed_loss = float("nan")
        self._losses: list = []
        self._train_count, self._test_counts = 0, [0] * len(self.test_nets)
        self._callbacks: list = []
        self._watchers: list = []
        self._requests: list[str] = []
        self._early_exit = False
        self.test_scores: list[dict] = [{} for _ in self.test_nets]
        self.history = [torch.zeros_like(t.detach()) for _ in range(self.history_sets)
                        for t in self.net.learnable]
        self._pending_steps: list[tuple[torch.Tensor, torch.Tensor]] = []   # (diff, step)
        self._zero_history: set[int] = set()      # learnable indices whose history is all 0
        # torch's threads for this net's steps: fixed for the run (reproducible numbers)
        self.threads = threads.Tuner(self.net, timed=threads.timed_training())
        determinism.prepare(self.net)
        self.restored_cursors: list | None = None  # every rank's data cursors, from restore()
        self.replicas = None    # brewnet.parallel.Replicas when other workers train with this one
        log.info("Solver scaffolding done.")

    # -- hooks for update rules -------------------------------------------------------------
    def check_param(self, p) -> None:
        """Rule-specific checks of the SolverParameter (Caffe's CHECKs in the constructors)."""

    def compute_update(self, i: int, param: torch.Tensor, grad: torch.Tensor, local_rate: float) -> None:
        """Turn ``grad`` (in place) into the step for learnable param ``i``."""
        raise NotImplementedError

    def compute_updates(self, idx: list[int], params: list, grads: list, local_rate: float) -> None:
        """``compute_update`` for several params sharing a rate, with ``torch._foreach_*`` ops
        (one call per op instead of one per param and op; on the CPU they run the same
        per-tensor kernels, so the numbers are the same). Default: one by one."""
        for i, t, g in zip(idx, params, grads):
            self.compute_update(i, t, g, local_rate)

    foreach = True     # False: the per-param ops (the reference the fused forms are tested on)

    def _foreach_ok(self) -> bool:
        """Whether ``compute_updates`` is this rule's own: a subclass that overrides only
        ``compute_update`` must not get its parent's fused form."""
        mro = type(self).__mro__
        one = next(c for c in mro if "compute_update" in c.__dict__)
        many = next(c for c in mro if "compute_updates" in c.__dict__)
        return self.foreach and mro.index(many) <= mro.index(one)

    def update_params(self, todo, l2: bool, store_step: bool) -> None:
        """Regularise, turn into steps and apply the diffs of ``todo``, a list of (index, param,
        diff, decay, local rate), in Caffe's order: diff += decay * (param or sign(param) for
        L1); ``compute_update``; param -= diff; params sharing (decay, rate) in one group of
        ``_foreach`` ops. A rule may override this with a fused version giving the same
        numbers; with ``store_step`` False it may defer leaving the step in the diff to
        ``_store_steps`` (the loop clears the diffs before anyone else sees them)."""
        if not self._foreach_ok():
            for i, t, g, decay, rate in todo:
                if decay:
                    g.add_(t if l2 else torch.sign(t), alpha=decay)
                self.compute_update(i, t, g, rate)
                t.sub_(g)
            return
        for idx, ts, gs, rate in regularized_groups(todo, l2):
            self.compute_updates(idx, ts, gs, rate)
            torch._foreach_sub_(ts, gs)

    def _store_steps(self) -> None:
        """Leave the steps an update deferred in the param diffs (Caffe's diffs hold the step)."""
        if self._pending_steps:
            diffs, steps = zip(*self._pending_steps)
            torch._foreach_copy_(list(diffs), list(steps))
            self._pending_steps = []

    # -- construction -----------------------------------------------------------------------
    def share_weights(self, net: Net) -> None:
        """Make ``net``'s layers use the train net's parameter tensors, by layer name
        (Caffe's ``ShareTrainedLayersWith``)."""
        share_weights(self.net, net)

    # -- pycaffe surface --------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The rate the next update will use (before any rule-specific correction). Reading it
        is pycaffe's ``solver.lr``, i.e. a call of Caffe's ``GetLearningRate``, which moves
        ``current_step`` as a call from the update does: "multistep" advances at most one
        step per call, so a read can bring forward a second step due at the same iteration."""
        rate, self.current_step = policy(self.param.lr_policy)(self.param, self.iter, self.current_step)
        return float(rate)

    def add_callback(self, on_start=None, on_gradients=None) -> None:
        """pycaffe's callbacks: ``on_start()`` before each iteration's forward passes,
        ``on_gradients()`` before its update."""
        self._callbacks.append((on_start, on_gradients))

    def add_watcher(self, watch) -> None:
        """``watch(tag, value, iteration)`` for every number the log shows as it is logged: the
        train outputs at each display (``train/<output>``), each test output (``test/<output>``;
        test net k > 0: ``test<k>/<output>``), the smoothed loss (``solver/loss``), the learning
        rate (``solver/lr``) and the seconds per iteration since the last display
        (``solver/seconds_per_iter``). An output of several values gives ``<tag>/<j>`` each.
        ``brewnet.solvers.tensorboard.attach`` writes them as TensorBoard event files."""
        self._watchers.append(watch)

    def _emit(self, tag: str, value) -> None:
        for watch in self._watchers:
            watch(tag, float(value), self.iter)

    # -- the log lines that carry numbers (one place each, so a watcher sees them all) -------
    def _log_speed(self, iters: int, lapse: float) -> None:
        """The display line: iterations per second over the last ``iters`` and the smoothed loss."""
        log.info("Iteration %d (%g iter/s, %gs/%d iters), loss = %g", self.iter,
                 iters / (lapse or 1), lapse, self.param.display, self.smoothed_loss)
        self._emit("solver/loss", self.smoothed_loss)
        if iters:
            self._emit("solver/seconds_per_iter", lapse / iters)

    def _log_loss(self) -> None:
        """The last display line of a solve (the loss after the last update)."""
        log.info("Iteration %d, loss = %g", self.iter, self.smoothed_loss)
        self._emit("solver/loss", self.smoothed_loss)

    def _log_rate(self, rate) -> None:
        log.info("Iteration %d, lr = %g", self.iter, rate)
        self._emit("solver/lr", rate)

    def request_action(self, action: str) -> None:
        """Ask the loop to ``"stop"`` or ``"snapshot"`` at the next check (signal handlers do)."""
        if action not in ("stop", "snapshot"):
            raise ValueError(f"unknown solver action '{action}'; known: stop, snapshot")
        self._requests.append(action)

    def _take_request(self) -> str | None:
        return self._requests.pop(0) if self._requests else None

    # -- the loop ---------------------------------------------------------------------------
    @prefixed
    def step(self, iters: int) -> None:
        """Run ``iters`` iterations (Caffe's ``Solver::Step``)."""
        for _ in self._stepping(iters, several=True):
            pass

    def _stepping(self, iters: int, several: bool = False):
        """``step`` as a generator that yields after each iteration (``brewnet.many`` runs
        several solvers' iterations in turn); ``several``: iterations between two observable
        points may run as one call, yielding once (execution/steps_per_call.py)."""
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._losses, self.smoothed_loss = [], f32(0)
        try:
            yield from self._step_loop(start_iter, stop_iter, several)
        finally:
            self._store_steps()

    def _step_loop(self, start_iter: int, stop_iter: int, several: bool = False) -> None:
        p = self.param
        tic, last = time.perf_counter(), self.iter
        while self.iter < stop_iter:
            # Caffe's ClearParamDiffs. Dropping the grads (rather than zeroing them) lets
            # autograd store the fresh gradients without a zero pass and an add pass; a diff
            # someone holds a numpy view of is zeroed in place instead, so the view follows.
            self._pending_steps = []
            for t in self.net.learnable:
                if t.grad is not None and diff_viewed(t):
                    t.grad.zero_()
                else:
                    t.grad = None
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                self.test_all()
                if self._early_exit:
                    break
            for on_start, _ in tuple(self._callbacks):     # one may remove itself
                on_start and on_start()
            display = p.display and self.iter % p.display == 0
            done = steps_per_call.run(self, start_iter, stop_iter) if several and not display else 0
            if not done:    # else the iterations to the next observable point, in one call
                with self.threads:           # times the iteration for the thread choice
                    determinism.blas_on_one_thread()    # after the count is set: it resets MKL's
                    self._iters_left = stop_iter - self.iter     # for the step graph's choice
                    self.loss = self._forward_backward()
                    self._update_smoothed_loss(self.loss, start_iter)
                    if display:
                        self._log_speed(self.iter - last, time.perf_counter() - tic)
                        tic, last = time.perf_counter(), self.iter
                        self._log_outputs(self.net, "Train", {n: self.net.blobs[n].tensor for n in self.net.outputs})
                    for _, on_gradients in self._callbacks:
                        on_gradients and on_gradients()
                    if not recorded_update.applied(self, display):   # the step graph's recorded update
                        self.apply_update(display, store_step=False)
            self.iter += done or 1
            request = self._take_request()
            if (p.snapshot and self.iter % p.snapshot == 0) or request == "snapshot":
                self.snapshot()
            if request == "stop":
                self._early_exit = True
                break
            yield

    @prefixed
    def solve(self, resume_file=None, sigint_effect: str | None = None,
              sighup_effect: str | None = None) -> None:
        """Train to ``max_iter`` (Caffe's ``Solver::Solve``). ``sigint_effect``/``sighup_effect``
        ("stop", "snapshot", "none") install handlers for the run, as ``caffe train`` does."""
        for _ in self.solving(resume_file, sigint_effect, sighup_effect, several=True):
            pass

    def solving(self, resume_file=None, sigint_effect: str | None = None,
                sighup_effect: str | None = None, several: bool = False):
        """``solve`` as a generator that yields after each iteration (``several``: _stepping's)."""
        p = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        self._early_exit = False
        with signal_effects(self.request_action, sigint_effect, sighup_effect):
            if resume_file:
                log.info("Restoring previous solver status from %s", resume_file)
                self.restore(resume_file)
            start_iter = self.iter
            yield from self._stepping(p.max_iter - self.iter, several)
            if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
                self.snapshot()
            if self._early_exit:
                log.info("Optimization stopped early.")
                return
            if p.display and self.iter % p.display == 0:
                self._feed(self.net, self.train_feed, self._train_count)
                self._train_count += 1
                with torch.no_grad():
                    loss = f32(self.net.forward_tensors().item())
                self._update_smoothed_loss(loss, start_iter)
                self._log_loss()
            if p.test_interval and self.iter % p.test_interval == 0:
                self.test_all()
        log.info("Optimization Done.")

    def _update_smoothed_loss(self, loss, start_iter: int) -> None:
        n = self.param.average_loss
        if len(self._losses) < n:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = f32((self.smoothed_loss * f32(size - 1) + loss) / f32(size))
        else:
            idx = (self.iter - start_iter) % n
            self.smoothed_loss = f32(self.smoothed_loss + (loss - self._losses[idx]) / f32(n))
            self._losses[idx] = loss

    def _feed(self, net: Net, fn, i: int) -> None:
        batch = fn(i) if fn is not None else None
        for name, value in (batch or {}).items():
            if name not in net.inputs:
                raise SolverError(f"feed: '{name}' is not an input of net '{net.name}'; inputs are {net.inputs}")
            blob = net.blobs[name]
            t = torch.as_tensor(value).to(device=net.device, dtype=blob.tensor.dtype)
            if tuple(t.shape) == blob.shape:
                with torch.no_grad():
                    blob.tensor.copy_(t)
            else:
                blob.tensor = t

    def _forward_backward(self) -> np.float32:
        total = None
        graph = None if self.net.hooked() else recorded_step.for_solver(self, getattr(self, "_iters_left", 0))
        for _ in range(self.param.iter_size):
            self._feed(self.net, self.train_feed, self._train_count)
            self._train_count += 1
            if graph is not None:
                loss = graph.forward_backward()
            else:
                loss = self.net.forward_tensors()
                self.net.backward_tensors(blob_diffs=False)
            total = loss if total is None else total + loss
        value = f32(total.item()) / f32(self.param.iter_size)
        if not math.isfinite(value):
            raise LossNotFiniteError(f"Iteration {self.iter}: loss is {value}; "
                                     f"{nonfinite_origin(self.net)}")
        return value

    def apply_update(self, display: bool = False, store_step: bool = True) -> None:
        """One update from the current param diffs (Caffe's ``SGDSolver::ApplyUpdate``);
        ``iter`` is not advanced. The diffs are left holding the step, as Caffe's; the loop
        lets a rule defer that (``store_step=False``) until someone could look."""
        p = self.param
        rate, self.current_step = policy(p.lr_policy)(p, self.iter, self.current_step)
        if display:
            self._log_rate(rate)
        net = self.net
        grads = []
        for t in net.learnable:
            if t.grad is None:
                t.grad = torch.zeros_like(t.detach())
            grads.append(t.grad)
        self._clip(grads)
        norm = float(f32(1) / f32(p.iter_size)) if p.iter_size > 1 else None
        todo = []
        with torch.no_grad():
            for i, (t, g, (lr_mult, decay)) in enumerate(zip(net.learnable, grads, self._mults())):
                if lr_mult == 0 and self.frozen_is_noop and self._history_is_zero(i):
                    g.zero_()
                    continue
                self._zero_history.discard(i)
                if norm is not None:
                    g.mul_(norm)
                todo.append((i, t, g, decay, float(rate * lr_mult)))
            self.update_params(todo, p.regularization_type == "L2", store_step)

    def _mults(self) -> list[tuple]:
        """(float32 lr_mult, decay) per learnable param; numpy scalar math costs ~1 us an
        operation, so it is redone only when the mults or the weight decay change."""
        net, wd = self.net, self.param.weight_decay
        key = (wd, tuple(net.lr_mults), tuple(net.decay_mults))
        if getattr(self, "_mults_key", None) != key:
            self._mults_key = key
            self._mults_val = [(f32(m), float(f32(wd) * f32(d)))
                               for m, d in zip(net.lr_mults, net.decay_mults)]
        return self._mults_val

    def _history_is_zero(self, i: int) -> bool:
        """Whether learnable param ``i``'s history is all zeros (then a frozen SGD/Nesterov
        update leaves everything as it is). A restored or earlier-trained history is not: Caffe
        keeps decaying it by momentum and moves the param with it. Known-zero indices are
        cached; any update of ``i`` drops it from the cache."""
        if i not in self._zero_history:
            n = len(self.net.learnable)
            if any(self.history[k * n + i].any() for k in range(self.history_sets)):
                return False
            self._zero_history.add(i)
        return True

    def _clip(self, grads) -> None:
        clip = f32(self.param.clip_gradients)
        if clip < 0 or not grads:
            return
        norm = f32(math.sqrt(float(torch.stack([g.float().pow(2).sum() for g in grads]).sum())))
        if norm > clip:
            scale = clip / norm
            log.info("Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale factor %g",
                     norm, clip, scale)
            for g in grads:
                g.mul_(float(scale))

    # -- testing ----------------------------------------------------------------------------
    def test_all(self) -> None:
        for k in range(len(self.test_nets)):
            if self._early_exit:
                break
            self.test(k)

    @prefixed
    def test(self, k: int = 0) -> dict:
        """Run test net ``k`` for ``test_iter[k]`` batches; returns ``{output: mean}`` and logs
        Caffe's "Test net output" lines. Under SSD's ``eval_type: "detection"`` each output
        is the mAP of its DetectionEvaluate rows over the batches (``detection_eval``)."""
        p = self.param
        log.info("Iteration %d, Testing net (#%d)", self.iter, k)
        net = self.test_nets[k]
        self.share_weights(net)
        feed = self.test_feeds[k] if k < len(self.test_feeds) else None
        sums, loss = None, f32(0)
        maps = {n: detection_eval.DetectionMAP() for n in net.outputs} \
            if p.eval_type == "detection" else None
        with torch.no_grad():
            for i in range(p.test_iter[k]):
                request = self._take_request()
                while request is not None:
                    if request == "snapshot":
                        self.snapshot()
                    else:
                        self._early_exit = True
                    request = self._take_request()
                if self._early_exit:
                    log.info("Test interrupted.")
                    return {}
                self._feed(net, feed, self._test_counts[k])
                self._test_counts[k] += 1
                iter_loss = net.forward_tensors()
                if p.test_compute_loss:
                    loss += f32(iter_loss.item())
                if maps is not None:
                    for n, m in maps.items():
                        m.add(net.blobs[n].tensor.detach().float().cpu().numpy())
                    continue
                outs = torch.cat([net.blobs[n].tensor.detach().reshape(-1).float() for n in net.outputs]) \
                    if net.outputs else torch.zeros(0)
                sums = outs.clone() if sums is None else sums.add_(outs)
        if p.test_compute_loss:
            log.info("Test loss: %g", loss / f32(p.test_iter[k]))
        if maps is not None:
            self.test_scores[k] = detection_eval.report(maps, p.ap_version, p.show_per_class_result)
            for name, v in self.test_scores[k].items():
                self._emit(f"{self._test_tag(k)}/{name}", v)
            return self.test_scores[k]
        means = (sums / p.test_iter[k]).cpu().numpy() if sums is not None else np.zeros(0, np.float32)
        out, pos = {}, 0
        for n in net.outputs:
            c = net.blobs[n].count
            out[n] = means[pos:pos + c].reshape(net.blobs[n].shape) if c > 1 else float(means[pos])
            pos += c
        self.test_scores[k] = out
        self._log_outputs(net, "Test", out, self._test_tag(k))
        return out

    @staticmethod
    def _test_tag(k: int) -> str:
        return f"test{k}" if k else "test"

    def _log_outputs(self, net: Net, kind: str, values: dict, tag: str = "train") -> None:
        """Caffe's ``Train/Test net output #j`` lines; watchers get ``tag/<name>``."""
        j = 0
        weights = net.blob_loss_weights
        for name, v in values.items():
            w = weights[name]
            xs = np.asarray(torch.as_tensor(v).detach().float().cpu()).reshape(-1)
            for i, x in enumerate(xs):
                extra = f" (* {w:g} = {f32(w) * x:g} loss)" if w else ""
                log.info("    %s net output #%d: %s = %g%s", kind, j, name, x, extra)
                if self._watchers:
                    self._emit(f"{tag}/{name}" if len(xs) == 1 else f"{tag}/{name}/{i}", x)
                j += 1

    # -- snapshots --------------------------------------------------------------------------
    def _filename(self, ext: str) -> str:
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{ext}"

    @prefixed
    def snapshot(self) -> str:
        """Write ``<prefix>_iter_N.caffemodel[.h5]`` and ``.solverstate[.h5]``; returns the
        solver state's path."""
        from ..proto.io import remove_stale_temps, write_binary
        from ..weights import net_to_proto, save_weights_h5

        self._store_steps()
        ranks = [cursors.capture(self.net)]
        if self.replicas is not None:      # every worker's cursors; rank 0 alone writes
            ranks = self.replicas.gather_cursors(ranks[0])
            if ranks is None:
                return ""
        remove_stale_temps(f"{self.param.snapshot_prefix}_iter_")   # a killed snapshot's
        p = self.param
        h5 = p.snapshot_format == pb.SolverParameter.HDF5
        model = self._filename(".caffemodel.h5" if h5 else ".caffemodel")
        log.info("Snapshotting to %s file %s", "HDF5" if h5 else "binary proto", model)
        if h5:
            save_weights_h5(self.net, model, with_diff=p.snapshot_diff)
        else:
            write_binary(model, net_to_proto(self.net, with_diff=p.snapshot_diff))
        path = self._filename(".solverstate.h5" if h5 else ".solverstate")
        if any(ranks):              # a net with data layers that know their position
            cursors.write(cursors.path_for(path), self.iter, ranks)
        state = ss.SolverStateData(self.iter, self.current_step, model,
                                   [h.detach().float().cpu().numpy() for h in self.history])
        log.info("Snapshotting solver state to %s file %s", "HDF5" if h5 else "binary proto", path)
        (ss.write_solverstate_h5 if h5 else ss.write_solverstate)(path, state)
        return path

    def restore(self, path) -> None:
        """Continue from a ``.solverstate`` (binary or HDF5): iteration, lr step, history and
        the ``learned_net`` weights it names (Caffe's ``Solver::Restore``)."""
        path = os.fspath(path)
        st = ss.read_solverstate(path)
        if len(st.history) != len(self.history):
            raise SolverError(f"{path}: {len(st.history)} history blobs, but this {self.solver_type} "
                              f"solver needs {len(self.history)} ({len(self.net.learnable)} learnable "
                              f"params x {self.history_sets}); was it written for another net or solver type?")
        for i, (h, mine) in enumerate(zip(st.history, self.history)):
            if h.size != mine.numel():
                raise SolverError(f"{path}: history blob {i} has shape {h.shape} but learnable param "
                                  f"{i % len(self.net.learnable)} has shape {tuple(mine.shape)}")
        if st.learned_net:
            self.net.copy_from(ss.find_learned_net(st.learned_net, path))
        with torch.no_grad():
            for h, mine in zip(st.history, self.history):
                mine.copy_(torch.from_numpy(h.reshape(tuple(mine.shape))))
        self.iter, self.current_step = st.iter, st.current_step
        self._zero_history.clear()
        self._train_count = self.iter * self.param.iter_size
        self.restored_cursors = cursors.resume(self.net, path, st.iter, alone=self.replicas is None)

