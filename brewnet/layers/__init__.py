"""Layers, one module per family; importing this package fills the registry ``LAYERS``."""
from .base import LAYERS, Layer, LayerError, layer_class, register  # noqa: F401
from . import (common, data, detection, loss, multibox, neuron, normalization,  # noqa: F401
               recurrent, shape, vision)
from ..data import layers as _data_layers  # noqa: E402,F401  (Data, ImageData, HDF5*, WindowData)
