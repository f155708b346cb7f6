"""pycaffe's ``caffe._caffe`` (the C++ extension's names), for code that reaches into it:
``from caffe._caffe import Net, Blob, Solver, Timer, layer_type_list, __version__`` ... Each
name is the object of its one home in brewnet; nothing is defined here."""
from .. import __version__  # noqa: F401
from ..blob import Blob  # noqa: F401
from ..layers import layer_types
from ..layers.python import Layer  # noqa: F401
from ..proto.caffe_pb2 import TEST, TRAIN  # noqa: F401
from ..solvers import Solver  # noqa: F401
from .mode import init_log, log, set_device, set_mode_cpu, set_mode_gpu, set_random_seed  # noqa: F401
from .net import Net  # noqa: F401
from .parallel import (  # noqa: F401
    NCCL,
    has_nccl,
    set_multiprocess,
    set_solver_count,
    set_solver_rank,
    solver_count,
    solver_rank,
)
from .solver import (  # noqa: F401
    AdaDeltaSolver,
    AdaGradSolver,
    AdamSolver,
    NesterovSolver,
    RMSPropSolver,
    SGDSolver,
    get_solver,
)
from .timer import Timer  # noqa: F401


def layer_type_list() -> list[str]:
    """Every registered layer type, installed plugins included (pycaffe's ``caffe.layer_type_list``)."""
    return layer_types()
