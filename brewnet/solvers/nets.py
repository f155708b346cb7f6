"""From a SolverParameter to nets: reading the solver file, finding net files, building the
train net and the test nets with their NetStates (Caffe's ``InitTrainNet``/``InitTestNets``),
the device, and sharing trained weights with test nets (``ShareTrainedLayersWith``)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..net import Net
from ..proto import caffe_pb2 as pb
from ..proto.io import parse_text, read_net, read_solver
from ..proto.upgrade import upgrade_net, upgrade_solver

log = logging.getLogger("brewnet")


class SolverError(ValueError):
    """A solver definition or state that cannot be used; the message names the file or field."""


def load_solver_param(source) -> tuple["pb.SolverParameter", Path | None]:
    """A SolverParameter from a path, prototxt text or a message; and the file it came from."""
    if isinstance(source, pb.SolverParameter):
        return upgrade_solver(source), None
    if isinstance(source, str) and ("{" in source or "\n" in source) and not os.path.exists(source):
        return upgrade_solver(parse_text(source, pb.SolverParameter())), None
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"solver file not found: {path}")
    param = read_solver(path)
    # Caffe's UpgradeSnapshotPrefixProperty: default to the solver file's name, and a
    # directory prefix gets the solver file's stem appended.
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = str(path.with_suffix(""))
    elif os.path.isdir(param.snapshot_prefix):
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, path.stem)
    return param, path


def resolve(name: str, solver_path: Path | None, what: str) -> Path:
    """Caffe opens paths relative to the working directory; failing that, look beside the
    solver file and in its parent folders (Caffe's examples name paths from the repo root)."""
    tried = [Path(name)]
    if solver_path is not None and not Path(name).is_absolute():
        tried += [d / name for d in [solver_path.parent, *solver_path.parent.parents]]
    for p in tried:
        if p.exists():
            return p
    where = f" (solver {solver_path})" if solver_path else ""
    raise FileNotFoundError(f"{what} file not found: '{name}'{where}; looked at "
                            f"{', '.join(str(p) for p in tried[:4])}{' ...' if len(tried) > 4 else ''}")


def pick_device(param, device=None) -> torch.device:
    """``device`` if given, else the file's solver_mode/device_id (GPU falls back to the CPU with
    a warning when CUDA is missing), else brewnet's mode (``set_mode_gpu``)."""
    if device is not None:
        return torch.device(device)
    if param.HasField("solver_mode"):
        if param.solver_mode == pb.SolverParameter.CPU:
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", param.device_id)
        log.warning("solver_mode GPU: CUDA is not available here; training on the CPU")
        return torch.device("cpu")
    from ..execution.process import default_device
    return default_device()


def _make_net(net_param, phase: int, override, device, net_class=Net) -> Net:
    # NetState precedence as Caffe: the phase, then the net's own state, then train/test_state.
    state = pb.NetState(phase=phase)
    state.MergeFrom(net_param.state)
    if override is not None:
        state.MergeFrom(override)
    net_param = pb.NetParameter.FromString(net_param.SerializeToString())
    net_param.state.CopyFrom(state)
    return net_class(net_param, state.phase, level=state.level, stages=list(state.stage), device=device)


def make_train_net(p, solver_path: Path | None, device, net_class=Net) -> Net:
    given = [f for f in ("net", "net_param", "train_net", "train_net_param") if p.HasField(f)]
    if len(given) != 1:
        raise SolverError("SolverParameter must specify exactly one train net using one of "
                          f"net, net_param, train_net, train_net_param; got {given or 'none'}")
    f = given[0]
    net_param = (read_net(resolve(getattr(p, f), solver_path, "net")) if f in ("net", "train_net")
                 else upgrade_net(getattr(p, f)))
    log.info("Creating training net from %s", f)
    return _make_net(net_param, pb.TRAIN, p.train_state if p.HasField("train_state") else None,
                     device, net_class)


def make_test_nets(p, solver_path: Path | None, device, net_class=Net) -> list[Net]:
    """test_net_param, then test_net files, then one copy of net/net_param per remaining
    test_iter entry."""
    read = lambda name: read_net(resolve(name, solver_path, "test net"))  # noqa: E731
    sources = [("test_net_param", upgrade_net(n)) for n in p.test_net_param]
    sources += [(f"test_net file: {n}", read(n)) for n in p.test_net]
    generic = p.HasField("net") or p.HasField("net_param")
    if len(p.test_iter) < len(sources) or (not generic and len(p.test_iter) != len(sources)):
        raise SolverError(f"test_iter must be specified for each test network: {len(sources)} "
                          f"test nets, {len(p.test_iter)} test_iter")
    for _ in range(len(p.test_iter) - len(sources)):
        sources.append((f"net file: {p.net}", read(p.net)) if p.HasField("net")
                       else ("net_param", upgrade_net(p.net_param)))
    if p.test_state and len(p.test_state) != len(sources):
        raise SolverError("test_state must be unspecified or specified once per test net")
    if sources and p.test_interval <= 0:
        raise SolverError(f"{len(sources)} test net(s) need test_interval > 0")
    nets = []
    for i, (src, net_param) in enumerate(sources):
        log.info("Creating test net (#%d) specified by %s", i, src)
        nets.append(_make_net(net_param, pb.TEST, p.test_state[i] if p.test_state else None,
                              device, net_class))
    return nets


def share_weights(train: Net, net: Net) -> None:
    """Make ``net``'s layers use ``train``'s parameter tensors, matched by layer name."""
    for layer in net.layer_list:
        src = train.layer_by_name.get(layer.name)
        if src is None or not layer.blobs:
            continue
        if len(src.blobs) != len(layer.blobs):
            raise SolverError(f"Layer '{layer.name}': {len(layer.blobs)} blobs in net "
                              f"'{net.name}' but {len(src.blobs)} in the train net")
        for j, (a, b) in enumerate(zip(src.blobs, layer.blobs)):
            if tuple(a.shape) != tuple(b.shape):
                raise SolverError(f"Layer '{layer.name}' blob {j}: shape {tuple(b.shape)} in net "
                                  f"'{net.name}' but {tuple(a.shape)} in the train net")
        layer.blobs = list(src.blobs)
