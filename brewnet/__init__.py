"""brewnet: Caffe, reborn as a Python toolkit on PyTorch.

``import brewnet as caffe`` gives pycaffe's surface (``brewnet.pycaffe``, re-exported here):
``caffe.Net(prototxt, caffe.TEST, weights=...)``, ``caffe.SGDSolver(path)``,
``caffe.set_mode_gpu()``, ``caffe.io`` ... The core it sits on: ``brewnet.net.Net`` (torch
tensors, per-layer steps), ``brewnet.to_torch`` (a net as one torch.fx graph),
``brewnet.fully_convolutional`` (Caffe's net surgery), ``brewnet.video`` (a net over video frames
with keyframe feature reuse), ``brewnet.layers`` (``brewnet.layers.Layer``, the base of
built-in and plugin layers; ``@brewnet.register_layer``), ``brewnet.testing`` (Caffe's
GradientChecker), ``brewnet.solvers``, ``brewnet.data``.
"""
__version__ = "0.1.0"

import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

# Idle OpenMP threads spin briefly (GOMP_SPINCOUNT: the gap between two ops of one forward), then
# sleep instead of spinning on cores a neighbour needs (brewnet/execution/threads.py); libgomp
# reads both once, when torch loads it, so they are set before brewnet imports torch.
_spinning = "torch" in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ
if "torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# MKL's matrix products in one order whatever the thread count (brewnet/execution/determinism.py); MKL
# reads this at its first call, so it still takes effect when torch was imported first.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from . import _moved  # noqa: E402
_moved.install()                  # the old paths of moved modules, with a DeprecationWarning
from .execution import threads as _threads  # noqa: E402
_threads.SPINNING = _spinning     # torch came first: libgomp spins while its threads wait
from . import layers  # noqa: E402  (also NetSpec's L: layers.Convolution(...))
from .data import layers as _data_layers  # noqa: E402,F401  (registers Data, ImageData, HDF5Data...)
from .deploy import to_torch  # noqa: E402
from .convert import from_onnx, from_torch  # noqa: E402  (PyTorch / ONNX models to Caffe files)
from .execution.determinism import is_deterministic, set_deterministic  # noqa: E402
from . import video  # noqa: E402,F401  (brewnet.video.VideoNet)
from .deploy.surgery import fully_convolutional  # noqa: E402
from .layers import register_layer  # noqa: E402  (plugins: @brewnet.register_layer("Type"))
from .layers.python import Layer  # noqa: E402  (base class of Python layers)
from .many.merge import merge_indep_net_spec, merge_nets  # noqa: E402  (nideep's merge)
from .net import NetError  # noqa: E402
from .proto import caffe_pb2  # noqa: E402
from .proto.caffe_pb2 import TEST, TRAIN  # noqa: E402
from .proto.schema import use_proto  # noqa: E402  (a fork's caffe.proto for every file)
from . import pycaffe  # noqa: E402
from .pycaffe import coord_map, draw, classifier, detector, net_spec, _caffe  # noqa: E402,F401
from .pycaffe import (AdaDeltaSolver, AdaGradSolver, AdamSolver, Classifier, Detector,  # noqa: E402
                      NesterovSolver, Net, NetSpec, RMSPropSolver, SGDSolver, get_solver, io, params, set_device,
                      set_mode_cpu, set_mode_gpu, set_random_seed, to_proto)
from .pycaffe import (NCCL, has_nccl, set_multiprocess, set_solver_count, set_solver_rank,  # noqa: E402
                      solver_count, solver_rank)
from .pycaffe import Timer, init_log, layer_type_list, log  # noqa: E402

# pycaffe's modules importable under pycaffe's names, as the same objects (as os.path is
# posixpath): `import brewnet.io`, and through brewnet_alias `from caffe.coord_map import crop`.
for _name in pycaffe.MODULES:
    _sys.modules[f"{__name__}.{_name}"] = getattr(pycaffe, _name)

__all__ = ["Net", "NetError", "TRAIN", "TEST", "caffe_pb2", "io", "set_mode_cpu", "set_mode_gpu",
           "set_device", "set_random_seed", "layer_type_list", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver",
           "Layer", "register_layer", "use_proto", "Classifier", "Detector", "coord_map", "draw", "layers",
           "params", "NetSpec", "to_proto", "to_torch", "merge_indep_net_spec", "merge_nets",
           "from_torch", "from_onnx",
           "fully_convolutional", "set_deterministic", "is_deterministic", "__version__", "NCCL",
           "has_nccl", "set_solver_count", "set_solver_rank", "set_multiprocess", "solver_count",
           "solver_rank", "init_log", "log", "Timer", "classifier", "detector", "net_spec", "pycaffe"]
