"""Dynamic batching: a request waits at most ``max_delay`` for company, and only while other
requests are on their way (admitted, still decoding: ``arriving``), so a lone request runs at
once; then one forward of up to ``max_batch`` inputs on a single worker thread (torch uses its own threads
inside one forward; two forwards at once would only fight over the cores)."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger("brewnet")


class Overloaded(Exception):
    """The queue is full: the server answers 503."""


class Batcher:
    def __init__(self, module, max_batch: int, max_delay_s: float, max_queue: int, metrics,
                 fixed_batch: int | None = None):
        self.module, self.max_batch, self.max_delay = module, max_batch, max_delay_s
        self.fixed_batch = fixed_batch     # a net whose batch is not dynamic: pad to it
        self.metrics = metrics
        self.queue: asyncio.Queue = asyncio.Queue(max_queue)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="brewnet-forward")
        self.task: asyncio.Task | None = None
        self.arriving = 0      # requests admitted by the app and not yet answered

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """After the server has drained its requests: end the loop and the worker thread."""
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.pool.shutdown(wait=True)

    async def submit(self, x: np.ndarray) -> np.ndarray:
        """One preprocessed input (C, H, W) -> its output row; queued for the next batch."""
        fut = asyncio.get_running_loop().create_future()
        try:
            self.queue.put_nowait((x, fut))
        except asyncio.QueueFull:
            raise Overloaded(f"{self.queue.maxsize} requests are already waiting") from None
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            deadline = time.monotonic() + self.max_delay
            while len(items) < self.max_batch and (self.queue.qsize() or self.arriving > len(items)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            items = [(x, f) for x, f in items if not f.done()]   # timed out while waiting
            if not items:
                continue
            try:
                out = await loop.run_in_executor(self.pool, self._forward, [x for x, _ in items])
            except Exception as e:  # noqa: BLE001  (each waiting request gets the error)
                log.exception("forward of a batch of %d failed", len(items))
                for _, f in items:
                    if not f.done():
                        f.set_exception(e)
                continue
            self.metrics.batch(len(items))
            for (_, f), row in zip(items, out):
                if not f.done():
                    f.set_result(row)

    def _forward(self, xs: list[np.ndarray]) -> np.ndarray:
        n = len(xs)
        batch = np.stack(xs)
        if self.fixed_batch:
            pad = np.zeros((self.fixed_batch - n,) + batch.shape[1:], batch.dtype)
            batch = np.concatenate([batch, pad])
        with torch.inference_mode():
            y = self.module(torch.from_numpy(batch))
        y = y[0] if isinstance(y, tuple) else y
        return y.reshape(y.shape[0], -1)[:n].float().numpy()
