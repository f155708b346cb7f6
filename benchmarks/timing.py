"""Shared by the benchmark scripts: wall-clock samples of a call."""
from __future__ import annotations

import time


def timed(fn, n: int, warmup: int = 0) -> list[float]:
    """Seconds taken by each of ``n`` calls of ``fn`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out
