"""Minerva's ``owl``, the calls its net scripts make, on brewnet (a surface like ``pycaffe``).

owl drove Caffe-format nets with a few tool classes (``owl.net.trainer``: ``NetTrainer``,
``NetTester``, ``MultiviewTester``, ``FeatureExtractor``, ``FilterVisualizer``,
``HeatmapVisualizer``) and its scripts (``scripts/learning/*.py``; here ``brewnet owl ...``), which
run unchanged through ``brewnet run`` (``owl`` -> ``brewnet.owl``). This module holds the device
calls they make: ``initialize``, ``create_cpu_device``, ``create_gpu_device``, ``set_device``,
``wait_for_all``, ``has_mpi`` (and ``has_cuda``, ``get_gpu_device_count``, ``from_numpy``).

A device is a ``torch.device``; ``set_device`` picks the one new nets are built on. Without CUDA
device ``i``, ``create_gpu_device(i)`` warns once and gives the CPU (as pycaffe's ``set_mode_gpu``).
``wait_for_all`` waits for queued CUDA work only. Why: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("brewnet")
_warned: set[int] = set()
_current: list[torch.device] = [torch.device("cpu")]


def initialize(argv=None) -> None:
    """Minerva's engine start (``owl.initialize(sys.argv)``); brewnet needs none: a no-op kept
    so scripts that call it run."""


def has_cuda() -> bool:
    """Whether torch sees a CUDA device."""
    return torch.cuda.is_available()


def get_gpu_device_count() -> int:
    """The number of CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_mpi() -> bool:
    """Minerva's MPI build flag: brewnet's several-process training is torch.distributed's, not
    Minerva's MPI; False."""
    return False


def create_cpu_device() -> torch.device:
    """The CPU device (owl's ``create_cpu_device``)."""
    return torch.device("cpu")


def create_gpu_device(which: int) -> torch.device:
    """CUDA device ``which``; the CPU (warned once per id) when this machine has no such device."""
    which = int(which)
    if 0 <= which < get_gpu_device_count():
        return torch.device("cuda", which)
    if which not in _warned:
        _warned.add(which)
        log.warning("owl.create_gpu_device(%d): no CUDA device %d here (%d visible); running on "
                    "the CPU", which, which, get_gpu_device_count())
    return torch.device("cpu")


def set_device(dev) -> None:
    """Build the nets that follow on ``dev`` (a device from ``create_*_device``)."""
    from ..execution import process

    dev = torch.device(dev)
    _current[0] = dev
    process.set_default_device(dev.type == "cuda", dev.index or 0)
    process.configure(dev)


def current_device() -> torch.device:
    """The device new nets are built on (the last ``set_device``; the CPU at first)."""
    return _current[0]


def from_numpy(arr):
    """An owl NArray of a numpy array in Caffe's (N, C, H, W) order (``unit.weight = ...``)."""
    from .net.net import from_numpy as make

    return make(arr)


def wait_for_all() -> None:
    """Minerva's barrier: here, wait for queued CUDA work (torch's CPU ops have finished)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


__all__ = ["initialize", "has_cuda", "has_mpi", "get_gpu_device_count", "create_cpu_device",
           "create_gpu_device", "set_device", "current_device", "wait_for_all", "from_numpy"]
