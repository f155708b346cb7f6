"""Python layers: user classes written for pycaffe, run inside a brewnet Net.

A prototxt names ``python_param { module: "m" layer: "Cls" param_str: "..." }``; ``m`` is
imported (from ``sys.path``, as Caffe relies on ``PYTHONPATH``) and ``Cls(layer_param)`` is made,
with ``param_str`` and ``phase`` set before its ``setup(bottom, top)``. Then, as in Caffe:
``reshape(bottom, top)`` and ``forward(bottom, top)`` each forward, ``backward(top,
propagate_down, bottom)`` for gradients, on pycaffe Blobs (numpy ``data``/``diff``).
``self.blobs.add_blob(*shape)`` creates parameters that the net saves, loads and trains.
"""
from __future__ import annotations

import ast
import importlib
import logging

import torch

from ..blob import Blob, ParamBlob
from ..proto import caffe_pb2 as pb
from .base import Layer as _Layer
from .rcnn import proposal_param_from_python
from .registry import layer_class, register

log = logging.getLogger("brewnet")


def spatial_dropout_from_python(param, phase: int):
    """ENet's ``spatial_dropout.SpatialDropoutLayer`` (TimoSaemann/caffe-enet 22d356c,
    python/spatial_dropout.py) as the built-in SpatialDropout: its param_str
    ``{'phase': 'TEST', 'p': '0.01'}`` gives dropout_ratio and the phase, which the fork's layer
    takes from param_str, not from the net (any phase but 'TRAIN' runs its TEST branch)."""
    text = param.python_param.param_str.strip()
    try:
        d = ast.literal_eval(text)
        p, when = float(d["p"]), d["phase"]
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise ValueError(f"Layer '{param.name}': python_param.param_str {text!r} is not "
                         f"spatial_dropout's (\"{{'phase': 'TEST', 'p': '0.01'}}\"): {e}") from None
    out = pb.LayerParameter()
    out.CopyFrom(param)
    out.type = "SpatialDropout"
    out.ClearField("python_param")
    out.dropout_param.dropout_ratio = p
    return out, pb.TRAIN if when == "TRAIN" else pb.TEST


# Python layers of well-known fork nets that brewnet has built in: (module, class) -> a function
# of (LayerParameter, phase) giving the built-in layer's LayerParameter (or it and the phase the
# built-in runs in, where the fork's layer takes its phase from param_str). Used when the module
# is not importable (a user's own module of that name always wins).
BUILT_IN = {("rpn.proposal_layer", "ProposalLayer"): proposal_param_from_python,
            ("spatial_dropout", "SpatialDropoutLayer"): spatial_dropout_from_python}
_said: set[tuple[str, str]] = set()


class BlobVec(list):
    """pycaffe's ``layer.blobs``: a list of Blobs with ``add_blob(*shape)``."""

    def __init__(self, owner: "PythonLayer"):
        super().__init__()
        self._owner = owner

    def add_blob(self, *shape) -> None:
        self._owner.blobs.append(torch.zeros(tuple(int(d) for d in shape)).requires_grad_(True))
        self.append(ParamBlob(self._owner, len(self._owner.blobs) - 1))


class Layer:
    """pycaffe's ``caffe.Layer``: subclass it and define setup/reshape/forward/backward."""

    def __init__(self, param=None):
        self.param = param
        self.blobs = BlobVec(None)
        self.param_str, self.phase = "", 0

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass


def _blobs(tensors) -> list[Blob]:
    # pycaffe code works on numpy arrays: hand it CPU float32 copies it may not alias.
    return [Blob(t.detach().to("cpu", torch.float32).clone()) for t in tensors]


