"""brewnet: Caffe, reborn as a Python toolkit on PyTorch.

``import brewnet as caffe`` gives pycaffe's surface: ``caffe.Net(prototxt, caffe.TEST,
weights=...)``, ``caffe.SGDSolver(path)``, ``caffe.set_mode_gpu()``, ``caffe.io`` ...
"""
__version__ = "0.1.0"

from . import io  # noqa: E402  (pycaffe's caffe.io)
from . import layers  # noqa: E402  (also NetSpec's L: layers.Convolution(...))
from .layers import LAYERS as _LAYERS  # noqa: E402
from .layers.python import Layer  # noqa: E402  (base class of Python layers)
from .mode import set_device, set_mode_cpu, set_mode_gpu, set_random_seed  # noqa: E402
from .net import Net, NetError  # noqa: E402
from .classifier import Classifier  # noqa: E402
from .net_spec import NetSpec, params, to_proto  # noqa: E402
from .proto import caffe_pb2  # noqa: E402
from .proto.caffe_pb2 import TEST, TRAIN  # noqa: E402
from .solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,  # noqa: E402
                      RMSPropSolver, SGDSolver, get_solver)


def layer_type_list() -> list[str]:
    """Every registered layer type (pycaffe's ``caffe.layer_type_list``)."""
    return sorted(_LAYERS)


__all__ = ["Net", "NetError", "TRAIN", "TEST", "caffe_pb2", "io", "set_mode_cpu", "set_mode_gpu",
           "set_device", "set_random_seed", "layer_type_list", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver",
           "Layer", "Classifier", "layers", "params", "NetSpec", "to_proto", "__version__"]
