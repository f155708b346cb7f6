"""The same bits on any thread count: which kernels do, and the switch for the ones that may not.

A training run's numbers must not depend on its torch thread count (``threads.py`` picks it from
the net's size and the cores), else a net trained merged, together or elsewhere would end with
other weights than alone. Two kinds of kernel split a sum between threads:
- **BLAS products**: ``MKL_CBWR=AUTO,STRICT`` (set on ``import brewnet`` unless set), and a
  training thread runs MKL on one thread (``blas_on_one_thread``); large InnerProducts use oneDNN.
- **oneDNN's convolution weight gradient**: each shape is checked once on 1 thread and on each of
  ``counts()``; where they differ, the batch in chunks fixed by the shape, each chunk on one
  thread, added in order (``wgrad.py``; it was im2col and one product per image).
**Deterministic mode** (``set_deterministic(True)``, ``BREWNET_DETERMINISTIC=1``, ``brewnet train
--deterministic``): every convolution takes the per-image path: the same bits on any machine of
the same CPU architecture. Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading

import torch

from . import threads

log = logging.getLogger("brewnet")
MKL_CBWR_ALL, MKL_CBWR_STRICT = ~0, 0x10000     # mkl_cbwr.h
_state = {"on": None}
_lock = threading.Lock()


def set_deterministic(on: bool = True) -> None:
    """Every kernel with a thread-invariant formulation uses it (see the module docstring)."""
    _state["on"] = bool(on)


def is_deterministic() -> bool:
    if _state["on"] is not None:
        return _state["on"]
    from .process import env_switch

    return env_switch("BREWNET_DETERMINISTIC", "0", ("0", "1")) == "1"


@functools.cache
def _mkl(name: str):
    """One of MKL's C service functions (int -> int) inside torch's library, or None."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = getattr(lib, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def mkl_strict() -> bool | None:
    """Whether MKL runs in strict reproducible mode (None: torch has no MKL here)."""
    get = _mkl("mkl_serv_cbwr_get")
    if get is None:
        return None
    return bool(get(MKL_CBWR_ALL) & MKL_CBWR_STRICT)


_warned: list[bool] = []


def check_mkl() -> None:
    """Warn once when MKL was started before brewnet could ask for its strict mode."""
    if _warned or "MKL_CBWR" not in os.environ or mkl_strict() is not False:
        return
    if "STRICT" in os.environ["MKL_CBWR"].upper():
        _warned.append(True)
        log.warning("MKL ran before brewnet was imported, so its matrix products keep MKL's "
                    "default order, which changes with the thread count: import brewnet before "
                    "the first matrix product, or set MKL_CBWR=AUTO,STRICT, for the same bits "
                    "on any thread count")


def _mkl_set_local():
    # C (by value), thread-local; torch's set_num_threads resets it
    return _mkl("mkl_serv_set_num_threads_local")


def blas_on_one_thread() -> None:
    """MKL's matrix products on one thread in the calling thread (a training thread): strict
    mode still splits tiny products between threads (10 x 16 x 64, measured), and the products
    left to MKL are small ones (InnerProduct weights under ``DNN_MIN_WEIGHT``, per-image im2col
    products), where one thread was as fast or faster. oneDNN and ATen keep torch's count."""
    fn = _mkl_set_local()
    if fn is not None:
        fn(1)


_counts: dict[int, tuple[int, ...]] = {}     # per process id: a forked child decides anew
_IMPORT_PID = os.getpid()


@contextlib.contextmanager
def blas_on_one_thread_here():
    """MKL on one thread inside the block (its thread-local count), the caller's after: for a
    product under ``threads.TINY_FLOPS``, which strict mode still splits by thread count and
    threads do not speed up (an inference InnerProduct of a few rows, 4 x 108 x 5 measured)."""
    fn = _mkl_set_local()
    if fn is None:
        yield
        return
    before = fn(1)
    try:
        yield
    finally:
        fn(before)


@contextlib.contextmanager
def blas_on_torch_threads(large: bool = True):
    """MKL on torch's thread count inside the block, for a large product (strict mode kept
    one order on 1 and 2 threads for every shape of a few MFLOP and more tried here; the fused
    engine's batched InnerProducts took 1.2x longer on one thread). Back to the caller's after."""
    fn, n = _mkl_set_local(), torch.get_num_threads()
    if not large or fn is None or n == 1:
        yield
        return
    before = fn(n)
    try:
        yield
    finally:
        fn(before)


