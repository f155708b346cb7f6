"""Caffe-format log lines: glog's ``I1130 13:14:15.123456  1234 solver.py:218] message``.

Caffe's tools (``parse_log.py``, ``extract_seconds.py``, ``plot_training_log.py``) read the
severity letter, month and day, wall time with microseconds, thread id (right-aligned in five
columns), ``file:line`` and ``] `` before the message; this formatter writes exactly that shape,
so their scripts and ``brewnet parse-log`` read brewnet's logs as they read Caffe's.

``setup_logging(level, stream)`` points the ``brewnet`` logger at ``stream`` (stderr by default,
as ``caffe`` with ``alsologtostderr``) and is what each CLI command calls first. Without an
explicit level, glog's ``GLOG_minloglevel`` (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL) is honoured, so
``GLOG_minloglevel=2 brewnet train ...`` is as quiet as it is with Caffe.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import threading

LOGGER = "brewnet"
_GLOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}


def severity_letter(levelno: int) -> str:
    """glog knows INFO, WARNING, ERROR and FATAL; Python's DEBUG is printed as INFO (glog's VLOG)."""
    if levelno >= logging.CRITICAL:
        return "F"
    if levelno >= logging.ERROR:
        return "E"
    if levelno >= logging.WARNING:
        return "W"
    return "I"


class GlogFormatter(logging.Formatter):
    """``<L><mmdd> <hh:mm:ss.uuuuuu> <tid:5> <file>:<line>] <message>`` in local time;
    ``strip``: a prefix taken off the message (one run's lines of a shared log, written to that
    run's own file as a plain single-solver log)."""

    def __init__(self, strip: str = ""):
        super().__init__()
        self.strip = strip

    def format(self, record: logging.LogRecord) -> str:
        t = datetime.datetime.fromtimestamp(record.created)
        # The emitting thread formats its own record, so the native id is that thread's.
        tid = threading.get_native_id()
        prefix = (f"{severity_letter(record.levelno)}{t:%m%d %H:%M:%S}.{t.microsecond:06d} "
                  f"{tid:5d} {record.filename}:{record.lineno}] ")
        message = record.getMessage()
        if self.strip and message.startswith(self.strip):
            message = message[len(self.strip):]
        text = prefix + message
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _GlogHandler(logging.StreamHandler):
    """The handler ``setup_logging`` installs; marked so a second call replaces it."""


def _level(level) -> int:
    if level is None:
        env = os.environ.get("GLOG_minloglevel", "")
        return _GLOG_LEVELS.get(int(env), logging.INFO) if env.strip().isdigit() else logging.INFO
    if isinstance(level, str):
        value = logging.getLevelName(level.upper())
        if not isinstance(value, int):
            raise ValueError(f"unknown log level '{level}'; known: DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return value
    return int(level)


def setup_logging(level=None, stream=None) -> logging.Logger:
    """Send the ``brewnet`` logger's records at ``level`` and above to ``stream`` (default
    ``sys.stderr`` at call time) in glog's format; returns the logger. Idempotent."""
    logger = logging.getLogger(LOGGER)
    for h in [h for h in logger.handlers if isinstance(h, _GlogHandler)]:
        logger.removeHandler(h)
    handler = _GlogHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(GlogFormatter())
    logger.addHandler(handler)
    logger.setLevel(_level(level))
    return logger
