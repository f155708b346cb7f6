"""``brewnet extract --model M --weights W --blobs fc7,prob --iterations N --out F``: Caffe's
``extract_features`` (and owl's FeatureExtractor): N forwards of the TEST net over its own data,
the chosen blobs written as they come to F (``.npy``, ``.h5``, ``.lmdb`` in Caffe's format, or
``.txt``; see ``brewnet.analysis.features``), labels alongside; memory stays flat in N."""
from __future__ import annotations

import logging
import os

from ..execution.threads import plan_beside
from .common import (
    USER_ERRORS,
    add_gpu_flag,
    add_net_state_flags,
    progress_bar,
    report,
    trained_net,
)

COMMAND = "extract"
HELP = "extract features: write chosen blobs of N test batches to .npy, .h5, .lmdb or .txt"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the net definition (.prototxt)")
    p.add_argument("--weights", "-weights", required=True, metavar="W", help="trained weights")
    p.add_argument("--blobs", "-blobs", required=True, metavar="A,B", help="blobs to save, separated by ','")
    p.add_argument("--iterations", "-iterations", type=int, default=1, metavar="N",
                   help="number of batches (default 1)")
    p.add_argument("--out", "-out", required=True, metavar="F",
                   help="output: F.npy, F.h5, F.lmdb or F.txt (one file or database per blob but .h5)")
    p.add_argument("--label-blob", default="label", help="the blob holding the labels (default: label)")
    p.add_argument("--engine", default=None, metavar="E",
                   help="what runs the layers after the data layers: eager (default, or "
                        "BREWNET_ENGINE: the net's own blobs bit for bit), auto, onnxruntime, openvino, "
                        "opencv, compiled (as a deploy net: within float rounding; docs/deploy.md)")
    add_gpu_flag(p)
    add_net_state_flags(p)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.iterations < 1:
        return report(COMMAND, f"--iterations must be at least 1, got {args.iterations}")
    writer = None
    try:
        from ..analysis.features import FeatureWriter, batches, check_blobs
        from ..execution import engines

        net = trained_net(args, COMMAND)
        blobs = [b for b in args.blobs.split(",") if b]
        check_blobs(net, blobs)
        plan_beside(net.layer_list)
        batch = net.blobs[blobs[0]].shape[0]
        writer = FeatureWriter(args.out, blobs, args.iterations * batch)
        log.info("Extracting features of %d batches of %d", args.iterations, batch)
        # eager unless asked: the features written are the net's own blobs, bit for bit
        engine = (engines.engine_name(args.engine, "--engine") if args.engine
                  else engines.engine_name(None) if os.environ.get("BREWNET_ENGINE") else "eager")
        feed = (batches(net, blobs, args.iterations, args.label_blob) if engine == "eager"
                else engine_batches(net, blobs, args.iterations, args.label_blob, engine))
        with progress_bar(args.iterations, desc="extract") as bar:
            for feats, labels in feed:
                writer.write(feats, labels)
                if bar is not None:
                    bar.update(1)
        written = writer.close()
    except USER_ERRORS as e:
        if writer is not None:
            writer.close()
        return report(COMMAND, e)
    for b in blobs:
        log.info("Extracted features of %d query images for feature blob %s", writer.n, b)
    log.info("Wrote %s", ", ".join(str(p) for p in written))
    log.info("Successfully extracted the features!")
    return 0


def engine_batches(net, blobs: list[str], iterations: int, label_blob: str | None, engine: str):
    """``batches``, with the layers after the data layers as a deploy net on ``engine``
    (brewnet/execution/engines.py): the data layers run in ``net``, their tops feed it. A net
    that does not start with data layers runs as ``batches`` does."""
    import torch

    from ..analysis.features import batches
    from ..deploy.surgery import after_data
    from ..pycaffe import Net

    part, last = after_data(net, blobs)
    if part is None:
        yield from batches(net, blobs, iterations, label_blob)
        return
    feats_net = Net(part, 1, engine=engine)
    feats_net.share_with(net)
    sources = feats_net.inputs
    label_blob = label_blob if label_blob in net.blobs else None
    with torch.no_grad():
        for _ in range(iterations):
            net.forward_tensors(0, last)
            for s in sources:        # the data layer's tensor as it is (its memory layout too)
                feats_net.blobs[s].write(net.blobs[s].tensor.detach())
            feats_net.forward()
            feats = {b: feats_net.blobs[b].data.astype("float32", copy=True) for b in blobs}
            labels = (net.blobs[label_blob].tensor.detach().cpu().numpy().reshape(-1).copy()
                      if label_blob else None)
            yield feats, labels
