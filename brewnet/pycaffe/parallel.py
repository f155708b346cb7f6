"""pycaffe's multi-GPU surface, as Caffe 1.0's ``python/train.py`` uses it, on brewnet.parallel:
``caffe.set_solver_count/set_solver_rank/set_multiprocess``, ``solver_count()/solver_rank()``,
``caffe.has_nccl()``, ``caffe.NCCL(solver, uid)``, ``caffe.NCCL.new_uid()``, ``nccl.bcast()``,
``solver.add_callback(nccl)`` and ``solver.net.after_backward(nccl)``.

Differs from Caffe: the uid names a rendezvous store (``NCCL.new_uid()`` starts one in the
calling process, which must outlive the workers, as train.py's parent does); on the CPU the
workers meet over gloo, so the same script trains with CPU processes.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..parallel import Replicas, World, join
from ..parallel.launch import free_port, host_store

_state = {"count": 1, "rank": 0, "multiprocess": False}
UID_PREFIX = "brewnet-rendezvous:"
TIMEOUT_S = 300.0


def set_solver_count(n: int) -> None:
    """pycaffe's ``caffe.set_solver_count``: the number of solvers (workers) training together."""
    if int(n) < 1:
        raise ValueError(f"set_solver_count: need at least 1 solver, got {n}")
    _state["count"] = int(n)


def set_solver_rank(r: int) -> None:
    """pycaffe's ``caffe.set_solver_rank``: this process's rank among the solvers."""
    _state["rank"] = int(r)


def set_multiprocess(on: bool) -> None:
    """Recorded for pycaffe's sake: brewnet's workers are always processes."""
    _state["multiprocess"] = bool(on)


def solver_count() -> int:
    """pycaffe's ``caffe.solver_count()``: the count set by ``set_solver_count`` (1 by default)."""
    return _state["count"]


def solver_rank() -> int:
    """pycaffe's ``caffe.solver_rank()``: the rank set by ``set_solver_rank`` (0 by default)."""
    return _state["rank"]


def has_nccl() -> bool:
    """True where torch has NCCL and a CUDA device to run it on."""
    return bool(torch.cuda.is_available() and dist.is_nccl_available())


class NCCL:
    """Joins solver ``solver`` (rank ``solver_rank()`` of ``solver_count()``) to the others that
    were given the same ``uid``; shards its training data. Then ``bcast()`` copies rank 0's
    params into it and, added with ``solver.add_callback(nccl)``, it sums the gradients."""

    def __init__(self, solver, uid):
        uid = uid.decode() if isinstance(uid, bytes) else str(uid)
        if not uid.startswith(UID_PREFIX):
            raise ValueError(f"NCCL: '{uid}' is not a uid from caffe.NCCL.new_uid()")
        addr, port = uid[len(UID_PREFIX):].rsplit(":", 1)
        rank, count = solver_rank(), solver_count()
        if not 0 <= rank < count:
            raise ValueError(f"NCCL: solver rank {rank} is not in 0..{count - 1} (set_solver_rank/"
                             "set_solver_count)")
        if rank:
            logging.getLogger("brewnet").setLevel(logging.WARNING)   # Caffe logs from rank 0
        world = World(rank, count, rank, addr, int(port), agent_store=True)
        self.watch = join(world, solver.net.device, TIMEOUT_S)
        self.solver = solver
        self.replicas = Replicas(solver, rank, count, self.watch, overlap=False)

    @staticmethod
    def new_uid() -> bytes:
        """A fresh rendezvous for one group of workers, hosted by this process."""
        port = free_port()
        host_store("127.0.0.1", port)
        return f"{UID_PREFIX}127.0.0.1:{port}".encode()

    def bcast(self) -> None:
        """Copy rank 0's params and solver state into this solver (Caffe's ``NCCL::Broadcast``)."""
        self.replicas.sync_from_root()

    def on_start(self) -> None:
        """Solver callback at the start of an iteration: expect a new round of gradients."""
        self.replicas.on_start()

    def on_gradients_ready(self) -> None:
        """Solver callback after the backward: sum the gradients over the workers (scaled 1/N)."""
        self.replicas.on_gradients()

    def reduce_during_backward(self, net) -> None:
        """``net.after_backward(nccl)`` (Caffe's layer_wise_reduce): the allreduce of each
        bucket of gradients starts as the backward pass finishes it."""
        if net is not self.solver.net:
            raise ValueError("after_backward: give the NCCL the net of its own solver")
        self.replicas.overlap()
