"""Process-wide settings, in one place: the default device, true float32 on CUDA, the CPU allocator.

Nothing here runs on import or inside a Net or a layer; the entry points call ``configure``:
pycaffe's ``set_mode_gpu``/``set_device``, a Solver when it is built, and each CLI command
(train, test, time). A program that uses the core ``Net`` directly on CUDA calls
``brewnet.execution.process.configure(device)`` itself to get Caffe's numbers.
- **Default device** (pycaffe's mode): where a Net goes when no device is given.
- **True float32 on CUDA**: ``configure`` with a CUDA device turns TF32 off (Caffe's IEEE float32).
- **Freed memory kept** (``keep_memory=True``, glibc only): large blocks come from the heap and
  freed memory stays there, as Caffe keeps its blobs; the process keeps its peak memory. Training
  and ``brewnet time`` ask for it; ``BREWNET_KEEP_MEMORY=0`` leaves the allocator alone.
Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

log = logging.getLogger("brewnet")

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4     # glibc's malloc.h
_done: list[bool] = []
_mode = {"gpu": False, "device_id": 0}


def set_default_device(gpu: bool, device_id: int | None = None) -> None:
    """pycaffe's mode: new Nets and Solvers go to CUDA device ``device_id`` when ``gpu``."""
    _mode["gpu"] = bool(gpu)
    if device_id is not None:
        _mode["device_id"] = int(device_id)


def default_device() -> torch.device:
    if _mode["gpu"] and torch.cuda.is_available():
        return torch.device("cuda", _mode["device_id"])
    return torch.device("cpu")


def set_random_seed(seed: int) -> None:
    """Seed brewnet's random streams (fillers, dropout, shuffling), as ``caffe.set_random_seed``."""
    torch.manual_seed(int(seed))


def configure(device=None, keep_memory: bool = False) -> None:
    """Apply the process-wide settings a run on ``device`` needs (see the module docstring)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    elif keep_memory:
        keep_freed_memory()


def env_switch(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """The value of switch ``name`` (its ``default`` when unset or empty); a value outside
    ``allowed`` is an error naming the variable, rather than silently taken for the default."""
    value = os.environ.get(name, "").strip() or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as described above (once per process); True when it is in effect."""
    if _done:
        return _done[0]
    ok = False
    if env_switch("BREWNET_KEEP_MEMORY", "1", ("0", "1")) == "1" and platform.libc_ver()[0] == "glibc":
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(M_MMAP_MAX, 0))
        except (OSError, AttributeError):
            ok = False
        log.debug("glibc malloc keeps freed memory for reuse: %s", ok)
    _done.append(ok)
    return ok
