"""Per-layer forward and backward timing of a Net (``brewnet time``, Caffe's ``caffe time``).

How backward is timed, honestly: the net is run layer by layer, each layer's forward on its
bottoms detached from the previous layers (so each layer has a graph of its own), and backward
walks the layers in reverse calling ``torch.autograd.grad`` on one layer at a time, from its
top diffs to its bottom diffs and parameter gradients - the same split Caffe times with
``Layer::Backward``. A layer's backward therefore measures its own gradient kernels and nothing
else. What is differentiated is what a training step computes: every learnable parameter's
gradient, and a bottom's gradient only where it reaches a learnable parameter or a forced input
(labels and data blobs get none, as in Caffe). Loss tops are seeded with their loss weight,
other tops with zeros (Caffe backpropagates whatever diff they hold), so a deploy net without a
loss is still timed as it would train. Whole-net autograd (the solver's path) can overlap or
fuse some of this work, so the sum of the layers can differ a little from one real step.
This is the training path: no inference-only shortcut (BatchNorm folding) is taken. On CUDA the
device is synchronised around every layer, as Caffe's timer events do.
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


def _needs_grad(net) -> dict[str, bool]:
    """Blob name -> whether its gradient reaches a learnable parameter (Caffe's
    blob_need_backward, plus forced inputs)."""
    need = {n: bool(net.param.force_backward) for n in net.inputs}
    for layer, bottoms, tops, prop in zip(net.layer_list, net.bottom_lists, net.top_lists, net._propagate):
        if layer.type == "Input":
            continue
        reaches = any(p.requires_grad for p in layer.blobs) or any(
            need.get(b, False) and pr for b, pr in zip(bottoms, prop))
        for t in tops:
            need[t] = reaches
    return need


def _forward_layer(net, i: int, need: dict, fed: dict):
    """Run layer ``i`` on detached bottoms (leaves where a gradient is wanted); stores its tops
    in the net's blobs and returns (bottoms, tops), or None for an Input layer. As in the Net's
    own forward, a CPU conv net feeds its 4-D inputs to the layers in channels_last (that
    conversion is the Input layer's time); ``fed`` holds them for the pass."""
    layer = net.layer_list[i]
    if layer.type == "Input":
        if getattr(net, "_channels_last", False):
            for n in net.top_lists[i]:
                t = net.blobs[n].tensor
                if t.dim() == 4:
                    fed[n] = t.contiguous(memory_format=torch.channels_last)
        return None
    bottoms = []
    for b, pr in zip(net.bottom_lists[i], net._propagate[i]):
        x = (fed[b] if b in fed else net.blobs[b].tensor).detach()
        if pr and need.get(b, False) and x.is_floating_point():
            x.requires_grad_(True)
        bottoms.append(x)
    with torch.enable_grad():
        tops = layer.forward(bottoms)
    for name, t in zip(net.top_lists[i], tops):
        net.blobs[name].tensor = t
    return bottoms, tops


def _backward_layer(net, i: int, graph, diffs: dict, weights, param_grads: dict | None = None) -> None:
    """Layer ``i``'s backward alone: its top diffs (popped from ``diffs``; loss weight or zeros
    when none arrived) to its bottom diffs (added into ``diffs``) and parameter gradients
    (added into ``param_grads[(layer name, j)]`` when given)."""
    if graph is None:
        return
    bottoms, tops = graph
    layer = net.layer_list[i]
    seeds, grads = [], []
    for name, t in zip(net.top_lists[i], tops):
        g = diffs.pop(name, None)       # an in-place top's diff is consumed before its bottom's
        if not t.requires_grad:
            continue
        if g is None:
            w = weights.get(name, 0.0)
            g = torch.full_like(t, w) if w else torch.zeros_like(t)
        seeds.append(t)
        grads.append(g)
    params = [(j, p) for j, p in enumerate(layer.blobs) if p.requires_grad]
    wrt = [b for b in bottoms if b.requires_grad] + [p for _, p in params]
    if not seeds or not wrt:
        return
    got = list(torch.autograd.grad(seeds, wrt, grads, allow_unused=True))
    for name, b in zip(net.bottom_lists[i], bottoms):
        if b.requires_grad:
            g = got.pop(0)              # wrt starts with the differentiated bottoms, in order
            if g is not None:
                diffs[name] = g if name not in diffs else diffs[name] + g
    if param_grads is not None:
        for (j, _), g in zip(params, got):
            if g is not None:
                key = (layer.name, j)
                param_grads[key] = g if key not in param_grads else param_grads[key] + g


def layerwise_gradients(net) -> tuple[dict, dict]:
    """One forward and layer-by-layer backward pass as ``time_net`` runs it; returns
    ({blob name: diff of its first value}, {(layer name, j): param gradient}) so the timed work
    can be checked against the net's own backward."""
    need, weights = _needs_grad(net), net.blob_loss_weights
    fed: dict = {}
    graphs = [_forward_layer(net, i, need, fed) for i in range(len(net.layer_list))]
    diffs, seen, param_grads = {}, {}, {}
    for i in reversed(range(len(graphs))):
        _backward_layer(net, i, graphs[i], diffs, weights, param_grads)
        seen.update(diffs)              # the last write to a name is its first value's gradient
    return seen, param_grads


def time_net(net, iterations: int, on_iteration=None, warmup: int = 1) -> Timing:
    """Time ``iterations`` forward+backward passes of ``net`` layer by layer, after ``warmup``
    untimed ones (the first autograd call alone can take a quarter of a second).
    ``on_iteration(j, ms)`` is called after each timed pass (1-based ``j``)."""
    if warmup > 0:
        time_net(net, warmup, warmup=0)
    n = len(net.layer_list)
    timing = Timing([l.name for l in net.layer_list], [l.type for l in net.layer_list],
                    [0.0] * n, [0.0] * n)
    need, weights, device = _needs_grad(net), net.blob_loss_weights, net.device
    _sync(device)
    total0 = time.perf_counter()
    for j in range(iterations):
        it0 = time.perf_counter()
        graphs, fed = [], {}
        for i in range(n):
            t0 = time.perf_counter()
            graphs.append(_forward_layer(net, i, need, fed))
            _sync(device)
            timing.forward_ms[i] += (time.perf_counter() - t0) * 1e3
        timing.forward_total_ms += (time.perf_counter() - it0) * 1e3
        bw0 = time.perf_counter()
        diffs: dict = {}
        for i in reversed(range(n)):
            t0 = time.perf_counter()
            _backward_layer(net, i, graphs[i], diffs, weights)
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
