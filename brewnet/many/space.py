"""The space of ``brewnet search``: a YAML map from solver fields and per-layer net fields to what
to try, checked against the schema and the solver's own nets before anything trains.

    base_lr: {log_uniform: [1.0e-4, 1.0e-1]}   # a float, uniform in log space
    lr_policy: [step, inv]                      # one of a list
    conv1.num_output: {int: [8, 64, step 4]}    # an integer
    weight_decay: 0.0005                        # one value: every trial gets it

A key without a dot is a SolverParameter field; ``LAYER.FIELD`` a field of that layer's own
parameter message (``conv1.num_output`` is ``convolution_param.num_output``), in every net of the
solver that has the layer. Every error names the file and the key. ``Space.apply(params)`` gives a
trial's SolverParameter with its nets inline. All forms: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

from google.protobuf.descriptor import FieldDescriptor as FD

from ..proto import caffe_pb2 as pb
from ..proto.io import read_net, write_text
from ..proto.upgrade import upgrade_net
from ..solvers import SolverError, load_solver_param
from ..solvers.nets import resolve
from .sweep import _FLOATS, _INTS, SweepError, _value

KINDS = ("uniform", "log_uniform", "int", "log_int", "choice")


class SearchError(SolverError):
    """A search that cannot run as asked: a bad space file, objective or storage; the message
    names the file and key."""


@dataclass
class Dim:
    """One searched (or fixed) field: ``kind`` one of KINDS or "fixed"."""
    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    choices: list = field(default_factory=list)
    fd: object = None                       # the field's descriptor
    path: tuple = ()                        # for a net field: (layer name, message field or "", field)

    def suggest(self, trial):
        """This field's value for an Optuna trial (``ask``-and-tell)."""
        if self.kind in ("uniform", "log_uniform"):
            return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "log_uniform",
                                       step=self.step)
        if self.kind in ("int", "log_int"):
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1,
                                     log=self.kind == "log_int")
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, self.choices)
        return self.choices[0]

    def grid(self, where: str) -> list:
        """The values a grid search tries."""
        if self.kind in ("choice", "fixed"):
            return list(self.choices)
        if self.kind == "int":
            return list(range(self.low, self.high + 1, self.step or 1))
        if self.kind == "uniform" and self.step:
            n = int(round((self.high - self.low) / self.step))
            return [self.low + i * self.step for i in range(n + 1)]
        raise SearchError(f"{where}: {self.key}: --sampler grid needs a list of values or an int "
                          f"range (a {self.kind} range has no grid)")


def _number(x, where: str, key: str, integer: bool):
    """A YAML bound as a number (YAML 1.1 reads ``1e-4`` as text: parse it)."""
    try:
        v = float(x) if not isinstance(x, bool) else None
    except (TypeError, ValueError):
        v = None
    if v is None or (integer and v != int(v)):
        raise SearchError(f"{where}: {key}: bounds must be {'integers' if integer else 'numbers'}, got {x!r}")
    return int(v) if integer else v


def _range(spec: dict, key: str, where: str) -> Dim:
    kinds = [k for k in spec if k in KINDS]
    extra = [k for k in spec if k not in KINDS and k != "step"]
    if len(kinds) != 1 or extra:
        raise SearchError(f"{where}: {key}: expected one of {', '.join(KINDS)} (with an optional "
                          f"step), got {', '.join(map(str, spec)) or 'an empty map'}")
    kind = kinds[0]
    bounds = spec[kind]
    if kind == "choice":
        if not isinstance(bounds, list) or not bounds:
            raise SearchError(f"{where}: {key}: choice needs a non-empty list of values")
        return Dim(key, "choice", choices=list(bounds))
    if not isinstance(bounds, list):
        raise SearchError(f"{where}: {key}: {kind} needs [low, high], got {bounds!r}")
    step = spec.get("step")
    if len(bounds) == 3 and isinstance(bounds[2], str) and bounds[2].split()[:1] == ["step"]:
        step, bounds = bounds[2].split(None, 1)[1] if len(bounds[2].split()) == 2 else "", bounds[:2]
    if len(bounds) != 2:
        raise SearchError(f"{where}: {key}: {kind} needs [low, high] (and an optional 'step N'), "
                          f"got {bounds!r}")
    integer = kind in ("int", "log_int")
    low, high = (_number(b, where, key, integer) for b in bounds)
    if low > high:
        raise SearchError(f"{where}: {key}: empty range [{low}, {high}] (low > high)")
    if kind.startswith("log_") and low <= 0:
        raise SearchError(f"{where}: {key}: a log range needs low > 0, got {low}")
    if step is not None:
        if kind.startswith("log_"):
            raise SearchError(f"{where}: {key}: a log range takes no step")
        step = _number(step, where, key, integer)
        if step <= 0:
            raise SearchError(f"{where}: {key}: step must be > 0, got {step}")
        n = (high - low) / step
        if abs(n - round(n)) > 1e-9 * max(1.0, abs(n)):
            raise SearchError(f"{where}: {key}: the range [{low}, {high}] is not a whole number of "
                              f"steps of {step}")
    return Dim(key, kind, low, high, step)


