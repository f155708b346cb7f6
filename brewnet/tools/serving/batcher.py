"""Dynamic batching: a request waits at most ``max_delay`` for company, and only while other
admitted requests are still on their way (decoding, not yet queued), so a lone request runs at
once; then one forward of up to ``max_batch`` inputs.

Where the forward runs: a net whose largest batch takes under ``INLINE_S`` of CPU runs on the
event loop itself. Handing it to a thread costs two wake-ups, and the thread re-takes the GIL
after every op while the loop parses requests (waiting up to the interpreter's switch interval,
5 ms, each time: LeNet's forwards took 13 ms instead of under 1 ms under load, and the loop's
JPEG decodes waited as long for the GIL back). Larger nets, whose ops run for milliseconds
without the GIL, run on one worker thread, so the loop keeps accepting and decoding meanwhile
(torch uses its own threads inside one forward; two forwards at once would only fight over the
cores); the switch interval then drops to ``SWITCH_S`` so neither side waits long for the other.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger("brewnet")
INLINE_S = 0.02
SWITCH_S = 0.0005


class Overloaded(Exception):
    """The queue is full: the server answers 503."""


class Ticket:
    """One admitted request, counted until it is answered or given up (whichever comes first)."""
    __slots__ = ("live",)

    def __init__(self):
        self.live = True


class Batcher:
    def __init__(self, module, max_batch: int, max_delay_s: float, max_queue: int, metrics,
                 fixed_batch: int | None = None, inline: bool = False):
        self.module, self.max_batch, self.max_delay = module, max_batch, max_delay_s
        self.fixed_batch = fixed_batch     # a net whose batch is not dynamic: pad to it
        self.metrics, self.max_queue, self.inline = metrics, max_queue, inline
        self.pending: deque = deque()      # (input, future, ticket), oldest first
        self.wake: asyncio.Event | None = None     # made on the serving loop, by start()
        self.pool = None if inline else ThreadPoolExecutor(1, thread_name_prefix="brewnet-forward")
        self.task: asyncio.Task | None = None
        self.admitted = 0                  # live tickets: queued, decoding, or in a forward

    def start(self) -> None:
        if not self.inline:
            sys.setswitchinterval(SWITCH_S)     # the server's own process: see the docstring
        self.wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """After the server has drained its requests: end the loop and the worker thread."""
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        if self.pool:
            self.pool.shutdown(wait=True)

    def admit(self) -> Ticket:
        self.admitted += 1
        return Ticket()

    def release(self, ticket: Ticket) -> None:
        if ticket.live:
            ticket.live = False
            self.admitted -= 1

    async def submit(self, x: np.ndarray, ticket: Ticket) -> np.ndarray:
        """One preprocessed input (C, H, W) -> its output row; queued for the next batch."""
        if len(self.pending) >= self.max_queue:
            raise Overloaded(f"{self.max_queue} requests are already waiting")
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((x, fut, ticket))
        self.wake.set()
        return await fut

    async def _gather(self) -> list:
        """The next batch: wait for a first request, then for company while admitted requests
        are still decoding (admitted, not queued, not in a forward), up to ``max_delay``."""
        while not self.pending:
            self.wake.clear()
            await self.wake.wait()
        deadline = time.monotonic() + self.max_delay
        while len(self.pending) < self.max_batch and self.admitted > len(self.pending):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.wake.clear()
            try:
                async with asyncio.timeout(left):
                    await self.wake.wait()
            except TimeoutError:
                break
        items = []
        while self.pending and len(items) < self.max_batch:
            x, fut, ticket = self.pending.popleft()
            if not fut.done():         # not timed out while waiting
                items.append((x, fut, ticket))
        return items

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = await self._gather()
            if not items:
                continue
            xs = [x for x, _, _ in items]
            try:
                out, seconds = (self._forward(xs) if self.inline else
                                await loop.run_in_executor(self.pool, self._forward, xs))
            except Exception as e:  # noqa: BLE001  (each waiting request gets the error)
                log.exception("forward of a batch of %d failed", len(items))
                for _, f, t in items:
                    self.release(t)
                    if not f.done():
                        f.set_exception(e)
                continue
            self.metrics.batch(len(items), seconds)
            for (_, f, t), row in zip(items, out):
                self.release(t)
                if not f.done():
                    f.set_result(row)
            if self.inline:
                await asyncio.sleep(0)     # let the answered requests respond before the next batch

    def _forward(self, xs: list[np.ndarray]):
        n = len(xs)
        t0 = time.perf_counter()
        batch = np.stack(xs)
        if self.fixed_batch:
            pad = np.zeros((self.fixed_batch - n,) + batch.shape[1:], batch.dtype)
            batch = np.concatenate([batch, pad])
        with torch.inference_mode():
            y = self.module(torch.from_numpy(batch))
        y = y[0] if isinstance(y, tuple) else y
        return y.reshape(y.shape[0], -1)[:n].float().numpy(), time.perf_counter() - t0
