"""Kernels chosen per layer shape by measuring: once per (shape, CPU, library versions), shared.

Where a kernel of other bits wins on a shape: a training InnerProduct of ``DNN_MIN_WEIGHT``
weights or more (forward and both gradients), oneDNN's inner product (the fixed rule) or MKL on
torch's threads (``ip_mkl``). Candidates must keep their bits on 1, 2, 4 and
``determinism.counts()`` threads; they are timed on the real shape at solver set-up
(``prepare``, within ``MEASURE_S``), another kernel than the rule's kept only ``MARGIN`` faster.
The choice goes to ``kernels.json`` in the engine cache's folder (engine_cache.py: JSON, written
atomically) under a file lock, so two processes never take two winners and a choice never
depends on a noisy neighbour twice; a call reads the choice, never measures. Deterministic mode
and ``BREWNET_IP_KERNEL=onednn`` pin the rule; ``=mkl`` forces MKL (benchmarks). Other kernels
measured and not kept (convolution im2col + GEMM, NCHW oneDNN, pooling): docs/performance.md.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import statistics
import threading
import time

import torch

from . import determinism, engine_cache, threads

log = logging.getLogger("brewnet")
DNN_MIN_WEIGHT = 1 << 18   # smaller weights: BLAS on one thread is as fast and starts sooner
FORMAT = 1            # kernels.json's layout; another value is a stale file: rebuilt
KERNELS = ("onednn", "mkl")
RULE = "onednn"       # functional.inner_product's fixed rule for these shapes
MARGIN = 1.15         # fc7 measured 1.07x and 1.12x in two runs here: a near tie keeps the rule
MEASURE_S = 0.5       # per shape, the bit checks not counted
_lock = threading.Lock()
_chosen: dict[tuple, str] = {}
_unread: set[tuple] = set()     # asked at a call, not in the cache: the rule's until prepared


def _forced() -> str:
    from .process import env_switch

    return env_switch("BREWNET_IP_KERNEL", "auto", ("auto",) + KERNELS)


def key(m: int, k: int, n: int, transpose: bool) -> dict:
    return {"op": "inner_product", "shape": [m, k, n, bool(transpose)],
            "cpu": engine_cache.cpu_model(), "versions": engine_cache.versions()}


def _digest(k: dict) -> str:
    return hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:32]


def cache_path():
    return engine_cache.cache_dir() / "kernels.json"


def _read() -> dict:
    path = cache_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("kernel cache %s cannot be read (%s): measuring again", path, e)
        return {}
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), dict):
            raise ValueError("not a brewnet kernel cache")
    except ValueError as e:
        log.warning("kernel cache %s is corrupt (%s): it is rebuilt", path, str(e)[:200])
        return {}
    if data.get("format") != FORMAT:
        log.warning("kernel cache %s is stale (format %r, this brewnet writes %d): it is rebuilt",
                    path, data.get("format"), FORMAT)
        return {}
    return data["choices"]


def _entry(choices: dict, k: dict) -> str | None:
    e = choices.get(_digest(k))
    if not isinstance(e, dict) or e.get("key") != k:
        return None
    if e.get("kernel") not in KERNELS:
        log.warning("kernel cache %s: entry for %s names no known kernel (%r): it is rebuilt",
                    cache_path(), k["shape"], e.get("kernel"))
        return None
    return e["kernel"]


@contextlib.contextmanager
def _file_lock():
    """An exclusive lock on ``kernels.lock`` beside the cache (none where fcntl is missing or the
    folder cannot be written: the cache is an optimisation)."""
    path = cache_path().with_suffix(".lock")
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()


# -- the candidates ---------------------------------------------------------------------------
@functools.cache
def dnn_linear():
    """oneDNN's inner product (``mkldnn::_linear_pointwise``), or None where torch lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        op(torch.ones(2, 3), torch.ones(4, 3), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None
    return lambda x, w, b: op(x, w, b, "none", [], "")


