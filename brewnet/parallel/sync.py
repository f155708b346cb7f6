"""Data-parallel replicas of one Solver (Caffe 1.0's ``NCCL`` solver callback, on torch.distributed).

As in Caffe 1.0, each worker runs the prototxt's batch on its own shard of the records; before the
update the param diffs are summed over the workers and scaled by 1/N (``ncclAllReduce`` then
``caffe_gpu_scal(1/solver_count)``), so every replica applies the same update: that of one process
on the N x batch_size records (the loss is a mean over the batch). Replicas start identical (rank
0's params broadcast). Clipping, iter_size normalisation and weight decay then run on the summed
diffs, as in Caffe, where ``on_gradients_ready`` precedes ``ApplyUpdate``. Overlap (Caffe's
``layer_wise_reduce``, DDP's buckets): params are grouped, in backward's order (last layer first),
into buckets of about ``bucket_mb``; a ``register_post_accumulate_grad_hook`` per param counts its
gradients and, once a bucket's params all have their last one (``iter_size`` backwards), starts its
async allreduce while backward goes on; the solver's ``on_gradients`` waits for them.
"""
from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from ..data import cursors
from .faults import Watch

log = logging.getLogger("brewnet")
REQUESTS = ("snapshot", "stop")


class Replicas:
    def __init__(self, solver, rank: int, size: int, watch: Watch | None = None,
                 overlap: bool = True, bucket_mb: float = 25.0):
        self.solver, self.rank, self.size, self.watch = solver, rank, size, watch
        solver.replicas = self
        for layer in solver.net.layer_list:          # each worker reads its own records
            if hasattr(layer, "shard"):
                layer.shard(rank, size)
        if rank != 0:                                # Caffe tests on the root solver alone
            solver.param.test_interval = 0
        self.params = list(solver.net.learnable)
        self.buckets = self._buckets(bucket_mb * 2**20)
        self._bucket_of = {id(t): b for b, ids in enumerate(self.buckets) for t in ids}
        self._hooks, self._pending, self._works = [], [], {}
        self._requests: list[str] = []
        if overlap:
            self.overlap()

    # -- layout --------------------------------------------------------------------------
    def _buckets(self, cap: float) -> list[list[torch.Tensor]]:
        out, cur, size = [], [], 0
        for t in reversed(self.params):              # the backward pass's order
            cur.append(t)
            size += t.numel() * t.element_size()
            if size >= cap:
                out.append(cur)
                cur, size = [], 0
        return out + ([cur] if cur else [])

    def overlap(self) -> None:
        """Start each bucket's allreduce as soon as the backward pass has filled it."""
        if self._hooks:
            return
        for t in self.params:
            if t.requires_grad:
                self._hooks.append(t.register_post_accumulate_grad_hook(self._grad_ready))

    # -- the iteration ---------------------------------------------------------------------
    def on_start(self) -> None:
        """A new iteration: every param expects ``iter_size`` gradients."""
        n = self.solver.param.iter_size
        self._pending = [{id(t): n for t in b if t.requires_grad} for b in self.buckets]
        self._works = {}

    def _grad_ready(self, t: torch.Tensor) -> None:
        if not self._pending:
            return                                   # a backward outside the solver's loop
        b = self._bucket_of[id(t)]
        left = self._pending[b]
        left[id(t)] -= 1
        if left[id(t)] == 0:
            del left[id(t)]
            if not left:
                self._launch(b)

    def _launch(self, b: int) -> None:
        grads = []
        for t in self.buckets[b]:
            if t.grad is None:                       # frozen or unused: a zero diff, as Caffe's
                t.grad = torch.zeros_like(t.detach())
            grads.append(t.grad.reshape(-1))
        flat = torch.cat(grads)
        self._works[b] = (flat, dist.all_reduce(flat, async_op=True))

    def on_gradients(self) -> None:
        """Wait for every bucket's sum, scale by 1/N and leave it in the param diffs; then agree
        on any stop/snapshot request, so all workers act on it at the same iteration."""
        with self.watch.guard(f"the gradient allreduce of iteration {self.solver.iter}") \
                if self.watch else _null():
            for b in range(len(self.buckets)):
                if b not in self._works:
                    self._launch(b)
            scale = 1.0 / self.size
            with torch.no_grad():
                for b, (flat, work) in sorted(self._works.items()):
                    work.wait()
                    flat.mul_(torch.tensor(scale, dtype=flat.dtype))
                    pos = 0
                    for t in self.buckets[b]:
                        n = t.numel()
                        t.grad.copy_(flat[pos:pos + n].view_as(t.grad))
                        pos += n
            self._works, self._pending = {}, []
            flags = torch.tensor([a in self._requests for a in REQUESTS], dtype=torch.int32,
                                 device=self._device())
            self._requests = []
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            for a, f in zip(REQUESTS, flags.tolist()):
                if f:
                    self.solver.request_action(a)
        if self.watch:
            self.watch.iteration = self.solver.iter + 1

    def request_action(self, action: str) -> None:
        """A signal's stop/snapshot: held until the workers agree at the next gradient sync."""
        self._requests.append(action)

    def _device(self):
        return self.params[0].device if self.params else torch.device("cpu")

    # -- state -----------------------------------------------------------------------------
    def sync_from_root(self) -> None:
        """Make every replica rank 0's: params, solver history, iteration and lr step, and give
        each worker its data cursors from rank 0's restored snapshot (only rank 0 needs the
        files: nodes need not share a disk)."""
        s = self.solver
        with self.watch.guard("the broadcast from rank 0") if self.watch else _null(), torch.no_grad():
            for group in (self.params, s.history):
                if group:
                    flat = torch.cat([t.detach().reshape(-1) for t in group])
                    dist.broadcast(flat, src=0)
                    parts = torch.split(flat, [t.numel() for t in group])
                    torch._foreach_copy_([t.detach() for t in group],
                                         [p.view_as(t) for p, t in zip(parts, group)])
            counters = torch.tensor([s.iter, s.current_step], dtype=torch.int64, device=self._device())
            dist.broadcast(counters, src=0)
            s.iter, s.current_step = (int(v) for v in counters.tolist())
            s._train_count = s.iter * s.param.iter_size
            ranks = self._broadcast_json(s.restored_cursors if self.rank == 0 else None)
        if ranks is not None:
            if len(ranks) == self.size:
                cursors.apply(s.net, ranks[self.rank], "restored snapshot")
            elif self.rank == 0:
                log.warning("The snapshot's data cursors are of %d workers, this run has %d: the "
                            "data restarts from the first record", len(ranks), self.size)

    def gather_cursors(self, mine: dict) -> list[dict] | None:
        """Every worker's data cursors, in rank order, on rank 0 (None on the others)."""
        data = json.dumps(mine).encode()
        with self.watch.guard("the snapshot's cursor gather") if self.watch else _null():
            dev = self._device()
            n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
            sizes = [torch.zeros_like(n) for _ in range(self.size)]
            dist.all_gather(sizes, n)
            top = int(max(int(x) for x in sizes))
            buf = torch.zeros(top, dtype=torch.uint8, device=dev)
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            bufs = [torch.zeros_like(buf) for _ in range(self.size)]
            dist.all_gather(bufs, buf)
        if self.rank != 0:
            return None
        return [json.loads(bytes(b[:int(k)].cpu().tolist()).decode()) for b, k in zip(bufs, sizes)]

    def _broadcast_json(self, obj):
        dev = self._device()
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        dist.broadcast(n, src=0)
        buf = torch.zeros(int(n), dtype=torch.uint8, device=dev)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        return json.loads(bytes(buf.cpu().tolist()).decode())

    def finish(self) -> None:
        """All workers reach the end together (rank 0 may still be snapshotting)."""
        with self.watch.guard("the final barrier") if self.watch else _null():
            dist.barrier()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.solver.replicas = None


def _null():
    import contextlib

    return contextlib.nullcontext()
