"""What stops a run: signal handlers acting like ``caffe train -sigint_effect/-sighup_effect``,
and the diagnosis of a non-finite loss (the first layer whose output went bad)."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading

import torch

log = logging.getLogger("brewnet")
EFFECTS = ("stop", "snapshot", "none")


class LossNotFiniteError(FloatingPointError):
    """Training produced a NaN or infinite loss; names the iteration and the first bad layer."""


@contextlib.contextmanager
def signal_effects(request, sigint: str | None, sighup: str | None):
    """While active, SIGINT/SIGHUP call ``request("stop" | "snapshot")`` or are ignored
    ("none"); None leaves a signal's handler alone. Handlers are restored on exit."""
    previous = []
    try:
        for name, effect in (("SIGINT", sigint), ("SIGHUP", sighup)):
            if effect is None or not hasattr(signal, name):
                continue
            if effect not in EFFECTS:
                raise ValueError(f"{name.lower()}_effect must be one of {', '.join(EFFECTS)}, got '{effect}'")
            if threading.current_thread() is not threading.main_thread():
                log.warning("signal handlers can only be installed from the main thread")
                continue
            sig = getattr(signal, name)
            handler = signal.SIG_IGN if effect == "none" else (lambda _s, _f, e=effect: request(e))
            previous.append((sig, signal.signal(sig, handler)))
        yield
    finally:
        for sig, old in previous:
            signal.signal(sig, old)


def nonfinite_origin(net) -> str:
    """Replay the forward pass layer by layer and name the first non-finite parameter or top."""
    for name in net.inputs:
        if not torch.isfinite(net.blobs[name].tensor).all():
            return f"input blob '{name}' is not finite"
    with torch.no_grad():
        for i, layer in enumerate(net.layer_list):
            if layer.type == "Input":
                continue
            for j, b in enumerate(layer.blobs):
                if not torch.isfinite(b).all():
                    return f"parameter {j} of layer '{layer.name}' (type {layer.type}) is not finite"
            net.forward_tensors(i, i)
            for top in net.top_lists[i]:
                t = net.blobs[top].tensor
                if t.is_floating_point() and not torch.isfinite(t).all():
                    return f"first non-finite top: '{top}' of layer '{layer.name}' (type {layer.type})"
    return "no layer output is non-finite on replay (loss weights or a random layer?)"