def _dim(key: str, spec, where: str) -> Dim:
    if isinstance(spec, dict):
        return _range(spec, key, where)
    if isinstance(spec, list):
        if not spec:
            raise SearchError(f"{where}: {key}: an empty list of values")
        return Dim(key, "choice", choices=list(spec))
    if spec is None:
        raise SearchError(f"{where}: {key}: no value given")
    return Dim(key, "fixed", choices=[spec])


def _typed(fd, key: str, v, where: str):
    """A value from the space file as field ``fd`` takes it (``brewnet sweep --set``'s rules)."""
    try:
        return _value(fd, key, str(v).lower() if isinstance(v, bool) else str(v), where)
    except SweepError as e:
        raise SearchError(str(e)) from None


def _check_values(dim: Dim, where: str) -> None:
    """The dim's values against its field's type (``brewnet sweep --set``'s rules)."""
    fd, key = dim.fd, dim.key
    if fd.type == FD.TYPE_MESSAGE:
        raise SearchError(f"{where}: {key} is a message; search scalar fields only")
    if dim.kind in ("uniform", "log_uniform") and fd.type not in _FLOATS:
        raise SearchError(f"{where}: {key} takes {'an integer' if fd.type in _INTS else 'no number'}"
                          f"; a {dim.kind} range gives floats (use int: or a list)")
    if dim.kind in ("int", "log_int") and fd.type not in _INTS | _FLOATS:
        raise SearchError(f"{where}: {key} is not a number field; give a list of values")
    for v in dim.choices:
        _typed(fd, key, v, where)
    if key == "lr_policy" or key == "type":
        from ..solvers import SOLVERS
        from ..solvers.lr_policy import policy

        for v in dim.choices:
            if key == "type" and v not in SOLVERS:
                raise SearchError(f"{where}: type: unknown solver type '{v}'. Known: "
                                  f"{', '.join(sorted(SOLVERS))}")
            if key == "lr_policy":
                try:
                    policy(v)
                except ValueError as e:
                    raise SearchError(f"{where}: lr_policy: {e}") from None


def _inline(param, path) -> None:
    """Read the solver's net files into its message (net -> net_param, train_net ->
    train_net_param, test_net -> test_net_param): a trial edits and writes its own copy."""
    if param.HasField("net"):
        param.net_param.CopyFrom(read_net(resolve(param.net, path, "net")))
        param.ClearField("net")
    if param.HasField("train_net"):
        param.train_net_param.CopyFrom(read_net(resolve(param.train_net, path, "net")))
        param.ClearField("train_net")
    for name in param.test_net:
        param.test_net_param.add().CopyFrom(read_net(resolve(name, path, "test net")))
    del param.test_net[:]
    for f in ("net_param", "train_net_param"):
        if param.HasField(f):
            getattr(param, f).CopyFrom(upgrade_net(getattr(param, f)))
    for i, n in enumerate(param.test_net_param):
        param.test_net_param[i].CopyFrom(upgrade_net(n))


def inline_nets(param) -> list:
    """The nets a solver holds inline (train first, then tests), as NetParameter messages."""
    return [getattr(param, f) for f in ("net_param", "train_net_param") if param.HasField(f)] + \
        list(param.test_net_param)


def _own_message(lp) -> str:
    """The LayerParameter field holding this layer type's parameters (``convolution_param``)."""
    for fd in pb.LayerParameter.DESCRIPTOR.fields:
        if fd.message_type is not None and fd.message_type.name == f"{lp.type}Parameter":
            return fd.name
    return ""


