"""Data-parallel training on torch.distributed (NCCL on CUDA, gloo on the CPU): ``launch``
(who a worker is, the rendezvous, brewnet's launcher), ``sync`` (``Replicas``: sharded data,
broadcast, bucketed gradient allreduce overlapped with the backward pass), ``faults``
(heartbeats, the lost rank named). Caffe 1.0's multi-GPU semantics; see ``sync``."""
from .faults import RendezvousError, WorkerLostError
from .launch import World, join, leave, plan, spawn
from .sync import Replicas

__all__ = ["World", "join", "leave", "spawn", "plan", "Replicas", "WorkerLostError", "RendezvousError"]
