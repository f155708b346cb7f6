"""The graph both front ends produce (torch.export's ATen IR, an ONNX graph) and the Caffe writer
reads: nodes with a canonical op name, named tensor values with shapes, constants as arrays.

Canonical ops are ATen's names without the ``aten.`` prefix and overload (``conv2d``,
``batch_norm``, ``max_pool2d``...), their arguments bound by name, so the torch front end is
a thin layer over torch.export and the ONNX front end translates into the same words.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..errors import NetError

DIALECTS = ("bvlc", "ssd", "forks")


class ConversionError(NetError):
    """A model that cannot be written in the chosen dialect, or a conversion that does not match."""


class Unsupported(Exception):
    """Raised by an op's writer: the op, why, and the dialects that could write it."""

    def __init__(self, why: str, could: tuple = ()):
        super().__init__(why)
        self.why = why
        self.could = tuple(could)


@dataclasses.dataclass
class Node:
    op: str                 # canonical op name ("conv2d", "add", ...)
    ins: list               # value names (str) or python scalars / lists, by position
    attrs: dict             # the op's other arguments by name
    outs: list              # value names of its outputs
    path: str = ""          # module path ("layer1.0.conv1"), "" at the top module
    source: str = ""        # "file:line: code" of the model's line that made it
    target: str = ""        # the original op ("aten.conv2d.default", ONNX "Conv")


@dataclasses.dataclass
class Graph:
    inputs: list            # value names of the model's inputs
    outputs: list           # value names of its outputs
    nodes: list
    shapes: dict            # value name -> tuple
    consts: dict            # value name -> np.ndarray (weights, buffers, constants)

    def is_const(self, v) -> bool:
        return isinstance(v, str) and v in self.consts

    def consumers(self) -> dict:
        use: dict = {}
        for n in self.nodes:
            for v in _flat(n.ins):
                if isinstance(v, str):
                    use.setdefault(v, []).append(n)
        for v in self.outputs:
            use.setdefault(v, []).append(None)
        return use


def _flat(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flat(x)
        else:
            yield x


def source_line(stack_trace: str | None) -> str:
    """The model's own line from torch.export's stack trace: the last frame outside torch."""
    if not stack_trace:
        return ""
    lines = stack_trace.strip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("File "):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((s, code))
    torch_dir = os.sep + "torch" + os.sep
    own = [f for f in frames if torch_dir not in f[0]] or frames
    if not own:
        return ""
    head, code = own[-1]
    try:
        path = head.split('"')[1]
        line = head.split("line ")[1].split(",")[0]
        return f"{os.path.basename(path)}:{line}: {code}"
    except IndexError:
        return f"{head}: {code}"


def fuse_channel_permutes(g: Graph) -> None:
    """``reshape -> permute/transpose -> reshape`` back to the first shape that only reorders
    channels (ShuffleNet's channel shuffle) becomes one ``channel_permute`` node with the
    permutation, which a 1x1 convolution writes exactly in BVLC Caffe."""
    import torch

    use = g.consumers()
    producer = {o: n for n in g.nodes for o in n.outs}
    drop = set()
    for n in g.nodes:
        if n.op != "permute" or id(n) in drop:
            continue
        a = producer.get(n.ins[0])
        chain_out = n.outs[0]
        tail = []
        while len(use.get(chain_out, [])) == 1 and use[chain_out][0] is not None \
                and use[chain_out][0].op in ("identity", "reshape"):
            t = use[chain_out][0]
            tail.append(t)
            chain_out = t.outs[0]
            if t.op == "reshape":
                break
        if a is None or a.op != "reshape" or not tail or tail[-1].op != "reshape":
            continue
        if len(use.get(a.outs[0], [])) != 1:
            continue
        src, dst = g.shapes[a.ins[0]], g.shapes[chain_out]
        if len(src) != 4 or tuple(src) != tuple(dst):
            continue
        idx = torch.arange(int(np.prod(src))).reshape(src)
        y = idx.reshape(g.shapes[a.outs[0]]).permute(*n.attrs["dims"]).reshape(dst)
        hw = src[2] * src[3]
        perm = (y[0, :, 0, 0] // hw) % src[1]
        if not torch.equal(y, idx[:, perm]):
            continue
        n.op, n.ins, n.outs = "channel_permute", [a.ins[0]], [chain_out]
        n.attrs = {"self": a.ins[0], "perm": [int(p) for p in perm]}
        drop.update(id(t) for t in [a] + tail)
    g.nodes = [n for n in g.nodes if id(n) not in drop]
