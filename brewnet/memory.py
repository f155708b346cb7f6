"""Let the C allocator keep large freed blocks, so CPU training reuses its memory.

glibc hands every block of 32 MB or more back to the kernel when it is freed (mmap/munmap) and
trims the top of its heap; the next training step then page-faults and zeroes the same
gradients and activations again. CaffeNet's fc6 weight gradient alone is 151 MB: fresh, its
matrix product takes ~100 ms instead of ~16 (benchmarks/train.py). Caffe keeps every blob
allocated for the whole run; this is the allocator-level equivalent: once per process, large
blocks come from the heap (M_MMAP_MAX 0) and freed memory stays there (M_TRIM_THRESHOLD at its
maximum), as in PyTorch's own advice to run CPU training under jemalloc or tcmalloc.
The process keeps its peak memory until it ends. ``BREWNET_KEEP_MEMORY=0`` leaves the allocator
alone; other C libraries (musl, macOS) are left alone too.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("brewnet")

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4     # glibc's malloc.h
_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as described above (once per process); True when it is in effect."""
    if _done:
        return _done[0]
    ok = False
    if os.environ.get("BREWNET_KEEP_MEMORY", "1") != "0" and platform.libc_ver()[0] == "glibc":
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(M_MMAP_MAX, 0))
        except (OSError, AttributeError):
            ok = False
        log.debug("glibc malloc keeps freed memory for reuse: %s", ok)
    _done.append(ok)
    return ok
