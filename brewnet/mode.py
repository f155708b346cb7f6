"""pycaffe's process-wide mode: where new Nets and Solvers put their tensors.

Read once when a Net is created (never inside layers). ``set_mode_gpu`` on a machine without
CUDA warns and keeps the CPU, so pycaffe scripts written for a GPU still run.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("brewnet")
_state = {"gpu": False, "device_id": 0}


def set_mode_cpu() -> None:
    _state["gpu"] = False


def set_mode_gpu() -> None:
    if not torch.cuda.is_available():
        log.warning("set_mode_gpu: CUDA is not available here; running on the CPU")
    _state["gpu"] = True


def set_device(device_id: int) -> None:
    _state["device_id"] = int(device_id)


def default_device() -> torch.device:
    if _state["gpu"] and torch.cuda.is_available():
        return torch.device("cuda", _state["device_id"])
    return torch.device("cpu")


def set_random_seed(seed: int) -> None:
    """Seed brewnet's random streams (fillers, dropout, shuffling), as ``caffe.set_random_seed``."""
    torch.manual_seed(int(seed))
