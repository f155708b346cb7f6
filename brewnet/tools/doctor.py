"""``brewnet doctor NET.prototxt [WEIGHTS]``: before anything is built, every layer's type and
set fields, and whether brewnet runs them: a built-in, a plugin or a Python layer, or a type
brewnet does not know; a field no built-in layer reads; layers the weights file lacks.
Exit status 0 when brewnet runs everything it reports, 1 otherwise."""
from __future__ import annotations

import functools
import inspect
import re
import sys

COMMAND = "doctor"
HELP = "report every layer type and field of a model and whether brewnet runs it, before building"

# LayerParameter fields every layer may set: not a layer's own parameters.
_COMMON = {"name", "type", "bottom", "top", "phase", "loss_weight", "param", "blobs",
           "propagate_down", "include", "exclude"}


def add_arguments(p) -> None:
    p.add_argument("model", help="network .prototxt (or a .caffemodel, whose layers are read)")
    p.add_argument("weights", nargs="?", help=".caffemodel whose layers to check against the net's")


def run(args) -> int:
    from ..proto.io import read_net

    param = read_net(args.model)
    layers = list(param.layer)
    problems = 0
    rows = []
    for lp in layers:
        kind, why = _kind(lp.type)
        notes = [] if why is None else [why]
        notes += [f"{f}: no built-in {lp.type} layer reads it" for f in _unread(lp, kind)]
        notes += [f"{f}: parsed in the fork's schema, no built-in layer reads it" for f in _carried(lp)]
        problems += kind == "unknown"
        rows.append((lp.name, lp.type, kind, "; ".join(notes)))
    if args.weights:
        have = {lp.name: len(lp.blobs) for lp in read_net(args.weights, upgrade=True).layer if lp.blobs}
        wanted = {r[0] for r in rows}
        rows = [(n, t, k, "; ".join(x for x in (note, _weights_note(n, have)) if x)) for n, t, k, note in rows]
        extra = sorted(set(have) - wanted)
        if extra:
            rows.append(("(weights)", "", "", f"layers in {args.weights} the net does not have: "
                                              + ", ".join(extra[:10]) + (" ..." if len(extra) > 10 else "")))
    w = [max(len(str(r[i])) for r in rows + [("layer", "type", "runs as", "")]) for i in range(3)]
    print(f"{'layer':<{w[0]}}  {'type':<{w[1]}}  {'runs as':<{w[2]}}  notes")
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip())
    types = sorted({lp.type for lp in layers})
    unknown = sorted({lp.type for lp in layers if _kind(lp.type)[0] == "unknown"})
    print(f"{args.model}: {len(layers)} layers, {len(types)} types"
          + (f"; brewnet does not know {', '.join(unknown)}: write them with "
             "@brewnet.register_layer (docs/writing-a-layer.md) or as Python layers"
             if unknown else "; brewnet runs every type"), file=sys.stderr)
    return 1 if problems else 0


def _kind(type_name: str) -> tuple[str, str | None]:
    from ..layers.base import LayerError
    from ..layers.registry import layer_class

    try:
        cls = layer_class(type_name)
    except LayerError:
        return "unknown", "brewnet has no layer of this type"
    if type_name == "Python":
        return "python", None
    return ("built-in" if cls.__module__.startswith("brewnet.") else f"plugin {cls.__module__}"), None


def _weights_note(name: str, have: dict) -> str:
    return f"weights: {have[name]} blob{'s' * (have[name] != 1)}" if name in have else ""


def _unread(lp, kind: str) -> list[str]:
    """The ``*_param`` fields ``lp`` sets that its built-in class's code never names."""
    if kind != "built-in":
        return []
    from ..layers.registry import layer_class

    read = _names_read(layer_class(lp.type))
    if "*" in read:                 # no source to read: say nothing rather than guess
        return []
    return [fd.name for fd, _ in lp.ListFields()
            if fd.name not in _COMMON and fd.name.endswith("_param") and fd.name not in read]


@functools.lru_cache(maxsize=None)
def _names_read(cls) -> frozenset:
    """Every ``*_param`` name in the source of ``cls`` and its bases: the layers read their
    params in their own methods."""
    names = set()
    for k in inspect.getmro(cls):
        if k is object:
            continue
        try:
            names.update(re.findall(r"\b(\w+_param)\b", inspect.getsource(k)))
        except (OSError, TypeError):
            return frozenset({"*"})
    return frozenset(names)


def _carried(lp) -> list[str]:
    """The fields a fork's schema carried on ``lp`` that brewnet's schema does not declare."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    from ..proto import schema

    numbers = sorted({f.field_number - schema.SHIFT if f.field_number >= schema.SHIFT else f.field_number
                      for f in UnknownFieldSet(lp)})
    fork = schema.active()
    theirs = fork.fork_class(lp).DESCRIPTOR.fields_by_number if fork is not None else {}
    return [theirs[n].name if n in theirs else f"field #{n}" for n in numbers]
