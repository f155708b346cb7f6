"""Per-layer forward and backward timing of a Net (``brewnet time``, Caffe's ``caffe time``).

The net's own per-layer steps are timed, as Caffe times ``Layer::Forward``/``Backward``:
``Net.forward_layer(i)`` runs layer i on its bottom blobs (detached: a graph per layer) and
``Net.backward_layer(i)`` goes from its top diffs to its bottom diffs and parameter gradients, so a
layer's backward measures its own gradient kernels and nothing else. What is differentiated is what
a training step computes: every learnable parameter's gradient, and a bottom's where Caffe would
compute one (``Net.bottom_need_backward``: none for labels and data). Loss tops hold their loss
weight as diff, other outputs zeros unless set: a deploy net without a loss is timed as it would
train. It is the training path (no inference-only BatchNorm folding); the solver's whole-net
autograd can overlap or fuse some of this work, so the layers' sum can differ a little from one
real step. On CUDA the device is synchronised around every layer, as Caffe's timer events do.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Timing:
    """Accumulated milliseconds; ``average`` divides by the iterations run."""

    names: list[str]
    types: list[str]
    forward_ms: list[float]
    backward_ms: list[float]
    forward_total_ms: float = 0.0
    backward_total_ms: float = 0.0
    total_ms: float = 0.0
    iterations: int = 0
    iteration_ms: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _zero_output_diffs(net) -> None:
    """Outputs without a loss weight start each timed backward from a zero diff."""
    weights = net.blob_loss_weights
    for n in net.outputs:
        if not weights[n]:
            net.blobs[n].diff_tensor.zero_()


def layerwise_gradients(net) -> tuple[dict, dict]:
    """One forward and layer-by-layer backward pass as ``time_net`` runs it; returns
    ({blob name: diff of its first value}, {(layer name, j): param gradient}) so the timed work
    can be checked against the net's own backward."""
    for p in net.learnable:
        p.grad = None
    _zero_output_diffs(net)
    for i in range(len(net.layer_list)):
        net.forward_layer(i, train=True)
    done: set = set()
    seen: set = set()
    for i in reversed(range(len(net.layer_list))):
        net.backward_layer(i, done, train=True)
        seen |= done
    diffs = {n: net.blobs[n].diff_tensor.clone() for n in seen}
    grads = {(l.name, j): p.grad.clone() for l in net.layer_list for j, p in enumerate(l.blobs)
             if p.grad is not None}
    return diffs, grads


def time_net(net, iterations: int, on_iteration=None, warmup: int = 1) -> Timing:
    """Time ``iterations`` forward+backward passes of ``net`` layer by layer, after ``warmup``
    untimed ones (the first autograd call alone can take a quarter of a second).
    ``on_iteration(j, ms)`` is called after each timed pass (1-based ``j``)."""
    if warmup > 0:
        time_net(net, warmup, warmup=0)
    n = len(net.layer_list)
    timing = Timing([l.name for l in net.layer_list], [l.type for l in net.layer_list],
                    [0.0] * n, [0.0] * n)
    device = net.device
    _zero_output_diffs(net)
    _sync(device)
    total0 = time.perf_counter()
    for j in range(iterations):
        it0 = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            net.forward_layer(i, train=True)
            _sync(device)
            timing.forward_ms[i] += (time.perf_counter() - t0) * 1e3
        timing.forward_total_ms += (time.perf_counter() - it0) * 1e3
        for p in net.learnable:          # fresh gradients each pass, as a training step has
            p.grad = None
        bw0 = time.perf_counter()
        done: set = set()
        for i in reversed(range(n)):
            t0 = time.perf_counter()
            net.backward_layer(i, done, train=True)
            _sync(device)
            timing.backward_ms[i] += (time.perf_counter() - t0) * 1e3
        timing.backward_total_ms += (time.perf_counter() - bw0) * 1e3
        ms = (time.perf_counter() - it0) * 1e3
        timing.iteration_ms.append(ms)
        timing.iterations += 1
        if on_iteration is not None:
            on_iteration(j + 1, ms)
    timing.total_ms = (time.perf_counter() - total0) * 1e3
    return timing
