"""owl's own snapshot folders (``<snapshot_prefix>/snapshot<k>/<layer>_weights.dat``...), read
into brewnet's nets, so an owl user's trained models carry over.

Minerva wrote each Convolution and InnerProduct layer as raw float32 files (``/`` in a layer
name becomes ``_``): ``_weights.dat``, ``_bias.dat`` and the momentum ``_weightdelta.dat``,
``_biasdelta.dat``. The layouts, as Minerva's own ``scripts/modelconvertor/minerva2caffe.py``
converts them: a convolution's filters are Caffe's (num_output, channels, k, k) turned by 180
degrees (Minerva convolves, Caffe correlates); an InnerProduct's weights are Caffe's transposed,
(input, num_output). owl's update was ``delta = momentum * delta - lr * (grad + decay * w)``,
``w += delta``: Caffe's SGD history with the sign flipped.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("brewnet")
OWL_TYPES = ("Convolution", "InnerProduct")


def _read(path: Path, shape, kind: str) -> np.ndarray | None:
    """A Caffe-layout array of ``shape`` from owl's file (None: missing or of another size)."""
    if not path.exists():
        return None
    a = np.fromfile(path, dtype=np.float32)
    if a.size != int(np.prod(shape)):
        log.warning("%s holds %d values; the layer needs %s", path, a.size, tuple(shape))
        return None
    if kind == "weights" and len(shape) == 4:
        return a.reshape(shape)[:, :, ::-1, ::-1].copy()        # Minerva's filters, turned back
    if kind == "weights":
        return a.reshape(shape[1], shape[0]).T.copy()            # (input, num_output) -> Caffe's
    return a.reshape(shape)


def load_owl_folder(folder: Path, net, solver=None) -> list[str]:
    """Copy owl's files in ``folder`` into ``net``'s Convolution and InnerProduct layers (and,
    for an SGD ``solver`` training ``net``, its history from the deltas); returns the layers
    with parameters left as they were (owl's "Weight Need Reinit")."""
    reinit = []
    where = {id(t): i for i, t in enumerate(net.learnable)}
    sgd = solver is not None and solver.solver_type == "SGD"
    for layer in net.layer_list:
        if not layer.blobs:
            continue
        stem = folder / layer.name.replace("/", "_")
        names = ("weights", "bias")[:len(layer.blobs)]
        got = [_read(Path(f"{stem}_{n}.dat"), tuple(b.shape), n) for n, b in zip(names, layer.blobs)]
        if layer.type not in OWL_TYPES or any(g is None for g in got):
            reinit.append(layer.name)
            continue
        with torch.no_grad():
            for blob, value, n in zip(layer.blobs, got, names):
                blob.copy_(torch.from_numpy(value).reshape(blob.shape))
                delta = _read(Path(f"{stem}_{n}delta.dat"), tuple(blob.shape), n) if sgd else None
                if delta is not None and id(blob) in where:
                    solver.history[where[id(blob)]].copy_(torch.from_numpy(-delta).reshape(blob.shape))
    return reinit


__all__ = ["load_owl_folder"]
