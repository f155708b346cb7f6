"""The registry of layer classes keyed by Caffe's type strings (Caffe's ``LayerRegistry``).

Built-in layers ``register`` as their modules are imported. Plugins (``brewnet.layers.Layer``
subclasses written outside brewnet) register with ``register_layer`` (``brewnet.register_layer``)
in user code, or come from an installed distribution's entry points, in its pyproject.toml::

    [project.entry-points."brewnet.layers"]
    L2Normalize = "my_layers:L2Normalize"   # a Layer subclass: registered under the entry's name
    my_layers = "my_layers"                 # or a module whose @register_layer classes register

Entry points load lazily, all of them, at the first unregistered type a prototxt names and whenever
every type is listed (``layer_types``, unknown-type errors): to override a built-in, import the plugin.
"""
from __future__ import annotations

import difflib
import types
import warnings
from importlib.metadata import entry_points

from google.protobuf import text_format

from ..proto import caffe_pb2 as pb
from .base import Layer, LayerError

ENTRY_POINT_GROUP = "brewnet.layers"
LAYERS: dict[str, type[Layer]] = {}
BUILTIN: dict[str, type[Layer]] = {}   # what brewnet ships (an override of one can be undone)
_loaded: set[tuple[str, str, str]] = set()   # (distribution, name, value) of imported entry points
_failed: dict[tuple[str, str, str], str] = {}  # the same key -> why its import failed


def register(type_name: str):
    """Class decorator for brewnet's own layers: ``@register("Pooling")``."""

    def wrap(cls):
        if type_name in LAYERS:
            raise ValueError(f"layer type {type_name!r} registered twice")
        cls.type = type_name
        LAYERS[type_name] = BUILTIN[type_name] = cls
        return cls

    return wrap


def _where(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_layer(type_name: str, *, override: bool = False):
    """Class decorator for plugin layers: ``@brewnet.register_layer("L2Normalize")`` on a
    ``brewnet.layers.Layer`` subclass makes ``type: "L2Normalize"`` name it in any prototxt.

    A built-in type is an error unless ``override=True`` (the plugin then replaces it in this
    process); a type another plugin registered is an error. The same class registered again (its
    module imported twice) replaces the first."""
    if not isinstance(type_name, str) or not type_name:
        raise TypeError(f"register_layer needs a non-empty type string, got {type_name!r}")

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, Layer)):
            raise TypeError(f"register_layer({type_name!r}): {cls!r} is not a subclass of "
                            "brewnet.layers.Layer (pycaffe-style brewnet.Layer classes are named "
                            'with type: "Python" and python_param)')
        old = LAYERS.get(type_name)
        if old is not None and _where(old) != _where(cls):
            if old is not BUILTIN.get(type_name):
                raise LayerError(f"layer type {type_name!r} is already registered by plugin "
                                 f"{_where(old)}; cannot register {_where(cls)} under it too")
            if not override:
                raise LayerError(f"layer type {type_name!r} is built into brewnet ({_where(old)}); "
                                 f"register_layer({type_name!r}, override=True) replaces it")
        cls.type = type_name
        LAYERS[type_name] = cls
        return cls

    return wrap


def unregister_layer(type_name: str) -> None:
    """Remove a plugin type (an overridden built-in comes back). Built-ins cannot be removed."""
    cls = LAYERS.get(type_name)
    if cls is None:
        raise LayerError(f"layer type {type_name!r} is not registered")
    if cls is BUILTIN.get(type_name):
        raise LayerError(f"layer type {type_name!r} is built into brewnet and cannot be removed")
    if type_name in BUILTIN:
        LAYERS[type_name] = BUILTIN[type_name]
    else:
        del LAYERS[type_name]


def load_plugins() -> list[str]:
    """Import the ``brewnet.layers`` entry points not imported yet; returns one message per
    entry point that failed (naming its distribution), retried on the next call."""
    seen = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        key = (dist, ep.name, ep.value)
        seen.add(key)
        if key in _loaded:
            continue
        try:
            obj = ep.load()
            if isinstance(obj, type) and issubclass(obj, Layer):
                if obj not in LAYERS.values():
                    register_layer(ep.name)(obj)
            elif not isinstance(obj, types.ModuleType):
                raise TypeError(f"{ep.value} is neither a brewnet.layers.Layer subclass nor a module")
        except Exception as e:  # a broken plugin must not hide which distribution it came from
            _failed[key] = (f"plugin distribution '{dist}' (entry point {ep.name} = {ep.value} in "
                            f"group {ENTRY_POINT_GROUP}) failed to import: {type(e).__name__}: {e}")
            continue
        _loaded.add(key)
        _failed.pop(key, None)
    for key in set(_failed) - seen:  # uninstalled since: no longer a reason for anything
        del _failed[key]
    return list(_failed.values())


def layer_types() -> list[str]:
    """Every known type, installed plugins included (each broken plugin warns)."""
    for msg in load_plugins():
        warnings.warn(msg, stacklevel=2)
    return sorted(LAYERS)


def layer_class(type_name: str, layer_name: str = "?") -> type[Layer]:
    """The class for a type; a type not registered yet loads the installed plugins first."""
    if type_name in LAYERS:
        return LAYERS[type_name]
    failures = load_plugins()
    if type_name in LAYERS:
        return LAYERS[type_name]
    own = [m for (_, name, _), m in _failed.items() if name == type_name]
    if own:
        raise LayerError(f"Layer '{layer_name}': type '{type_name}' comes from a {own[0]}")
    broken = "".join(f"\n  {m}" for m in failures)
    close = difflib.get_close_matches(type_name, list(LAYERS), n=2, cutoff=0.75)
    raise LayerError(
        f"Layer '{layer_name}': unknown layer type '{type_name}'"
        + (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else "")
        + f"; brewnet has no built-in layer of that type: write one with "
        f"@brewnet.register_layer({type_name!r}) (docs/writing-a-layer.md), or run it as a Python "
        f"layer (type: \"Python\" with python_param); brewnet.layer_type_list() lists the known types"
        + (f"\nPlugins that failed to import (one may define it):{broken}" if broken else ""))


def create_layer(param: "pb.LayerParameter | str", phase: int = pb.TEST) -> Layer:
    """Caffe's ``LayerRegistry::CreateLayer``: the layer for a LayerParameter, or for the text of
    a ``layer { ... }`` body; not set up yet (``layer.set_up(bottom_shapes)`` does that)."""
    if isinstance(param, str):
        param = text_format.Parse(param, pb.LayerParameter())
    return layer_class(param.type, param.name)(param, phase)
