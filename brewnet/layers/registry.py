"""The registry of layer classes keyed by Caffe's type strings (Caffe's ``LayerRegistry``)."""
from __future__ import annotations

from .base import Layer, LayerError

LAYERS: dict[str, type[Layer]] = {}


def register(type_name: str):
    """Class decorator: ``@register("Pooling")`` makes the class the layer for that Caffe type."""

    def wrap(cls):
        if type_name in LAYERS:
            raise ValueError(f"layer type {type_name!r} registered twice")
        cls.type = type_name
        LAYERS[type_name] = cls
        return cls

    return wrap


def layer_class(type_name: str, layer_name: str = "?") -> type[Layer]:
    try:
        return LAYERS[type_name]
    except KeyError:
        raise LayerError(
            f"Layer '{layer_name}': unknown layer type '{type_name}'. "
            f"Known types: {', '.join(sorted(LAYERS))}") from None