class _Run(torch.autograd.Function):
    """Forward and backward through the user's object, with Caffe's diff plumbing."""

    @staticmethod
    def forward(ctx, layer, n_tops, *bottoms):
        bottom = _blobs(bottoms)
        # The tops keep the shapes the class gave them (in setup, reshape or an earlier
        # forward), as Caffe's top blobs do; fresh copies so a pending backward keeps its own.
        top = [Blob(t.tensor.detach().clone()) for t in layer.tops]
        layer.user.reshape(bottom, top)
        layer.user.forward(bottom, top)
        layer.tops = top
        ctx.layer, ctx.bottom, ctx.top = layer, bottom, top
        ctx.like = [(b.dtype, b.device) for b in bottoms]
        return tuple(t.tensor.detach().clone().to(bottoms[0].device if bottoms else "cpu") for t in top)

    @staticmethod
    def backward(ctx, *grads):
        for blob, g in zip(ctx.top, grads):
            blob.diff_tensor = g.detach().to("cpu", torch.float32).reshape(blob.shape).clone()
        for b in ctx.bottom:
            b.diff_tensor = torch.zeros(b.shape)
        need = list(ctx.needs_input_grad[2:])
        ctx.layer.user.backward(ctx.top, need, ctx.bottom)
        outs = [b.diff_tensor.to(dtype=dt, device=dev) if n else None
                for b, n, (dt, dev) in zip(ctx.bottom, need, ctx.like)]
        return (None, None, *outs)


@register("Python")
class PythonLayer(_Layer):
    """A layer whose math is a user's pycaffe class (``python_param``: module, layer, param_str).

    Bottoms/tops: whatever the class says; top shapes set in its setup, reshape or forward stand
    until it changes them. Blobs: those it adds with ``self.blobs.add_blob``. A class brewnet
    has built in (``BUILT_IN``: py-faster-rcnn's ``rpn.proposal_layer``, ENet's
    ``spatial_dropout``) runs on the built-in
    layer when its module is not importable, saying so once. Differs from Caffe: bottoms are
    handed over as copies (CPU, float32), so a class that writes into its bottoms does not
    change the net's blobs; exceptions from the class propagate as they are (Caffe's pycaffe
    does the same).
    """

    wrap_errors = False

    def setup(self, bottom_shapes):
        p = self.param.python_param
        if not p.module or not p.layer:
            raise self.fail("python_param needs both module and layer")
        self.builtin = None
        try:
            cls = getattr(importlib.import_module(p.module), p.layer)
        except (ImportError, AttributeError) as e:
            make = BUILT_IN.get((p.module, p.layer))
            if make is None or (isinstance(e, ImportError) and e.name not in p.module):
                raise self.fail(f"cannot load Python layer {p.module}.{p.layer}: {e}") from e
            self._use_builtin(make, e, bottom_shapes)
            return
        self.user = cls(self.param)
        self.user.blobs = BlobVec(self)
        # param_str_: the name older pycaffe (py-faster-rcnn's caffe-fast-rcnn) gave it
        self.user.param_str = self.user.param_str_ = p.param_str
        self.user.phase = self.phase
        bottom = [Blob(torch.zeros(tuple(s))) for s in bottom_shapes]
        self.tops = [Blob(torch.zeros(0)) for _ in self.param.top]
        self.user.setup(bottom, self.tops)

    def _use_builtin(self, make, why, bottom_shapes):
        p = self.param.python_param
        try:
            lp = make(self.param, self.phase)
        except ValueError as e:
            raise self.fail(str(e)) from None
        lp, phase = lp if isinstance(lp, tuple) else (lp, self.phase)
        if (p.module, p.layer) not in _said:
            _said.add((p.module, p.layer))
            log.warning("Python layer %s.%s is not importable (%s); layer '%s' and any other "
                        "naming it run on brewnet's built-in %s", p.module, p.layer, why,
                        self.name, lp.type)
        self.builtin = layer_class(lp.type, self.name)(lp, phase)
        self.builtin.setup(bottom_shapes)

    def allow_backward(self, i):
        return self.builtin.allow_backward(i) if self.builtin is not None else True

    def reshape(self, bottom_shapes):
        if self.builtin is not None:
            return self.builtin.reshape(bottom_shapes)
        self.user.reshape([Blob(torch.zeros(tuple(s))) for s in bottom_shapes], self.tops)
        return [t.shape for t in self.tops]

    def forward(self, bottoms):
        if self.builtin is not None:
            return self.builtin.forward(bottoms)
        return list(_Run.apply(self, len(self.param.top), *bottoms))
