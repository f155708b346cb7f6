"""pycaffe's ``caffe.Timer`` (Caffe's CPU Timer): ``start()``, ``stop()``, ``ms``.

As Caffe's: ``start`` on a running timer and ``stop`` on a stopped one do nothing; ``ms`` is the
last start-to-stop span (stopping a running timer first), 0 with a warning before any start.
python/train.py --timing starts and stops one per layer from the Net's hooks.
"""
from __future__ import annotations

import logging
import time

_log = logging.getLogger("brewnet")


class Timer:
    """A wall-clock span in milliseconds, started and stopped by hand."""

    def __init__(self):
        self._start = self._stop = None
        self._running = False

    def start(self) -> None:
        """Start timing (nothing when already running)."""
        if not self._running:
            self._start = time.perf_counter()
            self._running = True

    def stop(self) -> None:
        """Stop timing (nothing when not running)."""
        if self._running:
            self._stop = time.perf_counter()
            self._running = False

    @property
    def ms(self) -> float:
        """The last start-to-stop span in milliseconds (stops a running timer; 0 before any start)."""
        if self._start is None:
            _log.warning("Timer has never been run before reading time.")
            return 0.0
        self.stop()
        return (self._stop - self._start) * 1000.0

    @property
    def seconds(self) -> float:
        """``ms`` in seconds."""
        return self.ms / 1000.0
