"""Batches prepared in a background thread into a bounded queue (producer/consumer).

The producer calls ``make_batch(buffers)`` and puts the result in a queue of ``depth`` batches
(Caffe's ``prefetch``, default 4); the consumer's ``get()`` blocks only when the queue is empty
and adds that time to ``wait_s``. The work a producer does is numpy/OpenCV, which release the
GIL. For CUDA the batch is written straight into pinned host memory, so the host-to-device copy
can be ``non_blocking``.

Cores: torch's OpenMP threads stall badly when another busy thread takes one of their cores
(a LeNet step went from 13 ms to 220 ms on a 2-core machine). ``data_busy`` measures what the
producers actually use over the first iterations; ``brewnet.execution.threads`` sizes torch's threads
from it.
"""
from __future__ import annotations

import atexit
import math
import queue
import threading
import time
from typing import Callable

from ..execution import threads
from ..execution.threads import usable_cores  # noqa: F401  (re-exported: the cores this process may use)

_STOP = object()

# Producer threads still running, with their stop events and queues. A daemon thread left
# running while the interpreter finalizes dies re-taking the GIL inside a torch op, which
# aborts the process ("terminate called without an active exception"): stop them all first.
_LIVE: dict = {}
_LIVE_LOCK = threading.RLock()   # re-entrant: a __del__ may run inside a locked block


def _stop_thread(t: threading.Thread, stop: threading.Event, q: queue.Queue,
                 deadline: float = math.inf) -> None:
    stop.set()
    if t is threading.current_thread():
        return
    while t.is_alive() and time.monotonic() < deadline:   # unblock a producer on a full queue
        try:
            q.get_nowait()
        except queue.Empty:
            pass
        t.join(0.05)
    with _LIVE_LOCK:
        _LIVE.pop(t, None)


@atexit.register
def stop_all(timeout: float = 60.0) -> None:
    """Stop and join every prefetch thread (run at interpreter exit). A producer stuck in a read
    (a hung network file system) is given up on after ``timeout`` s rather than hang the exit."""
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    deadline = time.monotonic() + timeout
    for t, (stop, q) in live:
        _stop_thread(t, stop, q, deadline)


def data_busy(nets, wall_s: float) -> float:
    """Cores the nets' prefetch threads kept busy over ``wall_s`` seconds of running them:
    the producers' busy time (``Prefetcher.produce_s``) / wall time."""
    busy = sum(l.prefetcher.produce_s for n in nets for l in n.layer_list
               if getattr(l, "prefetcher", None) is not None)
    return busy / wall_s if wall_s > 0 else 0.0


def plan_threads(data_busy: float = 1.0, apply: bool = True) -> int:
    """``brewnet.execution.threads.plan`` on this process's usable cores (the policy lives there)."""
    return threads.plan(data_busy, apply, cores=usable_cores())


class Prefetcher:
    """A background thread running ``make_batch()`` ahead of the consumer.

    ``make_batch`` returns a batch (any object; typically a list of tensors). Exceptions in the
    producer are re-raised by ``get()`` in the consumer. ``close()`` stops the thread; it is
    also stopped when the Prefetcher is garbage collected.
    """

    def __init__(self, make_batch: Callable[[], object], depth: int = 4, name: str = "prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.depth, self.name = depth, name
        self._make = make_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = _Stats()     # shared with the thread, which must not hold ``self``
        self.wait_s = 0.0          # consumer time spent blocked on an empty queue
        self.batches = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_run, args=(self._make, self._queue, self._stop, self._stats),
                                            name=f"brewnet-{self.name}", daemon=True)
            with _LIVE_LOCK:
                _LIVE[self._thread] = (self._stop, self._queue)
            self._thread.start()

    def get(self):
        """The next batch; blocks (and counts the wait) while none is ready."""
        if self._thread is None:
            self.start()
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        if isinstance(item, _Failure):
            self.close()
            raise item.exc.with_traceback(item.tb)
        return item

    @property
    def ready(self) -> int:
        """Batches made and waiting in the queue (at most ``depth``)."""
        return self._queue.qsize()

    @property
    def produce_s(self) -> float:
        """Producer time spent making batches."""
        return self._stats.produce_s

    def reset_stats(self) -> None:
        self.wait_s = self._stats.produce_s = 0.0
        self.batches = 0

    def close(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            _stop_thread(t, self._stop, self._queue)

    def __del__(self):
        # A dropped Net joins its threads rather than leaving them to run until exit.
        self.close()


class _Stats:
    produce_s = 0.0


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc, self.tb = exc, exc.__traceback__


def _run(make, q: queue.Queue, stop: threading.Event, stats: _Stats) -> None:
    try:
        _produce(make, q, stop, stats)
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(threading.current_thread(), None)


def _produce(make, q: queue.Queue, stop: threading.Event, stats: _Stats) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            item = make()
        except BaseException as e:     # hand it to the consumer, which re-raises it
            item = _Failure(e)
        stats.produce_s += time.perf_counter() - t0
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return
