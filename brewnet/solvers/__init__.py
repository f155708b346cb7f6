"""Solvers: Caffe's training loop and update rules (``SOLVERS["Adam"]``), lr policies
(``LR_POLICIES["multistep"]``) and snapshots; pycaffe's ``SGDSolver``... and ``get_solver``."""
from .base import SOLVERS, LossNotFiniteError, Solver, SolverError, load_solver_param
from .lr_policy import LR_POLICIES
from .sgd import SGDSolver
from .nesterov import NesterovSolver
from .adagrad import AdaGradSolver
from .rmsprop import RMSPropSolver
from .adadelta import AdaDeltaSolver
from .adam import AdamSolver


def get_solver(solver, **kw) -> Solver:
    """The solver of the type its file names (pycaffe's ``caffe.get_solver``)."""
    param, _ = load_solver_param(solver)
    try:
        cls = SOLVERS[param.type]
    except KeyError:
        raise SolverError(f"Unknown solver type '{param.type}'. Known: {', '.join(sorted(SOLVERS))}") from None
    return cls(solver, **kw)


__all__ = ["SOLVERS", "LR_POLICIES", "Solver", "SolverError", "LossNotFiniteError", "get_solver",
           "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
           "AdamSolver"]
