"""Solver state files: Caffe's binary ``.solverstate`` (a SolverState message) and the HDF5
``.solverstate.h5`` (datasets ``iter``, ``learned_net``, ``current_step``, group ``history/<i>``).

Both are written atomically (temporary file in the target directory, then rename), so a crash
while snapshotting never leaves a truncated file under the final name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..proto import caffe_pb2 as pb
from ..proto.errors import ProtoError
from ..proto.io import (
    array_to_blob,
    blob_to_array,
    fsync_dir,
    fsync_path,
    read_binary,
    temp_for,
    write_binary,
)

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


@dataclass
class SolverStateData:
    iter: int = 0
    current_step: int = 0
    learned_net: str = ""
    history: list = field(default_factory=list)    # float32 arrays, in Caffe's history order


def is_hdf5(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == HDF5_MAGIC


def write_solverstate(path, state: SolverStateData) -> None:
    msg = pb.SolverState(iter=state.iter, learned_net=state.learned_net,
                         current_step=state.current_step)
    msg.history.extend(array_to_blob(h) for h in state.history)
    write_binary(path, msg)


def write_solverstate_h5(path, state: SolverStateData) -> None:
    import h5py

    path = Path(path)
    fd, tmp = temp_for(path)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("iter", data=np.array([state.iter], dtype=np.int32))
            f.create_dataset("learned_net", data=np.bytes_(state.learned_net))
            f.create_dataset("current_step", data=np.array([state.current_step], dtype=np.int32))
            g = f.create_group("history")
            for i, h in enumerate(state.history):
                g.create_dataset(str(i), data=np.asarray(h, dtype=np.float32))
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_solverstate(path) -> SolverStateData:
    """Either format, chosen as Caffe's ``Solver::Restore`` does (by the ``.h5`` suffix), with
    the file's magic bytes as a check; an unreadable file raises ProtoError naming it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"solver state file not found: {path}")
    if path.endswith(".h5") or is_hdf5(path):
        return _read_h5(path)
    msg = read_binary(path, pb.SolverState())
    try:
        history = [blob_to_array(b) for b in msg.history]
    except ProtoError as e:
        raise ProtoError(f"{path}: {e}") from None
    return SolverStateData(msg.iter, msg.current_step, msg.learned_net, history)


def _read_h5(path: str) -> SolverStateData:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            missing = [k for k in ("iter", "history") if k not in f]
            if missing:
                raise ProtoError(f"{path}: not a solver state file (no {', '.join(missing)})")
            hist = f["history"]
            n = len(hist)
            if sorted(hist) != sorted(str(i) for i in range(n)):
                raise ProtoError(f"{path}: history datasets must be named 0..{n - 1}, got {sorted(hist)}")
            learned = f["learned_net"][()] if "learned_net" in f else b""
            return SolverStateData(
                int(np.asarray(f["iter"]).reshape(-1)[0]),
                int(np.asarray(f["current_step"]).reshape(-1)[0]) if "current_step" in f else 0,
                learned.decode() if isinstance(learned, bytes) else str(learned),
                [np.asarray(hist[str(i)], dtype=np.float32) for i in range(n)])
    except OSError as e:
        raise ProtoError(f"{path}: truncated or corrupt HDF5 solver state: {e}") from None


def latest(prefix: str) -> str:
    """The newest complete snapshot under ``prefix`` (``<prefix>_iter_N.solverstate[.h5]``, the
    largest N), or "" when there is none. The state file is written last and atomically, so
    one that exists is complete; one whose weights file is gone is passed over."""
    import re

    folder, base = os.path.split(prefix)
    pattern = re.compile(re.escape(base) + r"_iter_(\d+)\.solverstate(\.h5)?$")
    found = []
    for name in os.listdir(folder or "."):
        m = pattern.match(name)
        if m:
            model = name.replace(".solverstate", ".caffemodel")
            if os.path.exists(os.path.join(folder, model)):
                found.append((int(m.group(1)), os.path.join(folder, name)))
    return max(found)[1] if found else ""


def check_prefix(param) -> None:
    """Caffe's check at start: a solver that snapshots has a writable ``snapshot_prefix``."""
    from .nets import SolverError

    prefix = param.snapshot_prefix
    if not param.HasField("snapshot_prefix"):
        raise SolverError("In solver params, snapshot is specified but snapshot_prefix is not")
    folder = os.path.dirname(prefix) or "."
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise SolverError(f"Cannot write to snapshot prefix '{prefix}'. Make sure that the "
                          "directory exists and is writeable.")


def find_learned_net(name: str, state_path: str) -> str:
    """A solver state's ``learned_net``: as written, or beside the state file."""
    here = os.path.dirname(state_path)
    for cand in (name, os.path.join(here, name), os.path.join(here, os.path.basename(name))):
        if os.path.exists(cand):
            return cand
    raise FileNotFoundError(f"{state_path}: its learned_net '{name}' was not found (relative to "
                            f"the working directory or beside the solver state)")
