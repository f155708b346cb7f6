"""pycaffe's solvers (``caffe.SGDSolver(path)``, ``caffe.get_solver(path)``): the core solvers
whose train and test nets are pycaffe Nets, so ``solver.net.forward()``, ``.params`` and
``.blobs[...].data`` work as in pycaffe."""
from __future__ import annotations

from .. import solvers as core
from .net import Net


def add_callback(self, on_start=None, on_gradients=None) -> None:
    """pycaffe's two forms: ``add_callback(on_start, on_gradients)`` with functions, or
    ``add_callback(nccl)`` with an object that has ``on_start`` and ``on_gradients_ready``."""
    if on_gradients is None and hasattr(on_start, "on_gradients_ready"):
        on_start, on_gradients = on_start.on_start, on_start.on_gradients_ready
    core.Solver.add_callback(self, on_start, on_gradients)


def _pycaffe(cls: type) -> type:
    return type(cls.__name__, (cls,), {"net_class": Net, "__module__": __name__,
                                       "add_callback": add_callback,
                                       "__doc__": cls.__doc__, "__qualname__": cls.__name__})


SGDSolver = _pycaffe(core.SGDSolver)
NesterovSolver = _pycaffe(core.NesterovSolver)
AdaGradSolver = _pycaffe(core.AdaGradSolver)
RMSPropSolver = _pycaffe(core.RMSPropSolver)
AdaDeltaSolver = _pycaffe(core.AdaDeltaSolver)
AdamSolver = _pycaffe(core.AdamSolver)
SOLVERS = {c.solver_type: c for c in (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
                                      AdaDeltaSolver, AdamSolver)}


def get_solver(solver, **kw) -> core.Solver:
    """The solver of the type its file names (pycaffe's ``caffe.get_solver``)."""
    return core.get_solver(solver, registry=SOLVERS, **kw)
