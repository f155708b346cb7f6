"""A net with layers no graph can hold, cut before them: the trunk on an engine, the tail eager.

SSD's DetectionOutput, a Proposal or a Python layer has no graph or ONNX form
(``deploy.fx_export.NO_GRAPH``). Their net runs in three parts: the **trunk**, every layer they
do not feed (the convolutions and heads: most of the time), as the lean graph or the engine
picked (engines.py), its outputs the blobs the rest reads; the **constants**, layers whose
outputs follow from the input shapes alone (``SHAPE_ONLY``: PriorBox) and the weightless layers
that only rearrange those (the priors' Concat), computed once per input shape; the **tail**, the
no-graph layers and every layer they feed, run eagerly on those values each call as the plain
path runs them, so its outputs are the plain path's on the trunk's (engines: within
``engines.RTOL``; NMS can then keep another of two near-tied boxes, as any runtime's). A cut
that would need two versions of one in-place blob is declined (the net stays plain).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..blob import nhwc
from .fast_path import Declined

SHAPE_ONLY = {"PriorBox"}     # layers whose tops depend on their bottoms' shapes only


@dataclass
class Cut:
    trunk: list[int]             # layer indices (Input layers left out), in net order
    const: list[int]
    tail: list[int]
    outputs: list[str]           # the trunk's outputs: what the tail and the user read of it
    values: dict = field(default_factory=dict)   # the constants' tops for the current shapes

    def constants(self, net, channels_last: bool) -> None:
        """The constant layers run once on tensors of the current shapes (their non-constant
        bottoms are read for their shapes only)."""
        cur: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i in self.const:
                bottoms = []
                for b in net.bottom_lists[i]:
                    if b not in cur:
                        z = torch.zeros(net.shapes[b], device=net.device)
                        cur[b] = nhwc(z) if channels_last and z.dim() == 4 else z
                    bottoms.append(cur[b])
                for t, v in zip(net.top_lists[i], net.layer_list[i].forward(bottoms)):
                    cur[t] = v
        self.values = {t: cur[t] for i in self.const for t in net.top_lists[i]}

    def finish(self, net, trunk_outs, xs, channels_last: bool) -> tuple:
        """The net's outputs: the tail run eagerly on the trunk's outputs, the constants and the
        inputs ``xs`` (4-D values in the plain path's layout)."""
        def plain(t):
            return nhwc(t) if channels_last and t.dim() == 4 else t

        cur = {n: plain(x) for n, x in zip(net.inputs, xs)}
        cur.update((n, plain(t)) for n, t in zip(self.outputs, trunk_outs))
        cur.update(self.values)
        with torch.no_grad():
            for i in self.tail:
                tops = net.layer_list[i].forward([cur[b] for b in net.bottom_lists[i]])
                cur.update(zip(net.top_lists[i], tops))
        return tuple(cur[o] for o in net.outputs)


def plan(net) -> Cut | None:
    """Where ``net`` is cut (None: a graph can hold the whole net)."""
    from ..deploy.fx_export import NO_GRAPH

    kinds: dict[int, str] = {}
    tainted: set[str] = set()          # blobs whose current value the tail made
    const: set[str] = set()
    for i, layer in enumerate(net.layer_list):
        if layer.type == "Input":
            continue
        bottoms = net.bottom_lists[i]
        if layer.type in NO_GRAPH or any(b in tainted for b in bottoms):
            kind = "tail"
        elif layer.type in SHAPE_ONLY or (bottoms and not layer.blobs and all(b in const for b in bottoms)):
            kind = "const"
        else:
            kind = "trunk"
        kinds[i] = kind
        for t in net.top_lists[i]:
            tainted.discard(t)
            const.discard(t)
            (tainted if kind == "tail" else const if kind == "const" else set()).add(t)
    if "tail" not in kinds.values():
        return None
    trunk_reads = {b for i, k in kinds.items() if k == "trunk" for b in net.bottom_lists[i]}
    if trunk_reads & {t for i, k in kinds.items() if k == "const" for t in net.top_lists[i]}:
        kinds = {i: "trunk" if k == "const" else k for i, k in kinds.items()}   # the graph makes them
    last: dict[str, int] = {}           # blob -> the layer that wrote its current value
    outputs: list[str] = []
    for i in sorted(kinds):
        for b in net.bottom_lists[i] if kinds[i] == "tail" else ():
            later = [j for j in kinds if j > i and kinds[j] != "tail" and b in net.top_lists[j]]
            if later:
                layer = net.layer_list[later[0]]
                raise Declined(f"Layer '{layer.name}' (type {layer.type}) rewrites blob '{b}' after "
                               f"layer '{net.layer_list[i].name}' read it: no cut of the net holds "
                               "both values")
            if b in last and kinds[last[b]] == "trunk" and b not in outputs:
                outputs.append(b)
        for t in net.top_lists[i]:
            last[t] = i
    outputs += [o for o in net.outputs if o not in outputs and o in last and kinds[last[o]] == "trunk"]
    if not outputs:
        first = next(net.layer_list[i] for i in sorted(kinds) if kinds[i] == "tail")
        raise Declined(f"Layer '{first.name}' (type {first.type}) cannot be part of a graph and "
                       "no layer before it can")
    return Cut(trunk=[i for i in sorted(kinds) if kinds[i] == "trunk"],
               const=[i for i in sorted(kinds) if kinds[i] == "const"],
               tail=[i for i in sorted(kinds) if kinds[i] == "tail"], outputs=outputs)
