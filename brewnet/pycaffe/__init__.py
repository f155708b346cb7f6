"""pycaffe's surface on top of brewnet's core: ``Net`` with numpy forward/backward and name-keyed
views, the solvers whose nets are such Nets, ``Classifier``, ``Detector``, ``NetSpec`` (``layers``/``params``/
``to_proto``), ``io``, ``Timer`` and the process-wide mode. ``import brewnet as caffe`` re-exports
it all, and ``brewnet.io``, ``brewnet.draw`` ... are these modules under pycaffe's names.
"""
from . import _caffe, classifier, coord_map, detector, draw, io, net_spec  # noqa: F401
from ._caffe import layer_type_list
from .classifier import Classifier
from .detector import Detector
from .mode import init_log, log, set_device, set_mode_cpu, set_mode_gpu, set_random_seed
from .net import LayerView, Net
from .net_spec import NetSpec, layer_fn, params, to_proto
from .parallel import (NCCL, has_nccl, set_multiprocess, set_solver_count, set_solver_rank,
                       solver_count, solver_rank)
from .solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,
                     SGDSolver, get_solver)
from .timer import Timer

# pycaffe's module names, each the module of its one home here (``caffe.io`` is pycaffe/io.py).
MODULES = ("io", "draw", "coord_map", "net_spec", "classifier", "detector", "_caffe")


def _layer_namespace(name: str):
    """pycaffe's ``from caffe import layers as L``: ``L.Convolution(bottom, ...)`` is NetSpec's
    layer function for that type. Installed on ``brewnet.layers`` (the registry package) so the
    core package itself knows nothing of NetSpec."""
    if name[:1].isupper():
        return layer_fn(name)
    raise AttributeError(f"module 'brewnet.layers' has no attribute {name!r}")


def _install_layer_namespace() -> None:
    from .. import layers

    layers.__getattr__ = _layer_namespace     # PEP 562: consulted only for missing names


_install_layer_namespace()

__all__ = ["Net", "LayerView", "Classifier", "Detector", "coord_map", "draw", "NetSpec", "params",
           "to_proto", "io", "set_mode_cpu",
           "set_mode_gpu", "set_device", "set_random_seed", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver", "NCCL",
           "has_nccl", "set_solver_count", "set_solver_rank", "set_multiprocess", "solver_count",
           "solver_rank", "init_log", "log", "Timer", "layer_type_list"]
