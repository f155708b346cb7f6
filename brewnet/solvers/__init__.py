"""Solvers: Caffe's training loop and update rules (``SOLVERS["Adam"]``), lr policies
(``LR_POLICIES["multistep"]``) and snapshots (pycaffe's flavour: ``brewnet.pycaffe.solver``)."""
from .base import SOLVERS, LossNotFiniteError, Solver, SolverError, load_solver_param
from .lr_policy import LR_POLICIES
from .sgd import SGDSolver
from .nesterov import NesterovSolver
from .adagrad import AdaGradSolver
from .rmsprop import RMSPropSolver
from .adadelta import AdaDeltaSolver
from .adam import AdamSolver
from ..execution import cuda_graph  # noqa: F401  (registers CUDA graphs for nets on CUDA with recorded_step)


def get_solver(solver, registry=None, **kw) -> Solver:
    """The solver of the type its file names (Caffe's ``SolverRegistry``; ``registry`` is
    pycaffe's, whose solvers build pycaffe Nets)."""
    param, _ = load_solver_param(solver)
    registry = SOLVERS if registry is None else registry
    try:
        cls = registry[param.type]
    except KeyError:
        raise SolverError(f"Unknown solver type '{param.type}'. Known: {', '.join(sorted(registry))}") from None
    return cls(solver, **kw)


__all__ = ["SOLVERS", "LR_POLICIES", "Solver", "SolverError", "LossNotFiniteError", "get_solver",
           "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
           "AdamSolver"]
