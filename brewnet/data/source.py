"""The base of the prefetching data layers: a Loader makes host batches, a Prefetching layer
serves them from a background Prefetcher and moves them to the net's device and dtype."""
from __future__ import annotations

import time

import torch

from ..layers.base import LayerError
from ..layers.data import SourceLayer
from .db import DBError
from .prefetch import Prefetcher
from .transform import TransformError


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

    def __call__(self) -> tuple[list[torch.Tensor], dict | None]:
        # The position after the batch travels with it: the prefetcher runs ahead, and a
        # snapshot must record where the consumer stands, not the producer.
        return self.next_batch(), self.state()


class Prefetching(SourceLayer):
    """A data layer whose batches come from ``self.loader`` through a Prefetcher."""

    def start_loader(self, loader: Loader, depth: int) -> None:
        self.loader, self.depth = loader, depth
        self.prefetcher = Prefetcher(loader, depth, name=self.name) if depth > 0 else None
        self.wait_s = 0.0          # used when depth is 0 (loading inside forward)
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
                batch, state = self.prefetcher.get()
            else:
                t0 = time.perf_counter()
                batch, state = self.loader()
                self.wait_s += time.perf_counter() - t0
            self.consumed_state = state
        except (DBError, TransformError, OSError) as e:
            raise layer_error(self, e) from None
        return [t.to(device=self.device, dtype=self.dtype, non_blocking=True) for t in batch]

    @property
    def data_wait_s(self) -> float:
        """Seconds the forward pass spent waiting for data."""
        return self.prefetcher.wait_s if self.prefetcher is not None else self.wait_s

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


