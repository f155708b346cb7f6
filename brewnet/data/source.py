"""The base of the prefetching data layers: a Loader makes host batches, a Prefetching layer
serves them from a background Prefetcher and moves them to the net's device and dtype.

When a layer's ``data_param.prefetch`` is set, it is the queue depth (0: load in the forward
pass). When it is unset, the layer loads its first batches in the forward pass and times them:
it starts a producer thread (Caffe's default depth, 4) only when loading a batch takes at least
``AUTO_MIN_S`` and at least ``AUTO_SHARE`` of the time between forwards. Either way the batches
are the same: the thread only runs the same loader ahead.
Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import time

import torch

from ..layers.base import LayerError
from ..layers.data import SourceLayer
from ..layers.origins import Origin
from ..layers.origins import note as note_origin
from .db import DBError
from .prefetch import Prefetcher
from .transform import TransformError

log = logging.getLogger("brewnet")
AUTO_BATCHES = 8       # batches timed (after the first, cold one) before the choice
AUTO_SHARE = 0.25      # of the time between forwards: a "light" producer (as plan_threads)
AUTO_MIN_S = 1e-3      # a batch's loading below this cannot pay for a thread's handoffs


class Loader:
    """Makes one host batch per call (``next_batch() -> list of float32 CPU tensors``).

    Batches go into fresh tensors from ``alloc``, pinned when the net is on CUDA: torch's
    pinned-memory cache then keeps a block until its non-blocking copy has finished.
    """

    pin = False

    def alloc(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, pin_memory=self.pin)

    def state(self) -> dict | None:
        """Where the loader stands (JSON-able: cursor, RNG), or None when it cannot say."""
        return None

    def set_state(self, state: dict) -> None:
        raise NotImplementedError

    def origin(self) -> Origin | None:
        """The records of the batch ``next_batch`` made last (None: the loader cannot say)."""
        return None

    def __call__(self) -> tuple[list[torch.Tensor], dict | None, Origin | None]:
        # The position after the batch and its records travel with it: the prefetcher runs
        # ahead, and a snapshot or a bad label must see the consumer's batch, not the producer's.
        return self.next_batch(), self.state(), self.origin()


class Prefetching(SourceLayer):
    """A data layer whose batches come from ``self.loader`` through a Prefetcher."""

    def start_loader(self, loader: Loader, param) -> None:
        """Serve ``loader``'s batches as ``param`` (a DataParameter) says: ``prefetch`` batches
        ahead in a thread, in the forward pass (0), or by the timing above (unset)."""
        self.loader, self.depth = loader, param.prefetch
        self.auto = not param.HasField("prefetch")
        self.prefetcher = None if self.auto or self.depth == 0 else \
            Prefetcher(loader, self.depth, name=self.name)
        self._timed = None         # (batches, their loading seconds, the first's end) while auto
        self.wait_s = 0.0          # seconds spent loading inside forward (no thread)
        self.consumed_state = loader.state()    # where the batches served so far leave it

    def reposition(self, change) -> None:
        """Apply ``change(loader)`` (a shard, a restored cursor) as if no batch had been read
        ahead: a running prefetcher is dropped with its queue and started afresh."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        change(self.loader)
        self.consumed_state = self.loader.state()
        if self.prefetcher is not None:
            self.prefetcher = Prefetcher(self.loader, self.depth, name=self.name)

    def cursor_state(self) -> dict | None:
        """Where the next batch the net sees will start (saved beside a .solverstate)."""
        return self.consumed_state

    def restore_cursor(self, state: dict) -> None:
        self.reposition(lambda loader: loader.set_state(state))

    def to(self, device=None, dtype=None):
        super().to(device, dtype)
        # Batches already queued stay unpinned; they copy correctly, only synchronously.
        self.loader.pin = self.device.type == "cuda"
        return self

    def forward(self, bottoms):
        try:
            if self.prefetcher is not None:
                batch, state, origin = self.prefetcher.get()
            else:
                t0 = time.perf_counter()
                batch, state, origin = self.loader()
                t1 = time.perf_counter()
                self.wait_s += t1 - t0
                if self.auto:
                    self._choose(t1 - t0, t1)
            self.consumed_state = state
        except (DBError, TransformError, OSError) as e:
            raise layer_error(self, e) from None
        tops = [t.to(device=self.device, dtype=self.dtype, non_blocking=True) for t in batch]
        note_origin(self, tops, origin)
        return tops

    def _choose(self, load_s: float, now: float) -> None:
        if self._timed is None:     # the first batch (cold caches, the open) starts the clock
            self._timed = (0, 0.0, now)
            return
        n, load, start = self._timed
        n, load = n + 1, load + load_s
        self._timed = (n, load, start)
        if n < AUTO_BATCHES:
            return
        self.auto = False
        per, share = load / n, load / max(now - start, 1e-9)
        if per >= AUTO_MIN_S and share >= AUTO_SHARE:
            log.info("Layer '%s': loading takes %.1f ms a batch, %.0f%% of the time between "
                     "forwards; prefetching %d batches in a thread", self.name, per * 1e3,
                     share * 100, self.depth)
            self.prefetcher = Prefetcher(self.loader, self.depth, name=self.name)
        else:
            log.debug("Layer '%s': loading in the forward pass (%.2f ms a batch, %.0f%% of the "
                      "time between forwards)", self.name, per * 1e3, share * 100)

    @property
    def data_wait_s(self) -> float:
        """Seconds the forward pass spent waiting for data."""
        return self.wait_s + (self.prefetcher.wait_s if self.prefetcher is not None else 0.0)

    def __del__(self):
        p = getattr(self, "prefetcher", None)
        if p is not None:
            p.close()


def layer_error(layer, e: BaseException) -> LayerError:
    """``e`` as an error naming ``layer``, once (a transformer's messages already do)."""
    msg = str(e)
    return LayerError(msg) if msg.startswith(f"Layer '{layer.name}' ") else layer.fail(msg)


def check_batch(layer, n: int) -> int:
    if n <= 0:
        raise layer.fail(f"batch_size must be positive, got {n}")
    return int(n)


