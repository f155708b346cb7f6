"""PyTorch and ONNX models to Caffe (``prototxt`` + ``caffemodel``), proven layer by layer.

``from_torch(module, example_inputs, prefix)`` traces with ``torch.export``; ``from_onnx(path,
prefix)`` reads the ONNX graph. Both build one ``Graph`` (graph.py), which ``emit.Writer`` maps
to Caffe layers op by op (ops.py, ops_more.py) within a dialect (dialects.py: ``bvlc`` writes
only BVLC Caffe 1.0 layers and fields); proof.py writes the files, runs them in brewnet and
compares with the source model. ``check_torch``/``check_onnx`` list what would not convert.
"""
from __future__ import annotations

import collections
import time

from .graph import DIALECTS, ConversionError, fuse_channel_permutes
from .proof import TOLERANCE, Comparison, prove, write

__all__ = ["from_torch", "from_onnx", "check_torch", "check_onnx", "Comparison", "ConversionError",
           "DIALECTS", "TOLERANCE"]


def _writer(g, dialect, fold_bn=False, input_names=None, name="net", check_only=False):
    from .emit import Writer

    fuse_channel_permutes(g)
    w = Writer(g, dialect, fold_bn=fold_bn, input_names=input_names, name=name, check_only=check_only)
    w.run()
    return w


def _inputs(example_inputs, batch=None):
    """The example inputs as a tuple; with ``batch``, each made ``batch`` samples long: its own
    samples, then again each rolled by one more position along its last axis (so no two samples
    are equal and a layer that mixes samples shows in the proof)."""
    import torch

    xs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if batch is None:
        return xs
    if int(batch) < 1:
        raise ConversionError(f"batch {batch}: expected a positive number")
    out = []
    for x in xs:
        b = x.shape[0]
        out.append(x if b == batch else torch.stack(
            [torch.roll(x[i % b], i // b, dims=-1) for i in range(int(batch))]))
    return tuple(out)


def from_torch(module, example_inputs, prefix, dialect: str = "bvlc", fold_bn: bool = False,
               input_names=None, compare: str = "outputs", tolerance: float = TOLERANCE,
               prove_it: bool = True, batch: int | None = None) -> Comparison:
    """Write ``module`` (in eval mode) as ``prefix.prototxt`` + ``prefix.caffemodel`` and prove it
    on ``example_inputs`` (a tensor or a tuple; their shapes, batch included, are the net's).

    ``dialect``: ``bvlc`` (default), ``ssd`` or ``forks``; ``fold_bn``: BatchNorm folded into the
    convolution before it; ``input_names``: the Input layers' names (default ``data``);
    ``compare``: ``outputs`` or ``layers`` (every mapped intermediate). An op the dialect cannot
    write raises ConversionError naming it, its source line and the dialects that could.
    ``batch``: the written Input's fixed batch (the examples are made that many samples long,
    see _inputs; the net is traced and proven at that batch)."""
    from . import torch_front

    t0 = time.perf_counter()
    xs = _inputs(example_inputs, batch)
    ep = torch_front.export(module, xs)
    g = torch_front.to_graph(ep)
    w = _writer(g, dialect, fold_bn, input_names, type(module).__name__)
    proto, model = write(w, prefix)
    if not prove_it:
        from .proof import Comparison as C

        return C(proto, model, dialect, len(w.net.layer), [], [], tolerance, time.perf_counter() - t0)
    ref = torch_front.reference(ep, xs)
    return prove(w, proto, model, [x.detach().numpy() for x in xs], ref, compare, tolerance, t0)


def from_onnx(path, prefix, dialect: str = "bvlc", fold_bn: bool = False, input_names=None,
              compare: str = "outputs", tolerance: float = TOLERANCE, example_inputs=None,
              prove_it: bool = True, batch: int | None = None) -> Comparison:
    """Write the ONNX model at ``path`` as Caffe files and prove them against onnxruntime on
    ``example_inputs`` (default: a seeded normal sample of each input's shape). ``batch``: the
    inputs' first axis set to it (a symbolic batch is otherwise 1)."""
    from . import onnx_front

    t0 = time.perf_counter()
    model = onnx_front.load(path, batch)
    g = onnx_front.to_graph(model)
    w = _writer(g, dialect, fold_bn, input_names, model.graph.name or "net")
    proto, caffemodel = write(w, prefix)
    if not prove_it:
        return Comparison(proto, caffemodel, dialect, len(w.net.layer), [], [], tolerance,
                          time.perf_counter() - t0)
    xs = onnx_front.example_inputs(g) if example_inputs is None else [x for x in example_inputs]
    ref = onnx_front.reference(model, g, xs, every=True)
    return prove(w, proto, caffemodel, xs, ref, compare, tolerance, t0)


def _report(w) -> list:
    """(op, count, why, dialects that could, source lines) per unsupported op."""
    groups = collections.OrderedDict()
    for op, why, could, source in w.problems:
        row = groups.setdefault((op, why), [0, could, []])
        row[0] += 1
        if source and source not in row[2]:
            row[2].append(source)
    return [(op, n, why, could, srcs) for (op, why), (n, could, srcs) in groups.items()]


def check_torch(module, example_inputs, dialect: str = "bvlc", batch: int | None = None) -> list:
    """The ops of ``module`` that ``dialect`` cannot write: [(op, count, why, could, sources)]."""
    from . import torch_front

    g = torch_front.to_graph(torch_front.export(module, _inputs(example_inputs, batch)))
    return _report(_writer(g, dialect, check_only=True))


def check_onnx(path, dialect: str = "bvlc", batch: int | None = None) -> list:
    from . import onnx_front

    return _report(_writer(onnx_front.to_graph(onnx_front.load(path, batch)), dialect, check_only=True))
