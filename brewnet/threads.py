"""Torch's intra-op threads: chosen per net from its per-op sizes, then kept honest by timing.

The policy, for a Solver's training net (``Solver``) and a pycaffe ``Net``'s forward:
- **Tiny ops: one thread.** When no layer of the net does more than ``TINY_FLOPS`` of work per
  pass, an OpenMP team only adds barriers (a logistic regression, an MLP, batch-1 LeNet).
- **Training: fixed.** A Solver's net keeps that first choice (one thread, or the ceiling) for
  the whole run: a thread count changes how reductions are split, so switching on timings would
  make a run's numbers depend on the machine's load (a resumed run, or K nets trained together,
  would no longer equal the uninterrupted or lone run bit for bit). Passive waiting (below) is
  what keeps a training team from collapsing under a busy neighbour. ``BREWNET_THREADS=adaptive``
  turns the timing on for training too, at the price of that reproducibility.
- **Inference: measured.** A forward-only net starts on the ceiling (the usable cores, or what the CLI
  planned beside its data threads); after a few calls it times a block of calls on the ceiling
  and a block on one thread and keeps the faster, and it re-times the other choice every
  ``RECHECK_S`` seconds, or at once when calls become 1.5x slower than when it chose. A busy
  neighbour process that takes a core makes the team stall at every barrier; the net then falls
  back to one thread and goes back when the core is free again.
- **Passive waiting.** ``import brewnet`` before torch sets ``OMP_WAIT_POLICY=PASSIVE``
  (``brewnet/__init__.py``) unless the variable is set at all (even empty): idle OpenMP threads
  then sleep instead of spinning on the cores a neighbour (or another brewnet process) needs.
  libgomp reads it once, when torch loads it, so a script that imports torch first keeps the
  spinning default: the timing above protects inference; **training then runs on one
  thread** (logged once), since a spinning team of two took 3-10x longer per LeNet step than
  one thread beside a busy neighbour (measured on 2 cores) and training's count cannot follow
  timings. Importing brewnet first, ``OMP_WAIT_POLICY=PASSIVE`` or ``BREWNET_THREADS=N`` give
  training the cores again.
- **Override.** ``BREWNET_THREADS=N`` fixes N threads and turns the timing off, as does
  ``OMP_NUM_THREADS`` or a ``torch.set_num_threads`` call by the user after brewnet was imported:
  brewnet never changes a thread count it did not set.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
import weakref

import torch

log = logging.getLogger("brewnet")
TINY_FLOPS = 4e6       # below this per layer and pass, threads cost more than they save
BLOCK = 5              # calls timed per choice
WARMUP = 3             # calls before the first timing (allocator, oneDNN primitive caches)
RECHECK_S = 10.0
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
        self._plan(net)

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
        self._trial: list = []            # [(threads, [seconds...])] blocks being compared
        self._best_s = None               # median per call when the choice was made
        self._recent: list[float] = []
        self._checked = 0.0
        self._t0 = 0.0

    def __enter__(self):
        net = self._net()
        if net is not None and net._input_shapes is not self._shapes:
            self._plan(net)
        if self.pinned is not None:
            self._t0 = None
            return self
        fixed = user_threads()
        if self.off or fixed is not None:
            if fixed is not None and torch.get_num_threads() != fixed:
                torch.set_num_threads(fixed)        # BREWNET_THREADS
            self._t0 = None
            return self
        n = self._trial[-1][0] if self._trial else self.choice
        if torch.get_num_threads() != n:
            apply(n)
        self._t0 = self.clock()
        return self

    def __exit__(self, *exc):
        if self._t0 is None or exc[0] is not None:
            return False
        dt = self.clock() - self._t0
        self.calls += 1
        if self.tiny or ceiling() == 1:
            self.choice = 1
            return False
        if not self.timed:
            return False
        if self._trial:
            self._trial[-1][1].append(dt)
            if len(self._trial[-1][1]) >= BLOCK:
                self._next_trial()
            return False
        self._recent = (self._recent + [dt])[-BLOCK:]
        due = self.calls == WARMUP or (self._checked and time.monotonic() - self._checked > RECHECK_S)
        slower = (self._best_s is not None and len(self._recent) == BLOCK
                  and statistics.median(self._recent) > 1.5 * self._best_s)
        if due or slower:
            self._trial = [(self.choice, [])]
        return False

    def _next_trial(self) -> None:
        if len(self._trial) == 1:        # now the other choice
            other = 1 if self._trial[0][0] != 1 else ceiling()
            self._trial.append((other, []))
            return
        (a, ta), (b, tb) = self._trial
        ma, mb = statistics.median(ta), statistics.median(tb)
        pick, best = (a, ma) if ma <= mb else (b, mb)
        if pick != self.choice:
            log.info("Net '%s': %d torch thread(s) (%.3g ms per call vs %.3g ms with %d)",
                     self.name, pick, best * 1e3, max(ma, mb) * 1e3, a if pick == b else b)
        self.choice, self._best_s = pick, best
        self._trial, self._recent = [], []
        self._checked = time.monotonic()
