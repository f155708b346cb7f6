"""Layers, one module per family; importing this package fills the registry ``LAYERS``."""
from .base import LAYERS, Layer, LayerError, layer_class, register  # noqa: F401
from . import (common, data, detection, loss, multibox, neuron, normalization,  # noqa: F401
               python, recurrent, shape, vision)
from ..data import layers as _data_layers  # noqa: E402,F401  (Data, ImageData, HDF5*, WindowData)


def __getattr__(name: str):
    """pycaffe's ``from caffe import layers as L``: ``L.Convolution(bottom, ...)`` is NetSpec's
    layer function for that type (the layer classes themselves live in the family modules)."""
    if name[:1].isupper():
        from ..net_spec import layer_fn

        return layer_fn(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
