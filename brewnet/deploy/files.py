"""Files another runtime loads: ONNX (``export_onnx``) and torch.export's ``.pt2``
(``export_program``), both from ``to_torch``'s graph, so they compute what the Net computes.
Neither format is a pickle: ONNX is a protobuf, ``.pt2`` a zip of JSON and raw tensors."""
from __future__ import annotations

import logging
import os

import torch

from ..errors import NetError
from .fx_export import to_torch

log = logging.getLogger("brewnet")
__all__ = ["export_onnx", "export_program", "MIN_OPSET"]
MIN_OPSET = 17


def _inputs(gm, dynamic_batch: bool):
    """Example inputs (batch 2 when dynamic: export specialises a batch of 1) and their specs."""
    xs = [torch.randn(((2,) if dynamic_batch else (s[0],)) + tuple(s[1:]))
          for s in gm.input_shapes]
    if not dynamic_batch:
        return tuple(xs), None
    batch = torch.export.Dim("batch", min=1)
    return tuple(xs), {name: {0: batch} for name in gm.input_names}


def _program(gm, dynamic_batch: bool):
    xs, dyn = _inputs(gm, dynamic_batch)
    try:
        return torch.export.export(gm, xs, dynamic_shapes=dyn, strict=False), xs
    except Exception as e:  # noqa: BLE001  (to_torch already fell back to a fixed batch)
        if not dynamic_batch:
            raise
        log.warning("the batch size stays fixed: %s", str(e).splitlines()[0][:200])
        return _program(gm, False)


def export_program(model, out, weights=None, dynamic_batch: bool = True, fold: bool = False):
    """Write ``torch.export``'s program of the net to ``out`` (``.pt2``; load it with
    ``torch.export.load``). ``model``: what ``to_torch`` takes, or its module."""
    gm = model if isinstance(model, torch.fx.GraphModule) else to_torch(model, weights, fold=fold)
    ep, _ = _program(gm, dynamic_batch and gm.dynamic_batch)
    torch.export.save(ep, os.fspath(out))
    return ep


def export_onnx(model, out, weights=None, dynamic_batch: bool = True, opset: int = 18,
                fold: bool = False):
    """Write the net as ONNX (``opset`` >= 17) to ``out``; inputs and outputs carry the Caffe
    blob names. Returns the ``torch.onnx.ONNXProgram``."""
    if opset < MIN_OPSET:
        raise NetError(f"--opset {opset}: brewnet exports ONNX opset {MIN_OPSET} or later")
    gm = model if isinstance(model, torch.fx.GraphModule) else to_torch(model, weights, fold=fold)
    dynamic_batch = dynamic_batch and gm.dynamic_batch
    ep, xs = _program(gm, dynamic_batch)
    try:
        prog = torch.onnx.export(ep, xs, input_names=gm.input_names, output_names=gm.output_names,
                                 opset_version=opset, dynamo=True, verbose=False)
    except Exception as e:  # noqa: BLE001  (name the op ONNX could not express)
        raise NetError(f"Net '{gm.net_name}' cannot be written as ONNX opset {opset}: "
                       f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    prog.save(os.fspath(out))
    return prog
