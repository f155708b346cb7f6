"""Layers, one module per family; importing this package fills the registry ``LAYERS`` with the
computing layers. The database readers (Data, ImageData, HDF5Data, WindowData) register from
``brewnet.data.layers``, which builds on ``data.SourceLayer`` here (``brewnet.net`` imports both).
pycaffe adds NetSpec's ``L.Convolution(...)`` namespace to this package (brewnet.pycaffe).
Plugins subclass ``Layer`` here and register with ``register_layer`` (see registry.py)."""
from .base import Layer, LayerError  # noqa: F401
from .registry import (LAYERS, create_layer, layer_class, layer_types, load_plugins,  # noqa: F401
                       register, register_layer, unregister_layer)
from . import (common, crop, ctc, data, dense_block, detection, flow, loss, multibox,  # noqa: F401
               neuron, normalization, python, rcnn, recurrent, resample, shape, vision, yolo)
