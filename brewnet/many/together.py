"""Train K solvers together in one process, each with its own solver, off one copy of the data.

``TrainTogether([s0, s1, ...], device=None)`` builds each solver as it would be built alone, then
joins the data layers that would make the same batches (one *data definition*) into one
``DataStream``: each batch is read, decoded, transformed and moved to the device once, and every
net gets the same read-only tensors in the order it would have read them alone. ``solve()`` steps
each solver until its own ``max_iter``, in turn or on N worker threads (``threads=N``, ``brewnet
train --together-threads N``, ``$BREWNET_TOGETHER_THREADS``; default: one per usable core when some
net is not tiny and all train on the CPU, the count planned by ``brewnet.execution.threads``).
Invariant: each solver's .caffemodel/.solverstate are byte-identical to training it alone, at any
thread count (``brewnet.execution.determinism``). Log lines start with ``[s0] ``, ``[s1] ``...
Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import threading

import torch

from ..execution import threads as _threads
from ..proto import caffe_pb2 as pb
from ..solvers import Solver, SolverError, get_solver
from ..solvers.guards import signal_effects
from ..solvers.logprefix import log_prefix
from .merge import first_difference, show

log = logging.getLogger("brewnet")
SHAREABLE = ("Data", "ImageData", "WindowData", "HDF5Data")
ENV_THREADS = "BREWNET_TOGETHER_THREADS"


class DataStream:
    """The batches of one data layer (the leader's), read once and served to every consumer
    (a data layer of the same definition) in order; a batch is dropped once all have had it."""

    def __init__(self, layer, definition, who: str):
        self.layer, self.definition, self.who = layer, definition, who
        self._read = type(layer).forward.__get__(layer)
        self._batches: collections.deque = collections.deque()
        self._base = 0
        self._pos: dict = {}
        self.reads = 0            # batches read from the source
        self.consumers: list[str] = []
        self._lock = threading.RLock()    # worker threads take batches at once

    def attach(self, layer, consumer, who: str) -> None:
        self._pos[consumer] = self._base
        self.consumers.append(who)
        layer.forward = functools.partial(self._take, consumer, layer)
        if hasattr(layer, "cursor_state"):      # a snapshot on another thread waits for a take
            layer.cursor_state = functools.partial(self._cursor, layer)
        if layer is not self.layer and getattr(layer, "prefetcher", None) is not None:
            layer.prefetcher.close()      # never started: it read nothing
            layer.prefetcher = None

    def detach(self, consumer) -> None:
        with self._lock:
            self._pos.pop(consumer, None)
            self._trim()

    def _take(self, consumer, layer, bottoms):
        with self._lock:        # the leader's read too: a batch is read once, in order
            return self._take_locked(consumer, layer, bottoms)

    def _take_locked(self, consumer, layer, bottoms):
        if consumer not in self._pos:
            raise SolverError(f"solver {consumer[0]} has finished solving and its data stream has "
                              "moved on; train it further in a new TrainTogether")
        i = self._pos[consumer] - self._base
        if i == len(self._batches):
            # with the leader's position after it: each consumer's snapshot records where
            # its own data stands (brewnet.data.cursors), as it would alone. A read for
            # another consumer leaves the leader's own position as it was (its solver may
            # snapshot before it takes this batch).
            mine = getattr(self.layer, "consumed_state", None)
            batch = self._read(bottoms)
            self._batches.append((batch, getattr(self.layer, "consumed_state", None)))
            if mine is not None:
                self.layer.consumed_state = mine
            self.reads += 1
        out, state = self._batches[i]
        if state is not None:
            own = getattr(layer, "consumed_state", None) or {}
            # the position is the leader's; the RNG stays the consumer's own (a shared stream
            # draws no random numbers, so it never moved)
            layer.consumed_state = {**state, **{k: v for k, v in own.items() if k == "rng"}}
        self._pos[consumer] += 1
        self._trim()
        return list(out)

    def _cursor(self, layer):
        with self._lock:
            return type(layer).cursor_state(layer)

    def _trim(self) -> None:
        low = min(self._pos.values(), default=self._base + len(self._batches))
        while self._base < low and self._batches:
            self._batches.popleft()
            self._base += 1


def _random(layer) -> bool:
    p = layer.param
    t = p.transform_param
    return (layer.type == "WindowData" or t.mirror or (t.crop_size > 0 and layer.phase == pb.TRAIN)
            or p.data_param.rand_skip > 0 or p.image_data_param.rand_skip > 0
            or p.image_data_param.shuffle or p.hdf5_data_param.shuffle)


def _rng_states(layer) -> str:
    loader = getattr(layer, "loader", None)
    owners = (layer, loader, getattr(loader, "tf", None))
    return repr([o.rng.bit_generator.state for o in owners if getattr(o, "rng", None) is not None])


def definition(layer, net, solver, test_index=None) -> tuple:
    """(layer parameters without the name, [(field, value)] of the rest): equal for two layers
    that make the same batches for solvers that consume them alike."""
    lp = pb.LayerParameter()
    lp.CopyFrom(layer.param)
    for f in ("name", "top", "include", "exclude"):
        lp.ClearField(f)
    p = solver.param
    rest = [("phase", pb.Phase.Name(layer.phase)), ("number of tops", len(layer.param.top)),
            ("device", str(net.device))]
    if test_index is None:
        rest.append(("iter_size", p.iter_size))
    else:
        rest += [("test_iter", p.test_iter[test_index]), ("test_interval", p.test_interval),
                 ("test_initialization", p.test_initialization)]
    if _random(layer):
        rest.append(("random state of its transform/shuffling (random_seed)", _rng_states(layer)))
    return lp, rest


def _difference(a, b):
    d = first_difference(a[0], b[0])
    if d:
        return f"{d[0]} ({show(d[1])} vs {show(d[2])})"
    for (name, x), (_, y) in zip(a[1], b[1]):
        if x != y:
            return name if "random" in name else f"{name} ({x!r} vs {y!r})"
    return None


def share_data(solvers, prefixes) -> list[DataStream]:
    """Join the solvers' data layers into streams by definition; log the grouping."""
    streams: list[DataStream] = []
    for k, s in enumerate(solvers):
        nets = [(s.net, None)] + [(n, i) for i, n in enumerate(s.test_nets)]
        for role, (net, ti) in enumerate(nets):
            for j, layer in enumerate(net.layer_list):
                if layer.type not in SHAREABLE:
                    continue
                d = definition(layer, net, s, ti)
                who = f"{prefixes[k].strip()} {'train' if ti is None else f'test#{ti}'} '{layer.name}'"
                stream = next((st for st in streams if _difference(st.definition, d) is None), None)
                if stream is None:
                    like = next((st for st in streams if st.layer.type == layer.type
                                 and st.definition[1][0] == d[1][0]), None)
                    if like is not None:
                        log.info("%s reads its own data stream: %s differs from %s", who,
                                 _difference(like.definition, d), like.who)
                    stream = DataStream(layer, d, who)
                    streams.append(stream)
                stream.attach(layer, (k, role, j), who)
    return streams


class TrainTogether:
    """K solvers in one process over shared data streams (see the module docstring).

    ``solvers``: solver files, SolverParameters (net paths resolvable from here) or Solver
    objects (built ones keep the random state they have; pass files or messages for numbers
    equal to training alone). ``prefixes``: log prefixes (default ``[s0] ``, ``[s1] ``...).
    ``registry``: the solver classes by type (pycaffe's, to get pycaffe Nets). ``threads``:
    worker threads stepping the solvers at once (default ``$BREWNET_TOGETHER_THREADS``, else
    chosen as the module docstring says; 1 steps them one after another in this thread).
    """

    def __init__(self, solvers, device=None, prefixes=None, registry=None, threads=None):
        if not solvers:
            raise SolverError("train together: no solvers given")
        self.prefixes = list(prefixes) if prefixes else [f"[s{k}] " for k in range(len(solvers))]
        self.solvers: list[Solver] = []
        self._rng: list = []
        for s, prefix in zip(solvers, self.prefixes):
            with log_prefix(prefix):
                solver = s if isinstance(s, Solver) else get_solver(s, registry=registry, device=device)
            solver.log_prefix = prefix
            self.solvers.append(solver)
            self._rng.append(self._rng_state(solver))
        self._check_prefixes()
        self.streams = share_data(self.solvers, self.prefixes)
        log.info("Training %d solvers together on %d data stream(s)", len(self.solvers),
                 len(self.streams))
        for st in self.streams:
            log.info("Data stream of %s: read for %s", st.who, ", ".join(st.consumers))
        self.dropped: set[int] = set()
        self._active: list[int] = []
        self.drawing = {k for k, s in enumerate(self.solvers) if draws_random(s)}
        self.groups = plan_groups(range(len(self.solvers)), self.drawing, worker_count(self.solvers, threads))
        if len(self.groups) > 1:
            log.info("Stepping the solvers on %d worker threads: %s", len(self.groups),
                     "; ".join(" ".join(self.prefixes[k].strip() for k in g) for g in self.groups))

    def _check_prefixes(self) -> None:
        seen = {}
        for k, s in enumerate(self.solvers):
            if not s.param.snapshot and not s.param.snapshot_after_train:
                continue
            other = seen.setdefault(s.param.snapshot_prefix, k)
            if other != k:
                raise SolverError(f"solvers {other} and {k} both snapshot to prefix "
                                  f"'{s.param.snapshot_prefix}'; give each its own snapshot_prefix")

    @staticmethod
    def _rng_state(solver):
        cuda = solver.device.type == "cuda"
        return torch.get_rng_state(), (torch.cuda.get_rng_state(solver.device) if cuda else None)

    def _advance(self, k: int, run, swap_rng: bool = True) -> bool:
        """One iteration of solver ``k`` with its own random state and prefix; False when done."""
        s = self.solvers[k]
        if swap_rng:
            cpu, cuda = self._rng[k]
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, s.device)
        try:
            with log_prefix(self.prefixes[k]):
                next(run)
            return True
        except StopIteration:
            return False
        except (ValueError, OSError, FloatingPointError) as e:
            e.args = (f"solver {k} ({self.prefixes[k].strip()}): {e}",) + e.args[1:]
            e.solver_index = k           # which solver (a search fails its trial alone)
            raise
        except Exception as e:      # torch's RuntimeErrors...: the traceback names the solver
            e.add_note(f"in solver {k} ({self.prefixes[k].strip()}) of TrainTogether")
            raise
        finally:
            if swap_rng:
                self._rng[k] = self._rng_state(s)

    def _run(self, runs, detach: bool, on_finished=None) -> None:
        for _ in self._rounds(runs, detach, on_finished):
            pass

    def _rounds(self, runs, detach: bool, on_finished=None):
        """One iteration of every live solver per round, yielding after each round; a solver
        ``drop`` takes out between rounds is stepped no further."""
        active = [k for k in range(len(runs)) if k not in self.dropped]
        self._active = active

        def done(k):
            active.remove(k)
            if detach:
                self.finished(k)
            if on_finished is not None:
                on_finished(k)
        if len(self.groups) > 1:
            yield from self._run_threaded(runs, active, done)
            return
        while active:
            for k in list(active):
                if k in active and not self._advance(k, runs[k]):
                    done(k)
            yield

    def _round(self, ks, runs, per: int) -> list[int]:
        """One iteration of each solver in ``ks`` (a worker thread's group) on ``per`` intra-op
        threads; those done. Only the drawing solvers swap torch's global random state: they
        all share one group, so no other thread touches it meanwhile."""
        if torch.get_num_threads() != per:
            torch.set_num_threads(per)
        for k in ks:
            self.solvers[k].threads.pinned = per
        return [k for k in ks if not self._advance(k, runs[k], swap_rng=k in self.drawing)]

    def _run_threaded(self, runs, active, done) -> None:
        """Rounds of one iteration per active solver, each group on its worker thread; the
        round ends when every group's has (batches kept for slower consumers stay bounded,
        and an error surfaces here, after the other groups' iterations). The live solvers are
        dealt to the workers again each round and the cores shared among the groups that have
        any: a solver pruned or finished leaves no core idle (the intra-op count does not
        change a solver's bits, ``brewnet.execution.determinism``)."""
        from concurrent.futures import ThreadPoolExecutor

        total = _threads.user_threads() or _threads.ceiling()
        before = torch.get_num_threads()
        try:
            with ThreadPoolExecutor(len(self.groups), thread_name_prefix="together") as pool:
                while active:
                    live = plan_groups(active, self.drawing & set(active), len(self.groups))
                    per = max(1, total // len(live))
                    futures = [pool.submit(self._round, g, runs, per) for g in live]
                    finished, error = [], None
                    for f in futures:
                        try:
                            finished += f.result()
                        except BaseException as e:      # noqa: B036 - re-raised below
                            error = error or e
                    if error is not None:
                        raise error
                    for k in sorted(finished):
                        done(k)
                    yield
        finally:
            for s in self.solvers:
                s.threads.pinned = None
            torch.set_num_threads(before)

    def drop(self, k: int) -> None:
        """Take solver ``k`` out between rounds of ``solving`` (a search prunes it): it reads
        and trains no more; the others go on exactly as before (its batches are no longer kept
        for it)."""
        if k in self.dropped or not 0 <= k < len(self.solvers):
            raise SolverError(f"train together: cannot drop solver {k}: not one that is running")
        self.dropped.add(k)
        if k in self._active:
            self._active.remove(k)
        self.finished(k)
        with log_prefix(self.prefixes[k]):
            log.info("Left the solvers trained together at iteration %d", self.solvers[k].iter)

    def finished(self, k: int) -> None:
        """Solver ``k`` reads no more (it solved to max_iter): its streams stop keeping batches
        for it. ``step`` does not call this: the solvers stay in step for the next call."""
        for st in self.streams:
            for c in [c for c in st._pos if c[0] == k]:
                st.detach(c)

    def request_action(self, action: str) -> None:
        """"stop" or "snapshot" for every solver at its next check (the signal handlers)."""
        for s in self.solvers:
            s.request_action(action)

    def step(self, iters: int) -> None:
        """``iters`` iterations of each solver, in turn."""
        self._run([s._stepping(iters) for s in self.solvers], detach=False)

    def solve(self, resume_files=None, sigint_effect: str | None = None,
              sighup_effect: str | None = None, on_finished=None) -> None:
        """Each solver to its own ``max_iter`` (``resume_files``: a .solverstate or None per
        solver); the signal handlers act on all of them; ``on_finished(k)`` is called as
        solver ``k`` ends."""
        with signal_effects(self.request_action, sigint_effect, sighup_effect):
            for _ in self.solving(resume_files, on_finished):
                pass

    def solving(self, resume_files=None, on_finished=None):
        """``solve`` as a generator that yields after each round (one iteration of every live
        solver); ``drop(k)`` may run between rounds."""
        resume = list(resume_files) if resume_files else [None] * len(self.solvers)
        yield from self._rounds([s.solving(r) for s, r in zip(self.solvers, resume)], True, on_finished)

    def size_threads(self, data_busy: float | None = None) -> int:
        """Torch's threads, once for the whole process, beside the streams' producers
        (``brewnet.execution.threads.plan_beside``)."""
        return _threads.plan_beside([st.layer for st in self.streams], data_busy,
                                    f" for {len(self.solvers)} solvers")

def draws_random(solver) -> bool:
    """Whether a step of ``solver`` may draw from torch's global random stream: a Dropout or
    stochastic Pooling layer, a Python layer, or a layer class from outside brewnet (whose
    draws cannot be known) in any of its nets."""
    for net in [solver.net, *solver.test_nets]:
        for layer in net.layer_list:
            if layer.type in ("Dropout", "Python") or not type(layer).__module__.startswith("brewnet."):
                return True
            if layer.type == "Pooling" and layer.param.pooling_param.pool == pb.PoolingParameter.STOCHASTIC:
                return True
    return False


def worker_count(solvers, requested=None) -> int:
    """Worker threads for ``solvers``: ``requested``, else ``$BREWNET_TOGETHER_THREADS``, else
    one per usable core when some net is not tiny (``brewnet.execution.threads.TINY_FLOPS``) and all
    train on the CPU, else 1 (see the module docstring for the measurements)."""
    if requested is None:
        env = os.environ.get(ENV_THREADS, "").strip()
        if env:
            try:
                requested = int(env)
            except ValueError:
                raise SolverError(f"{ENV_THREADS}={env!r}: expected a positive integer") from None
    if requested is None:
        big = any(not s.threads.tiny for s in solvers)
        cpu = all(s.device.type == "cpu" for s in solvers)
        requested = _threads.usable_cores() if big and cpu else 1
    if int(requested) < 1:
        raise SolverError(f"train together: threads must be >= 1, got {requested}")
    return min(int(requested), len(solvers))


def plan_groups(indices, drawing, n: int) -> list[list[int]]:
    """The solvers ``indices`` in ``n`` groups, one per worker thread: every drawing solver in
    the first (torch's random stream is one per process), the others each to the group with the
    fewest; empty groups dropped."""
    groups: list[list[int]] = [[] for _ in range(max(1, n))]
    groups[0] += sorted(drawing)
    for k in indices:
        if k not in drawing:
            min(groups, key=len).append(k)
    return [sorted(g) for g in groups if g]


def train_together(solvers, device=None, threads=None, **kw) -> TrainTogether:
    """Build ``TrainTogether(solvers, device, threads=threads)`` and solve; returns it."""
    t = TrainTogether(solvers, device=device, threads=threads)
    t.solve(**kw)
    return t