def _net_field(param, key: str, where: str) -> tuple:
    """(layer, message field or "", field descriptor) for ``LAYER.FIELD`` / ``LAYER.MSG.FIELD``."""
    layers = {lp.name: lp for net in inline_nets(param) for lp in net.layer}
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        if name in layers:
            rest = parts[i:]
            break
    else:
        close = difflib.get_close_matches(parts[0], list(layers), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise SearchError(f"{where}: {key}: no layer '{parts[0]}' in the solver's nets{hint}")
    lp = layers[name]
    lfields = pb.LayerParameter.DESCRIPTOR.fields_by_name
    if len(rest) == 2 and rest[0] in lfields and lfields[rest[0]].message_type is not None:
        msgs = [rest[0]]
    elif len(rest) == 1:
        own = _own_message(lp)
        msgs = [own] if own else []
        msgs += [fd.name for fd, _ in lp.ListFields() if fd.type == FD.TYPE_MESSAGE and
                 not fd.is_repeated and fd.name not in msgs]
    else:
        raise SearchError(f"{where}: {key}: expected LAYER.FIELD or LAYER.MESSAGE.FIELD")
    found = [(m, lfields[m].message_type.fields_by_name[rest[-1]]) for m in msgs
             if rest[-1] in lfields[m].message_type.fields_by_name]
    if not found and len(rest) == 1 and rest[0] in lfields and lfields[rest[0]].message_type is None:
        found = [("", lfields[rest[0]])]           # a field of the layer itself
    if not found:
        names = [n for m in msgs for n in lfields[m].message_type.fields_by_name]
        close = difflib.get_close_matches(rest[-1], names, n=1, cutoff=0.6)
        hint = f"; did you mean '{name}.{close[0]}'?" if close else ""
        raise SearchError(f"{where}: {key}: layer '{name}' ({lp.type}) has no field '{rest[-1]}'"
                          f"{' in ' + ', '.join(msgs) if msgs else ''}{hint}")
    if len(found) > 1:
        raise SearchError(f"{where}: {key}: '{rest[-1]}' is in {' and '.join(m for m, _ in found)}; "
                          f"name one: {name}.{found[0][0]}.{rest[-1]}")
    msg, fd = found[0]
    if fd.is_repeated and fd.type == FD.TYPE_MESSAGE:
        raise SearchError(f"{where}: {key} is a repeated message; search scalar fields only")
    return name, msg, fd


class Space:
    """The dims of a space file over one solver; ``apply(values)`` makes a trial's solver."""

    def __init__(self, spec, solver, where: str = "space"):
        if not isinstance(spec, dict) or not spec:
            raise SearchError(f"{where}: expected a map of field: range (e.g. base_lr: "
                              "{log_uniform: [1.0e-4, 1.0e-1]}), got "
                              f"{type(spec).__name__ if spec else 'nothing'}")
        self.where = where
        self.base, self.path = load_solver_param(solver)
        self.base = pb.SolverParameter.FromString(self.base.SerializeToString())
        _inline(self.base, self.path)
        self.dims: list[Dim] = []
        sfields = pb.SolverParameter.DESCRIPTOR.fields_by_name
        for key, value in spec.items():
            key = str(key).strip()
            dim = _dim(key, value, where)
            if "." in key:
                dim.path = _net_field(self.base, key, where)
                dim.fd = dim.path[2]
            else:
                if key not in sfields:
                    close = difflib.get_close_matches(key, list(sfields), n=1, cutoff=0.6)
                    hint = f"; did you mean '{close[0]}'?" if close else ""
                    raise SearchError(f"{where}: {key}: not a SolverParameter field (net fields are "
                                      f"LAYER.FIELD){hint}")
                dim.fd = sfields[key]
                if key in ("net", "net_param", "train_net", "test_net", "snapshot_prefix"):
                    raise SearchError(f"{where}: {key}: the search sets this field itself")
            if dim.fd.is_repeated and dim.fd.type not in _FLOATS | _INTS:
                raise SearchError(f"{where}: {key}: a repeated field; search scalar fields only")
            _check_values(dim, where)
            self.dims.append(dim)
        if not any(d.kind != "fixed" for d in self.dims):
            raise SearchError(f"{where}: every field has one value; give at least one range or list")

    @classmethod
    def load(cls, path, solver) -> "Space":
        import yaml

        try:
            with open(path) as f:
                spec = yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark is not None else ""
            raise SearchError(f"{path}{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
        return cls(spec, solver, where=str(path))

    def searched(self) -> list[Dim]:
        return [d for d in self.dims if d.kind != "fixed"]

    def suggest(self, trial) -> dict:
        return {d.key: d.suggest(trial) for d in self.dims}

    def apply(self, values: dict) -> "pb.SolverParameter":
        """A copy of the solver with ``values`` (key -> value) set, its nets inline."""
        p = pb.SolverParameter.FromString(self.base.SerializeToString())
        for d in self.dims:
            v = values[d.key]
            typed = _typed(d.fd, d.key, v, self.where)
            if d.fd.type in _FLOATS and isinstance(v, (int, float)) and not isinstance(v, bool):
                typed = float(v)
            if not d.path:
                _set(p, d.fd, typed)
                continue
            layer, msg, _ = d.path
            for net in inline_nets(p):
                for lp in net.layer:
                    if lp.name == layer:
                        _set(getattr(lp, msg) if msg else lp, d.fd, typed)
        return p


def _set(message, fd, value) -> None:
    if fd.is_repeated:
        getattr(message, fd.name)[:] = [value]
    else:
        setattr(message, fd.name, value)


def write_prototxts(param, folder) -> str:
    """Write a trial's solver and its inline nets as files in ``folder`` (``solver.prototxt``
    naming ``net.prototxt`` or ``train_net.prototxt``/``test_net_K.prototxt``); the solver's path."""
    os.makedirs(folder, exist_ok=True)
    p = pb.SolverParameter.FromString(param.SerializeToString())
    if p.HasField("net_param"):
        write_text(os.path.join(folder, "net.prototxt"), p.net_param)
        p.ClearField("net_param")
        p.net = "net.prototxt"
    if p.HasField("train_net_param"):
        write_text(os.path.join(folder, "train_net.prototxt"), p.train_net_param)
        p.ClearField("train_net_param")
        p.train_net = "train_net.prototxt"
    for i, n in enumerate(p.test_net_param):
        write_text(os.path.join(folder, f"test_net_{i}.prototxt"), n)
        p.test_net.append(f"test_net_{i}.prototxt")
    del p.test_net_param[:]
    out = os.path.join(folder, "solver.prototxt")
    write_text(out, p)
    return out
