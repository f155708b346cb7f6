"""Worker groups: who this process is, how the workers meet, and brewnet's own launcher.

One code path for every way of starting: a worker reads torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; any rendezvous, several nodes), and
``spawn`` (``brewnet train --workers N`` / ``--gpu 0,1``) starts N copies of the command with
that same environment. The rendezvous store lives outside the workers where it can (the
launcher's, or torchrun's agent: TORCHELASTIC_USE_AGENT_STORE), so a lost rank 0 does not take
the store with it. Backend: NCCL on CUDA, gloo on the CPU.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .faults import RendezvousError, Watch

log = logging.getLogger("brewnet")


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    addr: str
    port: int
    agent_store: bool      # the store is hosted outside the workers
    attempt: int = 0       # torchrun's restart count: each attempt rendezvous afresh

    @classmethod
    def from_env(cls, env=os.environ) -> "World | None":
        """This worker's place from torchrun's variables; None when they are not set."""
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", rank))
            port = int(env.get("MASTER_PORT", "29500"))
        except ValueError as e:
            raise ValueError(f"worker environment: {e} (RANK, WORLD_SIZE, LOCAL_RANK and "
                             "MASTER_PORT must be integers)") from None
        if not 0 <= rank < size:
            raise ValueError(f"worker environment: RANK {rank} is not in 0..WORLD_SIZE-1 ({size})")
        return cls(rank, size, local, env.get("MASTER_ADDR", "127.0.0.1"), port,
                   env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))

    @property
    def where(self) -> str:
        return f"{self.addr}:{self.port}"


def plan(workers: int | None, gpus: list[int]) -> tuple["World | None", int]:
    """(this process's World when it is a worker already, else None; how many workers to
    start here: 0 for none) for ``--workers`` and the ``--gpu`` ids."""
    if workers is not None and workers < 1:
        raise ValueError(f"--workers {workers}: give 1 or more worker processes")
    if workers is not None and gpus:
        raise ValueError("--workers starts CPU workers; for GPUs give their ids with --gpu (one "
                         "worker per device)")
    world = World.from_env()
    if world is not None:
        return world, 0
    n = workers or len(gpus)
    return None, n if n > 1 else 0


def _store(world: World, timeout: float, master: bool):
    return dist.TCPStore(world.addr, world.port, world.size, is_master=master,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


def join(world: World, device: torch.device, timeout: float):
    """Join the group (backend by device); returns the heartbeat ``Watch``. A rendezvous that
    does not complete within ``timeout`` s raises RendezvousError saying who came."""
    master = world.rank == 0 and not world.agent_store
    try:
        store = _store(world, timeout, master)
    except (RuntimeError, OSError) as e:
        raise RendezvousError(f"worker rank {world.rank}: cannot reach the rendezvous store at "
                              f"{world.where} within {timeout:g} s ({str(e).splitlines()[0]})") from None
    store = dist.PrefixStore(f"brewnet/attempt_{world.attempt}", store)
    store.set(f"brewnet/joined/{world.rank}", "1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                                timeout=timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
        dist.barrier()
    except RuntimeError as e:
        came = [r for r in range(world.size) if _check(store, f"brewnet/joined/{r}")]
        raise RendezvousError(
            f"worker rank {world.rank}: the rendezvous at {world.where} did not complete within "
            f"{timeout:g} s: {len(came)} of {world.size} workers joined (ranks {came}); start "
            f"the others, or check MASTER_ADDR/MASTER_PORT ({str(e).splitlines()[0][:160]})") from None
    log.info("Worker %d of %d joined at %s (%s)", world.rank, world.size, world.where, backend)
    beat_store = dist.PrefixStore(f"brewnet/attempt_{world.attempt}", _store(world, timeout, False))
    return Watch(beat_store, world.rank, world.size, world.where)


def _check(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:
        return False


def leave(watch: Watch | None) -> None:
    if watch is not None:
        watch.done()
    if dist.is_initialized():
        dist.destroy_process_group()


_HOSTED: list = []      # stores this process hosts for its workers (NCCL.new_uid)


def host_store(addr: str, port: int, timeout: float = 300.0) -> None:
    """Serve a rendezvous store from this process until it ends."""
    _HOSTED.append(dist.TCPStore(addr, port, None, is_master=True,
                                 timeout=timedelta(seconds=timeout), wait_for_workers=False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_worker(n: int) -> int:
    from ..data.prefetch import usable_cores

    return max(1, usable_cores() // n)


def spawn(argv: list[str], n: int, timeout: float, module: str = "brewnet.cli") -> int:
    """Run ``python -m brewnet.cli <argv>`` as ``n`` workers on this machine, the store hosted
    here; torch threads are split between them. When one fails the others are given
    ``timeout`` s (plus a margin) to notice and stop on their own, then terminated.
    Returns 0 when every worker succeeded, else 1."""
    port = free_port()
    world = World(0, n, 0, "127.0.0.1", port, True)
    store = _store(world, timeout, master=True)    # noqa: F841  (kept alive until the end)
    threads = threads_per_worker(n)
    log.info("Starting %d workers (%d torch thread(s) each), rendezvous at %s", n, threads, world.where)
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=world.addr, MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS=str(threads))
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the workers themselves
    try:
        return _watch(procs, timeout)
    finally:
        signal.signal(signal.SIGINT, old)


def _watch(procs, timeout: float) -> int:
    failed, deadline = False, None
    while True:
        codes = [p.poll() for p in procs]
        for r, c in enumerate(codes):
            if c not in (None, 0) and not failed:
                failed = True
                how = f"was killed by signal {-c}" if c < 0 else f"exited with status {c}"
                log.error("Worker rank %d (pid %d) %s", r, procs[r].pid, how)
                deadline = time.monotonic() + timeout + 15
        if all(c is not None for c in codes):
            return 1 if failed or any(codes) else 0
        if deadline is not None and time.monotonic() > deadline:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    log.error("Worker rank %d did not stop within %g s of the failure; terminating it",
                              r, timeout + 15)
                    p.kill()
            deadline = None
        time.sleep(0.1)