class _DnnInnerProduct(torch.autograd.Function):
    """x (M, K), stored weight (N, K) or, with ``transpose``, (K, N), bias (N,) or None ->
    x W^T + b, with all three products (forward, input and weight gradients) as oneDNN inner
    products."""

    @staticmethod
    def forward(ctx, x, w, b, transpose):
        ctx.save_for_backward(x, w)
        ctx.transpose, ctx.has_bias = transpose, b is not None
        return dnn_linear()(x, w.t() if transpose else w, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        lin, dy = dnn_linear(), dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:       # dy W: the weight argument is W^T, i.e. the stored one
            dx = lin(dy, w if ctx.transpose else w.t(), None)
        if ctx.needs_input_grad[1]:       # dy^T x (N, K), or x^T dy (K, N) when transposed
            dyt, xt = dy.t().contiguous(), x.t().contiguous()
            dw = lin(xt, dyt, None) if ctx.transpose else lin(dyt, xt, None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None


def _mkl_forward(x, w, b, transpose: bool):
    wt = w if transpose else w.t()
    with determinism.blas_on_torch_threads():
        return x @ wt if b is None else torch.addmm(b, x, wt)


def _mkl_backward(dy, x, w, transpose: bool, need_x: bool, need_w: bool):
    with determinism.blas_on_torch_threads():
        dx = (dy @ (w.t() if transpose else w)) if need_x else dy.new_empty(0)
        dw = ((x.t() @ dy) if transpose else (dy.t() @ x)) if need_w else dy.new_empty(0)
    return dx, dw


# ops, so a recorded step replays them whole (MKL's thread count is no aten op)
_lib = torch.library.Library("brewnet", "FRAGMENT")
_lib.define("ip_mkl(Tensor x, Tensor w, Tensor? b, bool transpose) -> Tensor")
_lib.define("ip_mkl_backward(Tensor dy, Tensor x, Tensor w, bool transpose, bool need_x, "
            "bool need_w) -> (Tensor, Tensor)")
_lib.impl("ip_mkl", _mkl_forward, "CPU")
_lib.impl("ip_mkl_backward", _mkl_backward, "CPU")


class MklInnerProduct(torch.autograd.Function):
    """x (M, K) W^T + b with the stored weight (N, K), or (K, N) with ``transpose``: the
    forward and both gradients as MKL products on torch's threads."""

    @staticmethod
    def forward(ctx, x, w, b, transpose):
        ctx.save_for_backward(x, w)
        ctx.transpose, ctx.has_bias = transpose, b is not None
        return torch.ops.brewnet.ip_mkl(x, w, b, transpose)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = torch.ops.brewnet.ip_mkl_backward(dy.contiguous(), x, w, ctx.transpose,
                                                   need_x, need_w)
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx if need_x else None, dw if need_w else None, db, None


APPLY = {"onednn": _DnnInnerProduct.apply, "mkl": MklInnerProduct.apply}


def _candidate(kernel: str, m: int, k: int, n: int, transpose: bool):
    """A function running ``kernel``'s forward and both gradients on random data of the shape."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = (torch.randn(k, n, generator=gen) if transpose else torch.randn(n, k, generator=gen))
    w = (w * 0.1).requires_grad_()
    b = torch.randn(n, generator=gen, requires_grad=True)
    dy = torch.randn(m, n, generator=gen)
    fn = APPLY[kernel]

    def run():
        with torch.enable_grad():
            y = fn(x, w, b, transpose)
            return (y.detach(), *torch.autograd.grad(y, (x, w, b), dy))
    return run


def _same_bits(run) -> bool:
    before, ref = torch.get_num_threads(), None
    try:
        for c in sorted({1, 2, 4, *determinism.counts()}):
            torch.set_num_threads(c)
            determinism.blas_on_one_thread()      # as a training thread runs
            got = run()
            if ref is None:
                ref = got
            elif not all(torch.equal(a, b) for a, b in zip(ref, got)):
                return False
        return True
    finally:
        torch.set_num_threads(before)
        determinism.blas_on_one_thread()


def measure(m: int, k: int, n: int, transpose: bool) -> dict:
    """{"kernel", "ms": {kernel: median ms or None where its bits follow the thread count},
    "threads"}: the rule's kernel unless another is ``MARGIN`` faster on this shape."""
    runs = {kk: _candidate(kk, m, k, n, transpose) for kk in KERNELS}
    ok = {kk: kk == RULE or _same_bits(r) for kk, r in runs.items()}
    timed = {kk: r for kk, r in runs.items() if ok[kk]}
    before, count = torch.get_num_threads(), threads.ceiling()    # a training run's count
    torch.set_num_threads(count)
    determinism.blas_on_one_thread()
    try:
        for r in timed.values():
            r()
        got: dict = {kk: [] for kk in timed}
        end = time.perf_counter() + MEASURE_S
        while len(got[RULE]) < 3 or (time.perf_counter() < end and len(got[RULE]) < 50):
            for kk, r in timed.items():          # interleaved rounds
                t = time.perf_counter()
                r()
                got[kk].append((time.perf_counter() - t) * 1e3)
    finally:
        torch.set_num_threads(before)
        determinism.blas_on_one_thread()
    ms = {kk: (round(statistics.median(got[kk]), 4) if kk in got else None) for kk in KERNELS}
    best = min(timed, key=lambda kk: ms[kk])
    kernel = best if ms[best] * MARGIN <= ms[RULE] else RULE
    return {"kernel": kernel, "ms": ms, "threads": count}


def choose(m: int, k: int, n: int, transpose: bool, measure_missing: bool = True) -> str:
    """The kernel of this InnerProduct shape: pinned, this process's, the cache's, or measured
    now and cached (``measure_missing``) under the file lock; else the rule's."""
    forced = _forced()
    if determinism.is_deterministic():
        return RULE
    if forced != "auto":
        return forced
    shape = (m, k, n, bool(transpose))
    got = _chosen.get(shape)
    if got is not None:
        return got
    if not measure_missing and shape in _unread:
        return RULE
    kk = key(m, k, n, transpose)
    with _lock:
        got = _chosen.get(shape)
        if got is None and not measure_missing:
            got = _entry(_read(), kk)
        elif got is None:
            with _file_lock():
                choices = _read()      # under the lock: another process may have measured
                got = _entry(choices, kk)
                if got is None:
                    res = measure(m, k, n, transpose)
                    got = res["kernel"]
                    choices[_digest(kk)] = {"key": kk, **res}
                    engine_cache.write_atomic(cache_path(), json.dumps(
                        {"format": FORMAT, "choices": choices}, indent=1).encode())
                    if _entry(_read(), kk) != got:
                        # not kept: the next process would measure again and might take the
                        # other kernel, so other bits; the rule's is the same in every process
                        log.warning("inner product %s: the kernel choice could not be kept in "
                                    "%s: %s is used", list(shape), cache_path(), RULE)
                        got = RULE
                    else:
                        log.info("inner product %s: kernel %s (ms %s on %d threads; kept in "
                                 "%s)", list(shape), got, res["ms"], res["threads"], cache_path())
        if got is None:
            _unread.add(shape)   # not decided: prepare may still decide it
            return RULE
        _chosen[shape] = got
    return got


def prepare(net) -> None:
    """At solver set-up: the kernel of each training InnerProduct shape of ``net`` that has a
    choice (read from the cache, else measured now, on the thread that builds the solver)."""
    if net.device.type != "cpu" or dnn_linear() is None:
        return
    for layer, bottoms in zip(net.layer_list, net.bottom_lists):
        if layer.type != "InnerProduct" or not layer.blobs or layer.blobs[0].dtype != torch.float32:
            continue
        w = layer.blobs[0]
        if w.numel() < DNN_MIN_WEIGHT or not w.requires_grad:
            continue
        shape = net.shapes[bottoms[0]]
        axis = layer.param.inner_product_param.axis % len(shape)
        m = 1
        for d in shape[:axis]:
            m *= d
        k = w.numel() // layer.param.inner_product_param.num_output
        choose(m, k, layer.param.inner_product_param.num_output,
               layer.param.inner_product_param.transpose)
