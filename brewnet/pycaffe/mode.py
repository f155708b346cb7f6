"""pycaffe's process-wide mode: ``set_mode_cpu``/``set_mode_gpu``/``set_device``/``set_random_seed``.

The device is read once when a Net or Solver is created (never inside layers). ``set_mode_gpu``
on a machine without CUDA warns and keeps the CPU, so pycaffe scripts written for a GPU still
run; on CUDA it applies brewnet's process-wide settings (``brewnet.execution.process.configure``).
"""
from __future__ import annotations

import logging

import torch

from ..execution import process
from ..execution.process import set_random_seed  # noqa: F401  (caffe.set_random_seed)

_log = logging.getLogger("brewnet")


def set_mode_cpu() -> None:
    """pycaffe's ``caffe.set_mode_cpu()``: new Nets and Solvers run on the CPU."""
    process.set_default_device(False)


def set_mode_gpu() -> None:
    """pycaffe's ``caffe.set_mode_gpu()``: new Nets and Solvers run on CUDA (the CPU, warned,
    without CUDA)."""
    if not torch.cuda.is_available():
        _log.warning("set_mode_gpu: CUDA is not available here; running on the CPU")
    process.set_default_device(True)
    process.configure()


def set_device(device_id: int) -> None:
    """pycaffe's ``caffe.set_device(id)``: the CUDA device GPU mode uses."""
    process.set_default_device(process._mode["gpu"], device_id)
    if process._mode["gpu"]:
        process.configure()


def init_log() -> None:
    """pycaffe's ``caffe.init_log()``: brewnet's log lines on stderr in glog's format."""
    from ..analysis.glog import setup_logging

    setup_logging()


def log(message: str) -> None:
    """pycaffe's ``caffe.log(msg)``: one INFO line."""
    _log.info("%s", message)
