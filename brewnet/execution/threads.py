"""Torch's intra-op threads: the single owner of brewnet's thread policy.

Everything that sets a count asks here: a per-net ``Tuner`` around each call (a Solver's train
net, a pycaffe ``Net``'s forward), and ``plan``, ``plan_beside`` and ``replan_after`` for the
ceiling beside data threads (the CLI commands, Solver runs, ``TrainTogether``, ``data.prefetch``).
A net whose every layer does under ``TINY_FLOPS`` a pass runs on one thread. A training net keeps
its first choice for the run: its bits must not follow the load (``determinism.py``;
``BREWNET_THREADS=adaptive`` times training too). A forward-only net times its calls against a few
on the other count (``BLOCK``, ``TRIAL``, ``ABORT``, ``RECHECK_S``) and keeps the faster. ``import
brewnet`` before torch sets ``OMP_WAIT_POLICY=PASSIVE`` after a short spin (``GOMP_SPINCOUNT``);
after torch, training runs on one thread.
``BREWNET_THREADS=N``, ``OMP_NUM_THREADS`` or a user's ``torch.set_num_threads`` win: brewnet never
changes a count it did not set. Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import time
import weakref

import torch

from .fast_path import FAILED, FastPath

log = logging.getLogger("brewnet")
TINY_FLOPS = 4e6       # below this per layer and pass, threads cost more than they save
BLOCK = 5              # recent calls on the current choice, compared with a trial
TRIAL = 3              # calls on the other choice
ABORT = 1.25           # a trial call this much slower than the current median ends the trial
WARMUP = 3             # calls before the first timing (allocator, oneDNN primitive caches)
RECHECK_S = 10.0
MAX_WAIT_S = 160.0     # re-checks that keep stopping early back off to this
ADAPTIVE = "adaptive"   # BREWNET_THREADS=adaptive: timed choice in training as well
_initial = torch.get_num_threads()      # torch's count when brewnet was imported
SPINNING = False       # set by brewnet/__init__.py: torch was loaded before brewnet, policy unset
_warned: list[bool] = []
_ours: list[int] = []                   # the last count brewnet set


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def user_threads() -> int | None:
    """The count the user fixed (``BREWNET_THREADS``, ``OMP_NUM_THREADS``, or a
    ``torch.set_num_threads`` brewnet did not make), else None."""
    env = os.environ.get("BREWNET_THREADS", "").strip()
    if env and env != ADAPTIVE:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"BREWNET_THREADS={env!r}: expected a positive integer or "
                             f"'{ADAPTIVE}'") from None
        if n < 1:
            raise ValueError(f"BREWNET_THREADS={env!r}: expected a positive integer")
        return n
    cur = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return cur
    if cur != (_ours[-1] if _ours else _initial):
        return cur
    return None


def apply(n: int) -> None:
    """Set torch's intra-op threads to ``n`` as brewnet's own choice (unless the user fixed them)."""
    fixed = user_threads()
    if fixed is not None:
        n = fixed
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if fixed is None:
        _ours[:] = [n]


_ceiling: list[int] = []


def set_ceiling(n: int) -> None:
    """The most threads brewnet's timing may choose (the CLI: cores left beside data threads)."""
    _ceiling[:] = [max(1, int(n))]
    apply(_ceiling[0])


def ceiling() -> int:
    return _ceiling[0] if _ceiling else max(1, usable_cores())


# -- beside data threads: the plan the commands, Solver runs and TrainTogether ask for -------------
DECODING = ("ImageData", "WindowData")   # their producers decode images: a busy core each


def plan(data_busy: float = 1.0, apply: bool = True, cores: int | None = None) -> int:
    """Torch's threads next to data producers that keep ``data_busy`` cores busy: a light
    producer (under a quarter of a core: raw LMDB records) shares the cores, a heavier one
    (JPEG decoding) gets whole cores of its own, since an OpenMP team that loses a core to a
    busy thread stalls at every barrier. With ``apply`` it is the ceiling of the per-net choice."""
    cores = usable_cores() if cores is None else cores
    reserve = 0 if data_busy < 0.25 else math.ceil(data_busy)
    n = max(1, cores - reserve)
    if apply:
        set_ceiling(n)
    return n


def plan_beside(layers, data_busy: float | None = None, what: str = "") -> int:
    """``plan`` for a run whose data comes from ``layers`` (its nets' layers; those with a
    prefetch thread count): ``data_busy`` as measured, else a core per image-decoding producer.
    An explicit ``OMP_NUM_THREADS`` wins."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    if data_busy is None:
        data_busy = float(sum(l.type in DECODING for l in layers
                              if getattr(l, "prefetcher", None) is not None))
    n = plan(data_busy)
    log.info("Using %d torch thread(s)%s", n, what)
    return n


def replan_after(solver, measure, iterations: int = 20) -> None:
    """Once ``iterations`` steps of ``solver`` have run, ``plan_beside`` again from
    ``measure(seconds)``: the cores its data threads really kept busy over those seconds (JPEG
    decoding needs a core, raw LMDB records do not). Behind the fast-path guard. The callback
    then removes itself: a callback keeps a run to one iteration per call (steps_per_call.py)."""
    start: dict = {}
    guard = FastPath("re-planning the threads", solver.net.name)

    def check(s=solver):
        if not start:
            start.update(iter=s.iter, t=time.perf_counter())
        elif s.iter - start["iter"] == iterations:
            guard.attempt(lambda: plan_beside(s.net.layer_list, measure(time.perf_counter() - start["t"])))
            s._callbacks[:] = [c for c in s._callbacks if c[0] is not check]

    solver.add_callback(on_start=check)


def largest_op_flops(net) -> int:
    """The most FLOPs one layer of ``net`` does in a forward pass."""
    out = 0
    for layer, bottoms, tops in zip(net.layer_list, net.bottom_lists, net.top_lists):
        try:
            f = layer.flops([net.shapes[b] for b in bottoms], [net.shapes[t] for t in tops])
        except Exception:      # a plugin's flops() that cannot say: assume real work
            f = TINY_FLOPS
        out = max(out, int(f))
    return out


def timed_training() -> bool:
    """Whether a Solver's thread count may follow timings (``BREWNET_THREADS=adaptive``)."""
    return os.environ.get("BREWNET_THREADS", "").strip() == ADAPTIVE


