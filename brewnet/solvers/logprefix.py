"""Per-solver log prefixes: several solvers sharing one process and one log (``brewnet.many``)
start each line they write with their own ``Solver.log_prefix`` (e.g. ``[s1] ``), after glog's
header, so ``brewnet parse-log --prefix "[s1]"`` picks one solver's lines back out."""
from __future__ import annotations

import contextlib
import functools
import logging

_logger = logging.getLogger("brewnet")


class _Prefix(logging.Filter):
    """Starts the message of each record logged through the ``brewnet`` logger with ``prefix``."""

    prefix = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if self.prefix and not getattr(record, "_prefixed", False):
            record.msg, record._prefixed = self.prefix + str(record.msg), True
        return True


_FILTER = _Prefix()
_logger.addFilter(_FILTER)


@contextlib.contextmanager
def log_prefix(prefix: str):
    """Lines logged inside the block start with ``prefix`` (the previous prefix comes back)."""
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
