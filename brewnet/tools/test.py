"""``brewnet test --model M --weights W --iterations N``: Caffe's ``caffe test``.

Builds the net in the TEST phase (with ``--level``/``--stage``), loads the weights and runs
``iterations`` forward passes; logs each output element per batch (``Batch i, name = v``), then
the mean loss (``Loss: L``) and each output's mean (``name = m``, with ``(* w = l loss)`` for
loss outputs), in Caffe's words and order. The net must read its own data (Data, ImageData,
HDF5Data, DummyData...); Input blobs stay as they are (zeros), as with Caffe.
"""
from __future__ import annotations

import logging

import numpy as np

from .common import USER_ERRORS, add_gpu_flag, add_net_state_flags, report, size_threads, trained_net

COMMAND = "test"
HELP = "score a model: run N test batches and average its outputs (Caffe's 'caffe test')"
log = logging.getLogger("brewnet")
f32 = np.float32


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the net definition (.prototxt)")
    p.add_argument("--weights", "-weights", required=True, metavar="W",
                   help="trained weights (.caffemodel or .caffemodel.h5)")
    p.add_argument("--iterations", "-iterations", type=int, default=50, metavar="N",
                   help="number of batches to run (default 50)")
    add_gpu_flag(p)
    add_net_state_flags(p)


def score(net, iterations: int) -> tuple[float, list[tuple[str, float, float]]]:
    """Run ``iterations`` forwards; returns (mean loss, [(output name, loss weight, mean)]),
    logging each batch's values. Sums are float32, as Caffe's."""
    import torch

    loss, sums, names = f32(0), None, []
    weights = net.blob_loss_weights
    with torch.no_grad():
        for i in range(iterations):
            loss += f32(net.forward_tensors().item())
            values = []
            for name in net.outputs:
                flat = net.blobs[name].tensor.detach().reshape(-1).float().cpu().numpy()
                for v in flat:
                    log.info("Batch %d, %s = %g", i, name, v)
                values.append(flat)
                if i == 0:
                    names += [name] * flat.size
            row = np.concatenate(values) if values else np.zeros(0, f32)
            sums = row.copy() if sums is None else sums + row
    loss /= f32(iterations)
    means = (sums / f32(iterations)) if sums is not None else []
    return float(loss), [(n, weights[n], float(m)) for n, m in zip(names, means)]


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.iterations < 1:
        return report(COMMAND, f"--iterations must be at least 1, got {args.iterations}")
    try:
        net = trained_net(args, COMMAND)
        size_threads(net)
        log.info("Running for %d iterations.", args.iterations)
        loss, results = score(net, args.iterations)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    log.info("Loss: %g", loss)
    for name, w, mean in results:
        extra = f" (* {w:g} = {f32(w) * f32(mean):g} loss)" if w else ""
        log.info("%s = %g%s", name, mean, extra)
    return 0
