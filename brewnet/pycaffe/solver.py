"""pycaffe's solvers (``caffe.SGDSolver(path)``, ``caffe.get_solver(path)``): the core solvers
whose train and test nets are pycaffe Nets, so ``solver.net.forward()``, ``.params`` and
``.blobs[...].data`` work as in pycaffe."""
from __future__ import annotations

from .. import solvers as core
from .net import Net


def _pycaffe(cls: type) -> type:
    return type(cls.__name__, (cls,), {"net_class": Net, "__module__": __name__,
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
