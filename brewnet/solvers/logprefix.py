"""Per-solver log prefixes: several solvers sharing one process and one log (``brewnet.many``)
start each line they write with their own ``Solver.log_prefix`` (e.g. ``[s1] ``), after glog's
header, so ``brewnet parse-log --prefix "[s1]"`` picks one solver's lines back out. The prefix
is per thread: solvers stepping at once on ``TrainTogether``'s worker threads each log with
their own (a thread that set none, e.g. a prefetcher, logs without one)."""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

_logger = logging.getLogger("brewnet")


class _Prefix(logging.Filter):
    """Starts the message of each record logged through the ``brewnet`` logger with the
    logging thread's ``prefix`` (records are filtered in the thread that logs them)."""

    _local = threading.local()

    @property
    def prefix(self) -> str:
        return getattr(self._local, "prefix", "")

    @prefix.setter
    def prefix(self, value: str) -> None:
        self._local.prefix = value

    def filter(self, record: logging.LogRecord) -> bool:
        prefix = self.prefix
        if prefix and not getattr(record, "_prefixed", False):
            record.msg, record._prefixed = prefix + str(record.msg), True
        return True


_FILTER = _Prefix()
_logger.addFilter(_FILTER)


@contextlib.contextmanager
def log_prefix(prefix: str):
    """Lines this thread logs inside the block start with ``prefix`` (the previous comes back)."""
    old, _FILTER.prefix = _FILTER.prefix, prefix
    try:
        yield
    finally:
        _FILTER.prefix = old


def prefixed(method):
    """A Solver method whose log lines start with ``self.log_prefix``."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        if not self.log_prefix:
            return method(self, *args, **kw)
        with log_prefix(self.log_prefix):
            return method(self, *args, **kw)
    return run
