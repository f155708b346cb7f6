"""``brewnet extract --model M --weights W --blobs fc7,prob --iterations N --out F``: Caffe's
``extract_features`` (and owl's FeatureExtractor): N forwards of the TEST net over its own data,
the chosen blobs written as they come to F (``.npy``, ``.h5``, ``.lmdb`` in Caffe's format, or
``.txt``; see ``brewnet.analysis.features``), labels alongside; memory stays flat in N."""
from __future__ import annotations

import logging

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

        net = trained_net(args, COMMAND)
        blobs = [b for b in args.blobs.split(",") if b]
        check_blobs(net, blobs)
        plan_beside(net.layer_list)
        batch = net.blobs[blobs[0]].shape[0]
        writer = FeatureWriter(args.out, blobs, args.iterations * batch)
        log.info("Extracting features of %d batches of %d", args.iterations, batch)
        with progress_bar(args.iterations, desc="extract") as bar:
            for feats, labels in batches(net, blobs, args.iterations, args.label_blob):
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