class Tuner:
    """Thread choice for one net's repeated calls: ``with tuner: run()`` around each call."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, net, name: str = "", timed: bool = True):
        self.name = name or getattr(net, "name", "")
        self.timed = timed                # False: the size rule's choice, kept (training)
        # a count the caller holds fixed while set (brewnet.many's worker threads share the
        # process-wide count: no net may switch it under the others)
        self.pinned: int | None = None
        self._net = weakref.ref(net)
        self.guard = FastPath("thread tuning", self.name)
        self._t0, self.off, self.tiny, self.calls, self.choice = None, True, False, 0, ceiling()
        self.guard.attempt(self._plan, net)      # a failure leaves the threads as they are

    def _plan(self, net) -> None:
        self._shapes = net._input_shapes          # re-planned when the net is reshaped
        self.off = net.device.type != "cpu"      # CUDA work: the host threads do not matter
        self.tiny = largest_op_flops(net) < TINY_FLOPS
        self.calls = 0
        self.choice = 1 if self.tiny else ceiling()
        if not self.timed and SPINNING and self.choice > 1 and user_threads() is None:
            self.choice = 1
            if not _warned:
                _warned.append(True)
                log.warning("torch was imported before brewnet, so OpenMP's threads spin while "
                            "they wait and a busy neighbour stalls every step: training runs on "
                            "one thread. Import brewnet first, or set OMP_WAIT_POLICY=PASSIVE "
                            "(or BREWNET_THREADS=N), to train on the cores.")
        self._trial: list | None = None  # seconds per call on the other choice, while one runs
        self._best_s = None               # median per call when the choice was made
        self._recent: list[float] = []    # the last BLOCK calls on the choice
        self._checked = 0.0
        self._wait = RECHECK_S            # seconds to the next re-check
        self._t0 = 0.0

    def __enter__(self):
        fixed = user_threads()               # the user's setting: a bad value is their error
        if self.guard.attempt(self._enter, fixed) is FAILED:
            self._t0 = None
        return self

    def _enter(self, fixed: int | None) -> None:
        net = self._net()
        if net is not None and net._input_shapes is not self._shapes:
            self._plan(net)
        if self.pinned is not None:
            self._t0 = None
            return
        if self.off or fixed is not None:
            if fixed is not None and torch.get_num_threads() != fixed:
                torch.set_num_threads(fixed)        # BREWNET_THREADS
            self._t0 = None
            return
        n = self._threads_now()
        if torch.get_num_threads() != n:
            apply(n)
        self._t0 = self.clock()

    def discard(self) -> None:
        """Leave the current call out of the timing (it did one-off work: a trace)."""
        self._t0 = None

    def restart(self) -> None:
        """Leave the current call out and time afresh from the next: the calls now run another
        path (lean inference's graph after the per-layer forwards), whose best count need not be
        the one chosen on the old path (MTCNN P-Net: one thread chosen on the per-layer calls
        kept its graph at 4.5 ms a call for the next 10 s, 2.8 ms on two)."""
        self.discard()
        net = self._net()
        if net is not None:
            self.guard.attempt(self._plan, net)

    def __exit__(self, *exc):
        if self._t0 is None or exc[0] is not None:
            return False
        self.guard.attempt(self._exit, self.clock() - self._t0)
        return False

    def _exit(self, dt: float) -> None:
        self.calls += 1
        if self.tiny or ceiling() == 1:
            self.choice = 1
            return
        if not self.timed or self.calls <= WARMUP:
            return
        if self._trial is not None:
            self._trial_call(dt)
            return
        self._recent = (self._recent + [dt])[-BLOCK:]
        if len(self._recent) < BLOCK:
            return
        due = self._best_s is None or time.monotonic() - self._checked > self._wait
        # Slower on one thread is the neighbour's load: a team would only stall more.
        slower = (self._best_s is not None and self.choice > 1
                  and statistics.median(self._recent[-3:]) > 1.5 * self._best_s)
        if due or slower:
            self._trial = []
        return

    def _trial_call(self, dt: float) -> None:
        """One call on the other choice: stop at a clearly slower call, else compare medians."""
        cur = statistics.median(self._recent)
        other = 1 if self.choice != 1 else ceiling()
        self._trial.append(dt)
        if dt > (3.0 if len(self._trial) == 1 else ABORT) * cur:
            self._wait = min(2 * self._wait, MAX_WAIT_S)   # the same again soon: back off
            self._decide(self.choice, cur)
        elif len(self._trial) >= TRIAL:
            med = statistics.median(self._trial)
            if med < cur:
                log.info("Net '%s': %d torch thread(s) (%.3g ms per call vs %.3g ms with %d)",
                         self.name, other, med * 1e3, cur * 1e3, self.choice)
                self._recent, self._wait = list(self._trial), RECHECK_S
                self._decide(other, med)
            else:
                self._decide(self.choice, cur)

    def _decide(self, choice: int, best: float) -> None:
        self.choice, self._best_s, self._trial = choice, best, None
        self._checked = time.monotonic()

    def _threads_now(self) -> int:
        """The count this call runs on: the trial's while one runs, else the choice."""
        if self._trial is None:
            return self.choice
        return 1 if self.choice != 1 else ceiling()
