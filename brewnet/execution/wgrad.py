"""A 2-D convolution's weight gradient with the same bits on any thread count, at oneDNN's speed.

Where oneDNN's own gradient changes its bits with the count (``determinism.onednn_invariant``),
the batch is cut into chunks that follow the shape only (``chunks``), each chunk's weight and
bias gradient computed on ONE thread by oneDNN (``choose``, logged; untimed: a timed choice could
differ between two processes under load), the chunks run in parallel on one-thread workers (as
many as the caller's threads) and added in chunk order. Elsewhere oneDNN on all threads stays;
deterministic mode stays pinned to the per-image path. One op,
``torch.ops.brewnet.conv2d_weight_grad``: a recorded step replays it whole.
``BREWNET_CONV_WGRAD`` (benchmarks): ``auto``; ``onednn``/``gemm`` (every shape in chunks by that
kernel, GEMM = im2col + one GEMM); ``old`` (oneDNN or per image). Why, and the measurements:
docs/internals.md, *Design notes by module*; ``benchmarks/conv_wgrad.py``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from . import determinism
from .recorded_step import as_param_grad

log = logging.getLogger("brewnet")
KERNELS = ("onednn", "gemm")
MAX_CHUNKS = 8          # fixed: the bits follow the chunks, the speed the workers
MIN_CHUNK_FLOPS = 2e6   # smaller chunks cost more in calls than the parallelism saves
# the machine's cores, not the affinity or the threads: ranks pinned to cores and every thread
# count of one machine cut alike; more chunks than cores only add calls (2 cores, LeNet conv1:
# 8 chunks 1.54 ms, 2 chunks 0.98; benchmarks/conv_wgrad.py)
CORES = os.cpu_count() or 1
_lock = threading.Lock()
_choice: dict[tuple, tuple[str, int]] = {}


def chunks(x_shape, w_shape, out_hw) -> int:
    """How many chunks the batch is cut into: a function of the shape and the machine's cores,
    never of the thread count."""
    n = x_shape[0]
    flops = 2.0 * n * w_shape[0] * w_shape[1] * w_shape[2] * w_shape[3] * out_hw[0] * out_hw[1]
    return max(1, min(n, MAX_CHUNKS, CORES, int(flops // MIN_CHUNK_FLOPS)))


def bounds(n: int, k: int) -> list[int]:
    """Chunk boundaries of a batch of ``n`` in ``k`` near-equal chunks (larger ones first)."""
    q, r = divmod(n, k)
    out = [0]
    for i in range(k):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def _onednn(dy, x, w, stride, pad, dilation, groups):
    _, gw, gb = determinism.onednn_backward(dy, x, w, stride, pad, dilation, groups,
                                            [False, True, True])
    return gw, gb


def _gemm(dy, x, w, stride, pad, dilation, groups):
    """im2col of the chunk and one matrix product per group over all its pixels."""
    n, c = x.shape[:2]
    o, g = w.shape[0], groups
    kk = tuple(w.shape[2:])
    cols = F.unfold(x, kk, tuple(dilation), tuple(pad), tuple(stride))     # n, c*kh*kw, L
    length = cols.shape[-1]
    ck = (c // g) * kk[0] * kk[1]
    # (group, rows, images x pixels): each image's pixels stay one contiguous run in the copy
    cols = cols.view(n, g, ck, length).permute(1, 2, 0, 3).reshape(g, ck, n * length)
    d = dy.reshape(n, g, o // g, length).permute(1, 2, 0, 3).reshape(g, o // g, n * length)
    return torch.bmm(d, cols.transpose(1, 2)).view(w.shape), dy.sum((0, 2, 3))


_KERNEL = {"onednn": _onednn, "gemm": _gemm}


def _omp_set_num_threads():
    for lib in (os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"), None):
        try:
            fn = ctypes.CDLL(lib).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn
    return None


_OMP_SET = _omp_set_num_threads()
_pools: dict[tuple[int, int], ThreadPoolExecutor | None] = {}


def _one_thread() -> None:
    """A worker's start: torch's own thread setup first (it would reset the count at its first
    parallel op), then OpenMP (oneDNN, ATen) and MKL on one thread in this thread only."""
    torch.get_num_threads()
    if _OMP_SET is not None:
        _OMP_SET(1)
    determinism.blas_on_one_thread()


def _pool(workers: int) -> ThreadPoolExecutor | None:
    """``workers`` one-thread workers (per process: a forked child starts its own), or None
    where a worker cannot be held to one thread (no OpenMP entry point found)."""
    key = (os.getpid(), workers)
    if key not in _pools:
        with _lock:
            if key not in _pools:
                pool = ThreadPoolExecutor(workers, "brewnet-wgrad", initializer=_one_thread)
                ok = _OMP_SET is not None and all(
                    f.result() == 1 for f in [pool.submit(torch.get_num_threads)
                                              for _ in range(workers)])
                if not ok:
                    pool.shutdown(wait=False)
                    pool = None
                    log.debug("convolution weight gradient: a worker thread could not be held "
                              "to one thread; chunks run one after another in the caller")
                _pools[key] = pool
    return _pools[key]


def _on_one_thread(fn, *args):
    """``fn(*args)`` on one thread: in the caller when it runs one, else on a worker."""
    if torch.get_num_threads() == 1:
        with determinism.blas_on_one_thread_here():
            return fn(*args)
    pool = _pool(1)
    if pool is not None:
        return pool.submit(fn, *args).result()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with determinism.blas_on_one_thread_here():
            return fn(*args)
    finally:
        torch.set_num_threads(n)
        determinism.blas_on_one_thread()


def _run(dy, x, w, stride, pad, dilation, groups, kernel: str, k: int):
    fn = _KERNEL[kernel]
    b = bounds(x.shape[0], k)
    parts = [(dy[b[i]:b[i + 1]], x[b[i]:b[i + 1]], w, stride, pad, dilation, groups)
             for i in range(k)]
    workers = min(k, torch.get_num_threads())
    pool = _pool(workers) if workers > 1 else None
    if pool is not None:
        res = list(pool.map(lambda a: fn(*a), parts))
    else:
        res = [_on_one_thread(fn, *a) for a in parts]
    gw, gb = res[0]             # fresh tensors of the first chunk's kernel: summed into
    for a, c in res[1:]:        # in chunk order, whoever finished first
        gw.add_(a)
        gb.add_(c)
    return as_param_grad(gw, w), gb   # the weight's layout, as autograd gives a param's grad


def _impl(dy, x, w, stride, pad, dilation, groups, kernel, k):
    with torch.no_grad():
        return _run(dy, x, w, stride, pad, dilation, groups, kernel, k)


_lib = torch.library.Library("brewnet", "FRAGMENT")
_lib.define("conv2d_weight_grad(Tensor dy, Tensor x, Tensor w, int[] stride, int[] pad, "
            "int[] dilation, int groups, str kernel, int chunks) -> (Tensor, Tensor)")
_lib.impl("conv2d_weight_grad", _impl, "CPU")


def _forced() -> str:
    from .process import env_switch

    return env_switch("BREWNET_CONV_WGRAD", "auto", ("auto", "old") + KERNELS)


def choose(x: torch.Tensor, w: torch.Tensor, stride, pad, dilation, groups) -> tuple[str, int]:
    """(path, chunks) for this shape and layout, decided once and logged: ``oneDNN`` (torch's own
    on the caller's threads) where its bits were the same on every count of
    ``determinism.counts()``, else ``chunks/onednn``; ``per-image`` in
    deterministic mode (pinned, untimed). Nothing here times two paths of other bits on the
    caller's count: that choice would follow the count (and a neighbour's load)."""
    cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    det = determinism.is_deterministic()
    forced = _forced()
    key = (tuple(x.shape), tuple(w.shape), tuple(stride), tuple(pad), tuple(dilation), groups, cl,
           det, forced)
    got = _choice.get(key)
    if got is not None:
        return got
    k = chunks(x.shape, w.shape, [(s + 2 * p - d * (kk - 1) - 1) // st + 1 for s, p, d, kk, st
                                  in zip(x.shape[2:], pad, dilation, w.shape[2:], stride)])
    if det:
        got, why = ("per-image", 1), "pinned: deterministic mode"
    elif forced in KERNELS:
        got, why = ("chunks/" + forced, k), "BREWNET_CONV_WGRAD"
    elif determinism.onednn_invariant(x, w, stride, pad, dilation, groups):
        got, why = ("oneDNN", 1), f"its bits the same on {determinism.counts()} threads"
    else:       # untimed: a timed choice could differ between two processes under load
        got, why = ("chunks/onednn", k), f"oneDNN's bits differ on {determinism.counts()} threads"
    with _lock:
        got = _choice.setdefault(key, got)
    log.info("convolution %s x %s (stride %s, pad %s, group %d): weight gradient by %s%s (%s)",
             tuple(x.shape), tuple(w.shape), tuple(stride), tuple(pad), groups, got[0],
             f" in {got[1]} chunks" if got[0].startswith("chunks") else "", why)
    return got


def weight_grad(dy, x, w, stride, pad, dilation, groups):
    """(weight gradient, bias gradient) of a CPU float32 2-D convolution: the same bits on any
    thread count (``choose``)."""
    if _forced() == "old":
        how = "oneDNN" if determinism.onednn_invariant(x, w, stride, pad, dilation,
                                                       groups) else "per-image"
    else:
        how, k = choose(x, w, stride, pad, dilation, groups)
    if how == "oneDNN":
        return _onednn(dy, x, w, stride, pad, dilation, groups)
    if how == "per-image":
        return determinism.per_image_wgrad(dy, x, w, stride, pad, dilation, groups, True)
    return torch.ops.brewnet.conv2d_weight_grad(dy, x, w, list(stride), list(pad),
                                                list(dilation), groups, how[len("chunks/"):], k)
