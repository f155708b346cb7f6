"""Faults a worker group meets, and how they are named: a worker that dies or hangs must make the
others stop within a bounded time, saying which rank was lost (Caffe's NCCL jobs hang instead).

Every worker beats a heartbeat into the rendezvous store (``brewnet/hb/<rank>``: wall time and
iteration) from a thread. A collective that fails (gloo sees the peer's socket close) or times
out (the group's ``timeout``) is turned into a ``WorkerLostError`` by ``Watch.guard``, after a
look at the heartbeats: a rank whose beat stopped is lost; when all beat, the one at the lowest
iteration is the one the others wait for (hung).
"""
from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

BEAT_S = 0.5          # heartbeat period
STALE_S = 2.5         # a beat older than this: that worker is gone (or stopped)


class WorkerLostError(ConnectionError):
    """Another worker died, hung or cannot be reached; the message names it."""


class RendezvousError(ConnectionError):
    """The workers did not all join within the timeout."""


class Watch:
    """Heartbeats of this worker and the diagnosis of the others'. ``store`` is a client of the
    rendezvous store of its own (a TCPStore is not shared between threads here)."""

    def __init__(self, store, rank: int, size: int, where: str):
        self.store, self.rank, self.size, self.where = store, rank, size, where
        self.iteration = 0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="brewnet-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"brewnet/hb/{self.rank}", f"{time.time():.3f} {self.iteration}")

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:      # the store is gone: the diagnosis will say so
                return

    def done(self) -> None:
        """This worker finished cleanly: others must not take its silence for a loss."""
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"brewnet/done/{self.rank}", "1")

    def beats(self) -> dict[int, tuple[float, int] | None]:
        """{rank: (age s, iteration)} of every other worker; None: never beat or finished."""
        out = {}
        now = time.time()
        for r in range(self.size):
            if r == self.rank:
                continue
            if self.store.check([f"brewnet/done/{r}"]):
                out[r] = None
                continue
            if not self.store.check([f"brewnet/hb/{r}"]):
                out[r] = (float("inf"), -1)
                continue
            t, it = self.store.get(f"brewnet/hb/{r}").decode().split()
            out[r] = (now - float(t), int(it))
        return out

    def diagnose(self, err: BaseException) -> str:
        """Which rank the failed collective ``err`` was lost to (waits up to STALE_S for a
        killed worker's last beat to go stale)."""
        deadline = time.monotonic() + STALE_S + BEAT_S
        try:
            self.store.set_timeout(timedelta(seconds=2))
            while True:
                beats = self.beats()
                lost = sorted(r for r, b in beats.items() if b is not None and b[0] > STALE_S)
                if lost or time.monotonic() > deadline:
                    break
                time.sleep(BEAT_S / 2)
        except Exception:
            return (f"worker rank {self.rank}: the rendezvous store at {self.where} cannot be "
                    "reached (the process hosting it, the launcher or rank 0, is gone)")
        cause = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        if lost:
            ages = ", ".join(f"rank {r} (last heartbeat {beats[r][0]:.1f} s ago)"
                             if beats[r][0] != float("inf") else f"rank {r} (never beat)"
                             for r in lost)
            return f"worker rank {self.rank}: lost {ages}; stopping ({cause})"
        alive = {r: b[1] for r, b in beats.items() if b is not None}
        if alive:
            low = min(alive.values())
            stuck = sorted(r for r, it in alive.items() if it == low)
            return (f"worker rank {self.rank} at iteration {self.iteration}: ranks {stuck} are alive "
                    f"but stuck at iteration {low}; stopping ({cause})")
        return f"worker rank {self.rank}: every other worker has finished; stopping ({cause})"

    @contextlib.contextmanager
    def guard(self, what: str):
        """Run a collective; its failure becomes a WorkerLostError naming the lost rank."""
        try:
            yield
        except WorkerLostError:
            raise
        except RuntimeError as e:    # DistError, or gloo's plain RuntimeError from a socket
            if not _is_comm_error(e):
                raise
            raise WorkerLostError(f"{self.diagnose(e)} [during {what}]") from None


_COMM_WORDS = ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "socket", "store")


def _is_comm_error(e: RuntimeError) -> bool:
    import torch.distributed as dist

    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in _COMM_WORDS)
