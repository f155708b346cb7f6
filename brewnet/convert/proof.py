"""Writing the converted net and proving it: the prototxt and caffemodel are loaded back in
brewnet, run on the example inputs, and every output (with ``compare="layers"`` every mapped
intermediate) is compared with the source model's values; a difference beyond the tolerance
(relative to each output's largest magnitude) fails, naming the first layer that diverges."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from ..proto.io import write_binary, write_text
from .dialects import foreign_fields
from .graph import ConversionError

log = logging.getLogger("brewnet")
TOLERANCE = 1e-4


@dataclasses.dataclass
class Comparison:
    """What a conversion wrote and how close the written net is to the source model."""
    prototxt: str
    caffemodel: str
    dialect: str
    layers: int                      # layers written
    outputs: list                    # (blob, max |diff|, scale, relative)
    intermediates: list              # (layer, blob, max |diff|, scale, relative), compare="layers"
    tolerance: float = TOLERANCE
    seconds: float = 0.0

    @property
    def worst(self) -> float:
        return max((r for *_, r in self.outputs), default=0.0)

    @property
    def passed(self) -> bool:
        return self.worst <= self.tolerance

    def __str__(self) -> str:
        lines = [f"{self.prototxt}: {self.layers} layers ({self.dialect})"]
        lines += [f"  {'layer' if len(row) == 5 else 'output'} {row[0]}: max |diff| {row[-3]:.3g} "
                  f"(relative {row[-1]:.3g} of {row[-2]:.3g})" for row in self.intermediates + self.outputs]
        return "\n".join(lines)


def _diff(got: np.ndarray, want: np.ndarray) -> tuple:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.size != want.size:
        return float("inf"), 1.0, float("inf")
    d = float(np.abs(got.reshape(want.shape) - want).max()) if want.size else 0.0
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-12)
    return d, scale, d / scale


def write(writer, prefix) -> tuple[str, str]:
    net = writer.net
    bad = foreign_fields(net, writer.dialect)
    if bad:
        raise ConversionError(f"internal: fields outside BVLC Caffe 1.0's schema: {', '.join(bad[:5])}")
    prefix = os.fspath(prefix)
    if os.path.dirname(prefix):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
    proto, model = prefix + ".prototxt", prefix + ".caffemodel"
    text = type(net)()
    text.CopyFrom(net)
    for lp in text.layer:
        del lp.blobs[:]
    write_text(proto, text)
    write_binary(model, net)
    return proto, model


def prove(writer, proto: str, model: str, inputs: list, reference: dict, compare: str = "outputs",
          tolerance: float = TOLERANCE, started: float | None = None) -> Comparison:
    """Run the written files in brewnet on ``inputs`` and compare with ``reference`` (graph value
    -> array). Raises ConversionError naming the first diverging layer when an output is off."""
    import torch

    from ..net import Net

    net = Net(proto, weights=model)
    for name, x in zip(net.inputs, inputs):
        net.blobs[name].tensor.copy_(torch.as_tensor(np.asarray(x), dtype=torch.float32))
    with torch.no_grad():
        net.forward_tensors()
    got = {b: net.blobs[b].tensor.detach().cpu().numpy() for b in net.blobs}
    outputs = []
    for v in writer.g.outputs:
        blob = writer.blob[v]
        outputs.append((blob, *_diff(got[blob], reference[v])))
    inter = []
    if compare == "layers" or any(r > tolerance for *_, r in outputs):
        seen = set()
        for v, blob, layer in writer.mapped:
            if blob in seen or v not in reference or blob not in got:
                continue
            seen.add(blob)
            inter.append((layer, blob, *_diff(got[blob], reference[v])))
    res = Comparison(proto, model, writer.dialect, len(writer.net.layer), outputs,
                     inter if compare == "layers" else [], tolerance,
                     time.perf_counter() - started if started else 0.0)
    for blob, d, scale, rel in outputs:
        log.info("output %s: max |diff| %.3g (relative %.3g of %.3g)", blob, d, rel, scale)
    if not res.passed:
        first = next((row for row in inter if row[-1] > tolerance), None)
        where = f"; the first layer that diverges is '{first[0]}' (relative {first[-1]:.3g})" \
            if first else ""
        raise ConversionError(f"{proto}: the written net differs from the source model by "
                              f"{res.worst:.3g} relative (tolerance {tolerance:g}){where}")
    return res
