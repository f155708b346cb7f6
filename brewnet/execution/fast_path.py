"""One guard for every path brewnet switches to on its own: lean inference, the recorded
training step, CUDA graphs, the fused step's recording, thread re-tuning.

A switch is an optimisation, never a new way for a user's loop to fail. ``FastPath.attempt``
runs a step of building, checking or (where it has no side effect until it returns) running
the faster path; when that raises, it logs one warning naming the net, the layer and the
reason, turns the path off for that net for good, and returns ``FAILED``: the caller completes
the call on the eager path. A ``Declined`` path (a layer it cannot hold, by design) is logged
at info level instead. Errors in the user's own data are raised outside the guarded steps (the
input shapes, the label checks) or by the eager path that runs the call again, so they reach
the user as they always did.
"""
from __future__ import annotations

import logging
import traceback

from ..errors import NetError

log = logging.getLogger("brewnet")
FAILED = object()      # what ``attempt`` returns when the step raised


class Declined(NetError):
    """The fast path cannot hold this net by design (a layer that runs Python, NMS...): no fault."""


def failing_layer(exc: BaseException):
    """The innermost brewnet layer whose own code was running when ``exc`` was raised, or None
    (the tracer's own errors name their layer in the message)."""
    from ..layers.base import Layer

    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        cand = frame.f_locals.get("self")
        if isinstance(cand, Layer):
            found = cand
    return found


class FastPath:
    """The guard of one automatic switch of one net: ``what`` names the switch in the log."""

    def __init__(self, what: str, net_name):
        self.what, self._name = what, net_name   # a str, or a callable: the net's name now
        self.off: str | None = None          # why the path was turned off (None: still on)

    @property
    def net_name(self) -> str:
        return self._name() if callable(self._name) else self._name

    def attempt(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or ``FAILED`` when it raised (logged; the path is off)."""
        if self.off is not None:
            return FAILED
        try:
            return fn(*args, **kwargs)
        except Declined as e:
            self.off = str(e)
            log.info("Net '%s': %s stays off: %s", self.net_name, self.what, e)
        except Exception as e:      # noqa: BLE001 - anything: the eager path completes the call
            self.fail(e)
        return FAILED

    def fail(self, exc: BaseException | str) -> None:
        """Turn the path off with one warning naming the net, the layer and the reason."""
        if isinstance(exc, BaseException):
            layer = failing_layer(exc)
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            where = f" at layer '{layer.name}' (type {layer.type})" if layer is not None else ""
        else:
            reason, where = exc, ""
        self.off = f"{reason}{where}"
        log.warning("Net '%s': %s failed%s (%s); the net stays on the eager path",
                    self.net_name, self.what, where, reason[:300])