def counts() -> tuple[int, ...]:
    """The torch thread counts a kernel's bits are checked on in this process (decided once, in
    the thread that first asks: a worker thread's own OpenMP count is not a user's choice):
    one, the cores, the CLI's ceiling, a half, third and quarter of the cores
    (``TrainTogether``'s worker threads) and a count the user fixed; so a run with the count
    fixed chooses the kernels a default run chooses. A process forked after brewnet was
    imported checks only one, the count it runs and the user's: growing the parent's OpenMP
    pool there hangs."""
    got = _counts.get(os.getpid())
    if got is None:
        fixed = threads.user_threads()
        c = max(1, threads.usable_cores())
        if os.getpid() != _IMPORT_PID:    # forked after import: the parent's OpenMP pool is
            # not ours to grow (it would hang); the count this process already runs is its own.
            got = tuple(sorted({1, fixed or 1, torch.get_num_threads()}))
        else:   # the user's count too, so BREWNET_THREADS=1 and =2 choose the same kernels
            got = tuple(sorted({1, c, threads.ceiling(), fixed or 1,
                                *(max(1, c // n) for n in (2, 3, 4))}))
        _counts[os.getpid()] = got
    return got


def onednn_backward(dy, x, w, stride, pad, dilation, groups, mask):
    """torch's default CPU (oneDNN) gradients of a 2-D convolution: (input, weight, bias) as
    ``mask`` asks."""
    return torch.ops.aten.convolution_backward(dy, x, w, [w.shape[0]], list(stride), list(pad),
                                               list(dilation), False, [0, 0], groups, mask)


def per_image_wgrad(dy, x, w, stride, pad, dilation, groups, bias: bool):
    """Caffe's weight gradient: im2col of each image and one matrix product per image, added in
    image order (ATen's slow convolution), per group; the bias gradient summed per (image,
    channel), then over the images. Neither depends on the thread count (BLAS in strict mode;
    in deterministic mode on one thread, which holds on any count, oversubscribed ones too)."""
    n = torch.get_num_threads()
    if n > 1 and is_deterministic():
        torch.set_num_threads(1)
        try:
            return per_image_wgrad(dy, x, w, stride, pad, dilation, groups, bias)
        finally:
            torch.set_num_threads(n)
            blas_on_one_thread()
    if list(dilation) != [1, 1]:
        with torch.backends.mkldnn.flags(enabled=False):     # ATen's dilated im2col kernel
            gw = onednn_backward(dy, x, w, stride, pad, dilation, groups, [False, True, False])[1]
    else:
        k, op = list(w.shape[2:]), torch.ops.aten._slow_conv2d_backward.output_mask
        # the kernel wants all three in one layout (a slice of a group is copied into it)
        fmt = torch.channels_last if x.is_contiguous(
            memory_format=torch.channels_last) and not x.is_contiguous() else torch.contiguous_format

        def run(d, i, wg):
            return op(d.contiguous(memory_format=fmt), i.contiguous(memory_format=fmt),
                      wg.contiguous(memory_format=fmt), k, list(stride), list(pad),
                      [False, True, False])[1]

        if groups == 1:
            gw = run(dy, x, w)
        else:
            cin, cout = x.shape[1] // groups, w.shape[0] // groups
            gw = torch.cat([run(dy[:, g * cout:(g + 1) * cout], x[:, g * cin:(g + 1) * cin],
                                w[g * cout:(g + 1) * cout]) for g in range(groups)])
        gw = gw.contiguous()
    gb = dy.sum((2, 3)).sum(0) if bias else None
    return gw, gb


def _probe(shape_x, shape_w, stride, pad, dilation, groups, channels_last: bool) -> bool:
    """True when oneDNN's weight gradient has the same bits on every count of ``counts()``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape_x, generator=gen)
    w = torch.randn(shape_w, generator=gen)
    with torch.no_grad():
        y = torch.nn.functional.conv2d(x, w, None, stride, pad, dilation, groups)
    dy = torch.randn(y.shape, generator=gen)
    if channels_last:
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    before = torch.get_num_threads()
    try:
        ref = None
        for n in counts():
            torch.set_num_threads(n)
            _, gw, gb = onednn_backward(dy, x, w, stride, pad, dilation, groups, [False, True, True])
            if ref is None:
                ref = (gw, gb)
            elif not (torch.equal(ref[0], gw) and torch.equal(ref[1], gb)):
                return False
        return True
    finally:
        torch.set_num_threads(before)
        blas_on_one_thread()


_checked: dict[tuple, bool] = {}


def onednn_invariant(x: torch.Tensor, w: torch.Tensor, stride, pad, dilation, groups) -> bool:
    """Whether this convolution's oneDNN weight gradient keeps its bits on every thread count
    brewnet uses here (checked once per shape and layout; never in deterministic mode)."""
    if is_deterministic():
        return False
    cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    key = (tuple(x.shape), tuple(w.shape), tuple(stride), tuple(pad), tuple(dilation), groups, cl)
    got = _checked.get(key)
    if got is None:
        with _lock:
            got = _checked.get(key)
            if got is None:
                got = len(counts()) == 1 or _probe(*key)
                _checked[key] = got
                log.debug("convolution %s x %s: oneDNN weight gradient %s across %s threads",
                          key[0], key[1], "the same" if got else "differs", counts())
    return got


def prepare(net) -> None:
    """Before training ``net``: warn if MKL missed its strict mode, and check each of its 2-D
    convolutions' oneDNN weight gradient now, on the thread that builds the solver (a check
    sets the thread count; together's worker threads must not see it change mid-step)."""
    check_mkl()
    if net.device.type != "cpu" or is_deterministic():
        return
    for layer, bottoms in zip(net.layer_list, net.bottom_lists):
        if (layer.type != "Convolution" or getattr(layer, "num_spatial", 0) != 2
                or layer.axis != 1 or not layer.blobs or not layer.blobs[0].requires_grad
                or layer.blobs[0].dtype != torch.float32):
            continue
        w = layer.blobs[0]
        for b in dict.fromkeys(bottoms):
            shape = net.shapes[b]
            x = torch.empty(shape, memory_format=torch.channels_last if net._channels_last
                            else torch.contiguous_format)
            onednn_invariant(x, w, layer.stride, layer.pad, layer.dilation, layer.group)
