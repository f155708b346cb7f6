"""Where each data layer of a training net stands, saved beside a snapshot's ``.solverstate``.

Caffe restarts its data from the first record on a resume, so a run resumed mid-epoch sees other
batches than the uninterrupted run. brewnet writes ``<state>.cursors.json`` next to the
``.solverstate`` (which stays exactly Caffe's): for every worker (rank), the layers' positions
(record offset and key, shuffle order, the transform RNG), as JSON. A resume restores them, so
an interrupted run continues with the batches it would have had.
"""
from __future__ import annotations

import json
import logging
import os

from ..proto.io import fsync_dir, fsync_path, temp_for

log = logging.getLogger("brewnet")
FORMAT = "brewnet data cursors 1"


def path_for(solverstate: str) -> str:
    return f"{solverstate}.cursors.json"


def capture(net) -> dict:
    """``{layer name: state}`` for the net's data layers that can say where they stand."""
    out = {}
    for layer in net.layer_list:
        state = layer.cursor_state() if hasattr(layer, "cursor_state") else None
        if state is not None:
            out[layer.name] = state
    return out


def apply(net, states: dict, where: str = "") -> None:
    """Put the net's data layers where ``states`` (one rank's, from ``capture``) says."""
    layers = {l.name: l for l in net.layer_list if hasattr(l, "restore_cursor")}
    for name, state in states.items():
        if name not in layers:
            log.warning("%s: data layer '%s' is not in net '%s'; its cursor is ignored",
                        where, name, net.name)
            continue
        layers[name].restore_cursor(state)


def write(path: str, iteration: int, ranks: list[dict]) -> None:
    """Atomically (temporary file, then rename), as the snapshot files."""
    text = json.dumps({"format": FORMAT, "iter": iteration, "ranks": ranks}, indent=1)
    fd, tmp = temp_for(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: str, iteration: int) -> list[dict] | None:
    """Every rank's cursors from ``path``, or None when there is no file: a snapshot Caffe or
    an older brewnet wrote, or a net without data layers."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
        ok = isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(doc.get("ranks"), list)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable data cursor file: {e}") from None
    if not ok:
        raise ValueError(f"{path}: not a data cursor file (expected format '{FORMAT}')")
    if doc.get("iter") != iteration:
        raise ValueError(f"{path}: written at iteration {doc.get('iter')}, but its solver state "
                         f"is at iteration {iteration}")
    return doc["ranks"]


def resume(net, solverstate: str, iteration: int, alone: bool) -> list[dict] | None:
    """Every rank's cursors saved beside ``solverstate``; a process training ``alone`` puts its
    data layers back where they were (several workers' cursors: each worker applies its own)."""
    log = logging.getLogger("brewnet")
    ranks = read(path_for(solverstate), iteration)
    if ranks is None and capture(net):
        log.info("%s has no data cursors beside it: the data restarts from the first record, "
                 "as Caffe's", solverstate)
    if ranks is not None and alone:
        if len(ranks) == 1:
            apply(net, ranks[0], solverstate)
        else:
            log.info("%s: data cursors of %d workers; one process alone restarts its data from "
                     "the first record", solverstate, len(ranks))
    return ranks
