"""The Solver: Caffe's training loop (``Solver::Step/Solve/Test/Snapshot/Restore``).

A subclass supplies one hook, ``compute_update(i, param, grad, local_rate)``, which turns the
regularised gradient (in ``param.grad``, Caffe's param diff) into the step ``param -= grad``,
keeping its state in ``self.history`` (Caffe's history blobs, in ``.solverstate`` order).
Everything else - lr policy, clipping, iter_size normalisation, weight decay, testing, display,
snapshots, signals - lives here. Numbers follow Caffe's float32 arithmetic.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..net import Net
from ..proto import caffe_pb2 as pb
from ..proto.io import parse_text, read_net, read_solver
from ..proto.upgrade import upgrade_net, upgrade_solver
from . import snapshot as ss
from .lr_policy import policy

log = logging.getLogger("brewnet")
f32 = np.float32
SOLVERS: dict[str, type["Solver"]] = {}
EFFECTS = ("stop", "snapshot", "none")


def register(type_name: str):
    """``@register("Adam")``: the class is the solver for SolverParameter.type ``Adam``."""
    def wrap(cls):
        cls.solver_type = type_name
        SOLVERS[type_name] = cls
        return cls
    return wrap


class SolverError(ValueError):
    """A solver definition or state that cannot be used; the message names the file or field."""


class LossNotFiniteError(FloatingPointError):
    """Training produced a NaN or infinite loss; names the iteration and the first bad layer."""


def load_solver_param(source) -> tuple["pb.SolverParameter", Path | None]:
    """A SolverParameter from a path, prototxt text or a message; and the file it came from."""
    if isinstance(source, pb.SolverParameter):
        return upgrade_solver(source), None
    if isinstance(source, str) and ("{" in source or "\n" in source) and not os.path.exists(source):
        return upgrade_solver(parse_text(source, pb.SolverParameter())), None
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"solver file not found: {path}")
    param = read_solver(path)
    # Caffe's UpgradeSnapshotPrefixProperty: default to the solver file's name, and a
    # directory prefix gets the solver file's stem appended.
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = str(path.with_suffix(""))
    elif os.path.isdir(param.snapshot_prefix):
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, path.stem)
    return param, path


def _resolve(name: str, solver_path: Path | None, what: str) -> Path:
    """Caffe opens paths relative to the working directory; failing that, look beside the
    solver file and in its parent folders (Caffe's examples name paths from the repo root)."""
    tried = [Path(name)]
    if solver_path is not None and not Path(name).is_absolute():
        tried += [d / name for d in [solver_path.parent, *solver_path.parent.parents]]
    for p in tried:
        if p.exists():
            return p
    where = f" (solver {solver_path})" if solver_path else ""
    raise FileNotFoundError(f"{what} file not found: '{name}'{where}; looked at "
                            f"{', '.join(str(p) for p in tried[:4])}{' ...' if len(tried) > 4 else ''}")


class Solver:
    """Caffe's solver over a train net and its test nets (pycaffe's ``caffe.SGDSolver`` etc.).

    ``Solver(solver_prototxt_or_param, train_feed=None, test_feeds=None, device=None)``.
    Nets whose inputs are ``Input`` layers are fed by ``train_feed(i)`` / ``test_feeds[k](i)``:
    called before the i-th forward pass of that net, returning ``{blob name: array}`` (or None
    to keep what the blobs hold, e.g. written through ``solver.net.blobs[...].data``).
    """

    solver_type = ""
    history_sets = 1           # history blobs per learnable param
    frozen_is_noop = False     # lr_mult 0 leaves param and history untouched: skip it

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
        self._check_snapshot_prefix()
        if p.random_seed >= 0:
            from ..mode import set_random_seed
            set_random_seed(p.random_seed)
        self.device = self._pick_device(device)
        self.train_feed, self.test_feeds = train_feed, list(test_feeds or [])
        self.net = self._make_train_net()
        self.test_nets = self._make_test_nets()
        for w in p.weights:
            for path in w.split(","):
                for n in [self.net, *self.test_nets]:
                    n.copy_from(path)
        for n in self.test_nets:
            self.share_weights(n)
        self.iter, self.current_step = 0, 0
        self.loss = self.smoothed_loss = float("nan")
        self._losses: list = []
        self._train_count, self._test_counts = 0, [0] * len(self.test_nets)
        self._callbacks: list = []
        self._requests: list[str] = []
        self._early_exit = False
        self.test_scores: list[dict] = [{} for _ in self.test_nets]
        self.history = [torch.zeros_like(t.detach()) for _ in range(self.history_sets)
                        for t in self.net.learnable]
        log.info("Solver scaffolding done.")

    # -- hooks for update rules -------------------------------------------------------------
    def check_param(self, p) -> None:
        """Rule-specific checks of the SolverParameter (Caffe's CHECKs in the constructors)."""

    def compute_update(self, i: int, param: torch.Tensor, grad: torch.Tensor, local_rate: float) -> None:
        """Turn ``grad`` (in place) into the step for learnable param ``i``."""
        raise NotImplementedError

    # -- construction -----------------------------------------------------------------------
    def _pick_device(self, device) -> torch.device:
        if device is not None:
            return torch.device(device)
        p = self.param
        if p.HasField("solver_mode"):
            if p.solver_mode == pb.SolverParameter.CPU:
                return torch.device("cpu")
            if torch.cuda.is_available():
                return torch.device("cuda", p.device_id)
            log.warning("solver_mode GPU: CUDA is not available here; training on the CPU")
            return torch.device("cpu")
        from ..mode import default_device
        return default_device()

    def _check_snapshot_prefix(self) -> None:
        p = self.param
        if p.snapshot > 0:
            if not p.HasField("snapshot_prefix"):
                raise SolverError("In solver params, snapshot is specified but snapshot_prefix is not")
            folder = os.path.dirname(p.snapshot_prefix) or "."
            if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
                raise SolverError(f"Cannot write to snapshot prefix '{p.snapshot_prefix}'. Make sure "
                                  "that the directory exists and is writeable.")

    def _read_net(self, name: str) -> "pb.NetParameter":
        return read_net(_resolve(name, self._path, "net"))

    def _make_net(self, net_param, phase: int, override) -> Net:
        state = pb.NetState(phase=phase)
        state.MergeFrom(net_param.state)
        if override is not None:
            state.MergeFrom(override)
        net_param = pb.NetParameter.FromString(net_param.SerializeToString())
        net_param.state.CopyFrom(state)
        return Net(net_param, state.phase, level=state.level, stages=list(state.stage),
                   device=self.device)

    def _make_train_net(self) -> Net:
        p = self.param
        given = [f for f in ("net", "net_param", "train_net", "train_net_param") if p.HasField(f)]
        if len(given) != 1:
            raise SolverError("SolverParameter must specify exactly one train net using one of "
                              f"net, net_param, train_net, train_net_param; got {given or 'none'}")
        f = given[0]
        net_param = (self._read_net(getattr(p, f)) if f in ("net", "train_net")
                     else upgrade_net(getattr(p, f)))
        log.info("Creating training net from %s", f)
        return self._make_net(net_param, pb.TRAIN, p.train_state if p.HasField("train_state") else None)

    def _make_test_nets(self) -> list[Net]:
        p = self.param
        sources = [("test_net_param", upgrade_net(n)) for n in p.test_net_param]
        sources += [(f"test_net file: {n}", self._read_net(n)) for n in p.test_net]
        generic = p.HasField("net") or p.HasField("net_param")
        if len(p.test_iter) < len(sources) or (not generic and len(p.test_iter) != len(sources)):
            raise SolverError(f"test_iter must be specified for each test network: {len(sources)} "
                              f"test nets, {len(p.test_iter)} test_iter")
        for _ in range(len(p.test_iter) - len(sources)):
            sources.append((f"net file: {p.net}", self._read_net(p.net)) if p.HasField("net")
                           else ("net_param", upgrade_net(p.net_param)))
        if p.test_state and len(p.test_state) != len(sources):
            raise SolverError("test_state must be unspecified or specified once per test net")
        if sources and p.test_interval <= 0:
            raise SolverError(f"{len(sources)} test net(s) need test_interval > 0")
        nets = []
        for i, (src, net_param) in enumerate(sources):
            log.info("Creating test net (#%d) specified by %s", i, src)
            nets.append(self._make_net(net_param, pb.TEST, p.test_state[i] if p.test_state else None))
        return nets

    def share_weights(self, net: Net) -> None:
        """Make ``net``'s layers use the train net's parameter tensors, by layer name
        (Caffe's ``ShareTrainedLayersWith``)."""
        for layer in net.layer_list:
            src = self.net.layer_by_name.get(layer.name)
            if src is None or not layer.blobs:
                continue
            if len(src.blobs) != len(layer.blobs):
                raise SolverError(f"Layer '{layer.name}': {len(layer.blobs)} blobs in net "
                                  f"'{net.name}' but {len(src.blobs)} in the train net")
            for j, (a, b) in enumerate(zip(src.blobs, layer.blobs)):
                if tuple(a.shape) != tuple(b.shape):
                    raise SolverError(f"Layer '{layer.name}' blob {j}: shape {tuple(b.shape)} in net "
                                      f"'{net.name}' but {tuple(a.shape)} in the train net")
            layer.blobs = list(src.blobs)

    # -- pycaffe surface --------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The rate the next update will use (before any rule-specific correction)."""
        return float(policy(self.param.lr_policy)(self.param, self.iter, self.current_step)[0])

    def add_callback(self, on_start=None, on_gradients=None) -> None:
        """pycaffe's callbacks: ``on_start()`` before each iteration's forward passes,
        ``on_gradients()`` before its update."""
        self._callbacks.append((on_start, on_gradients))

    def request_action(self, action: str) -> None:
        """Ask the loop to ``"stop"`` or ``"snapshot"`` at the next check (signal handlers do)."""
        if action not in ("stop", "snapshot"):
            raise ValueError(f"unknown solver action '{action}'; known: stop, snapshot")
        self._requests.append(action)

    def _take_request(self) -> str | None:
        return self._requests.pop(0) if self._requests else None

    # -- the loop ---------------------------------------------------------------------------
    def step(self, iters: int) -> None:
        """Run ``iters`` iterations (Caffe's ``Solver::Step``)."""
        p = self.param
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._losses, self.smoothed_loss = [], f32(0)
        tic, last = time.perf_counter(), self.iter
        while self.iter < stop_iter:
            # Caffe's ClearParamDiffs. Dropping the grads (rather than zeroing them) lets
            # autograd store the fresh gradients without a zero pass and an add pass.
            for t in self.net.learnable:
                t.grad = None
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                self.test_all()
                if self._early_exit:
                    break
            for on_start, _ in self._callbacks:
                on_start and on_start()
            display = p.display and self.iter % p.display == 0
            self.loss = self._forward_backward()
            self._update_smoothed_loss(self.loss, start_iter)
            if display:
                lapse = time.perf_counter() - tic
                log.info("Iteration %d (%g iter/s, %gs/%d iters), loss = %g", self.iter,
                         (self.iter - last) / (lapse or 1), lapse, p.display, self.smoothed_loss)
                tic, last = time.perf_counter(), self.iter
                self._log_outputs(self.net, "Train", {n: self.net.blobs[n].tensor for n in self.net.outputs})
            for _, on_gradients in self._callbacks:
                on_gradients and on_gradients()
            self.apply_update(display)
            self.iter += 1
            request = self._take_request()
            if (p.snapshot and self.iter % p.snapshot == 0) or request == "snapshot":
                self.snapshot()
            if request == "stop":
                self._early_exit = True
                break

    def solve(self, resume_file=None, sigint_effect: str | None = None,
              sighup_effect: str | None = None) -> None:
        """Train to ``max_iter`` (Caffe's ``Solver::Solve``). ``sigint_effect``/``sighup_effect``
        ("stop", "snapshot", "none") install handlers for the run, as ``caffe train`` does."""
        p = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        self._early_exit = False
        with self._signals(sigint_effect, sighup_effect):
            if resume_file:
                log.info("Restoring previous solver status from %s", resume_file)
                self.restore(resume_file)
            start_iter = self.iter
            self.step(p.max_iter - self.iter)
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
                log.info("Iteration %d, loss = %g", self.iter, self.smoothed_loss)
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
        for _ in range(self.param.iter_size):
            self._feed(self.net, self.train_feed, self._train_count)
            self._train_count += 1
            loss = self.net.forward_tensors()
            self.net.backward_tensors(blob_diffs=False)
            total = loss if total is None else total + loss
        value = f32(total.item()) / f32(self.param.iter_size)
        if not math.isfinite(value):
            raise LossNotFiniteError(f"Iteration {self.iter}: loss is {value}; "
                                     f"{_nonfinite_origin(self.net)}")
        return value

    def apply_update(self, display: bool = False) -> None:
        """One update from the current param diffs (Caffe's ``SGDSolver::ApplyUpdate``);
        ``iter`` is not advanced."""
        p = self.param
        rate, self.current_step = policy(p.lr_policy)(p, self.iter, self.current_step)
        if display:
            log.info("Iteration %d, lr = %g", self.iter, rate)
        net = self.net
        grads = []
        for t in net.learnable:
            if t.grad is None:
                t.grad = torch.zeros_like(t.detach())
            grads.append(t.grad)
        self._clip(grads)
        norm = f32(1) / f32(p.iter_size)
        wd = f32(p.weight_decay)
        with torch.no_grad():
            for i, (t, g) in enumerate(zip(net.learnable, grads)):
                lr_mult = f32(net.lr_mults[i])
                if lr_mult == 0 and self.frozen_is_noop:
                    g.zero_()
                    continue
                if p.iter_size > 1:
                    g.mul_(float(norm))
                decay = wd * f32(net.decay_mults[i])
                if decay:
                    g.add_(t if p.regularization_type == "L2" else torch.sign(t), alpha=float(decay))
                self.compute_update(i, t, g, float(rate * lr_mult))
                t.sub_(g)

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

    def test(self, k: int = 0) -> dict:
        """Run test net ``k`` for ``test_iter[k]`` batches; returns ``{output: mean}`` and logs
        Caffe's "Test net output" lines."""
        p = self.param
        log.info("Iteration %d, Testing net (#%d)", self.iter, k)
        net = self.test_nets[k]
        self.share_weights(net)
        feed = self.test_feeds[k] if k < len(self.test_feeds) else None
        sums, loss = None, f32(0)
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
                outs = torch.cat([net.blobs[n].tensor.detach().reshape(-1).float() for n in net.outputs]) \
                    if net.outputs else torch.zeros(0)
                sums = outs.clone() if sums is None else sums.add_(outs)
        if p.test_compute_loss:
            log.info("Test loss: %g", loss / f32(p.test_iter[k]))
        means = (sums / p.test_iter[k]).cpu().numpy() if sums is not None else np.zeros(0, np.float32)
        out, pos = {}, 0
        for n in net.outputs:
            c = net.blobs[n].count
            out[n] = means[pos:pos + c].reshape(net.blobs[n].shape) if c > 1 else float(means[pos])
            pos += c
        self.test_scores[k] = out
        self._log_outputs(net, "Test", out)
        return out

    @staticmethod
    def _log_outputs(net: Net, kind: str, values: dict) -> None:
        j = 0
        weights = net.blob_loss_weights
        for name, v in values.items():
            w = weights[name]
            for x in np.asarray(torch.as_tensor(v).detach().float().cpu()).reshape(-1):
                extra = f" (* {w:g} = {f32(w) * x:g} loss)" if w else ""
                log.info("    %s net output #%d: %s = %g%s", kind, j, name, x, extra)
                j += 1

    # -- snapshots --------------------------------------------------------------------------
    def _filename(self, ext: str) -> str:
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{ext}"

    def snapshot(self) -> str:
        """Write ``<prefix>_iter_N.caffemodel[.h5]`` and ``.solverstate[.h5]``; returns the
        solver state's path."""
        from ..weights import net_to_proto, save_weights_h5
        from ..proto.io import write_binary

        p = self.param
        h5 = p.snapshot_format == pb.SolverParameter.HDF5
        model = self._filename(".caffemodel.h5" if h5 else ".caffemodel")
        log.info("Snapshotting to %s file %s", "HDF5" if h5 else "binary proto", model)
        if h5:
            save_weights_h5(self.net, model, with_diff=p.snapshot_diff)
        else:
            write_binary(model, net_to_proto(self.net, with_diff=p.snapshot_diff))
        state = ss.SolverStateData(self.iter, self.current_step, model,
                                   [h.detach().float().cpu().numpy() for h in self.history])
        path = self._filename(".solverstate.h5" if h5 else ".solverstate")
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
            self.net.copy_from(self._find_learned_net(st.learned_net, path))
        with torch.no_grad():
            for h, mine in zip(st.history, self.history):
                mine.copy_(torch.from_numpy(h.reshape(tuple(mine.shape))))
        self.iter, self.current_step = st.iter, st.current_step
        self._train_count = self.iter * self.param.iter_size

    @staticmethod
    def _find_learned_net(name: str, state_path: str) -> str:
        here = os.path.dirname(state_path)
        for cand in (name, os.path.join(here, name), os.path.join(here, os.path.basename(name))):
            if os.path.exists(cand):
                return cand
        raise FileNotFoundError(f"{state_path}: its learned_net '{name}' was not found (relative to "
                                f"the working directory or beside the solver state)")

    @contextlib.contextmanager
    def _signals(self, sigint: str | None, sighup: str | None):
        previous = []
        for name, effect in (("SIGINT", sigint), ("SIGHUP", sighup)):
            if effect is None or not hasattr(signal, name):
                continue
            if effect not in EFFECTS:
                raise ValueError(f"{name.lower()}_effect must be one of {', '.join(EFFECTS)}, got '{effect}'")
            if threading.current_thread() is not threading.main_thread():
                log.warning("signal handlers can only be installed from the main thread")
                continue
            sig = getattr(signal, name)
            handler = (signal.SIG_IGN if effect == "none"
                       else (lambda _s, _f, e=effect: self.request_action(e)))
            previous.append((sig, signal.signal(sig, handler)))
        try:
            yield
        finally:
            for sig, old in previous:
                signal.signal(sig, old)


def _nonfinite_origin(net: Net) -> str:
    """Replay the forward pass layer by layer and name the first non-finite top."""
    for name in net.inputs:
        if not torch.isfinite(net.blobs[name].tensor).all():
            return f"input blob '{name}' is not finite"
    with torch.no_grad():
        for i, layer in enumerate(net.layer_list):
            if layer.type == "Input":
                continue
            for j, b in enumerate(layer.blobs):
                if not torch.isfinite(b).all():
                    return f"parameter {j} of layer '{layer.name}' (type {layer.type}) is not finite"
            net.forward_tensors(i, i)
            for top in net.top_lists[i]:
                t = net.blobs[top].tensor
                if t.is_floating_point() and not torch.isfinite(t).all():
                    return f"first non-finite top: '{top}' of layer '{layer.name}' (type {layer.type})"
    return "no layer output is non-finite on replay (loss weights or a random layer?)"
