"""``brewnet heatmap --model M --weights W --blob conv5 --out DIR [--images A.jpg,B.png]``:
owl's class-agnostic heatmaps (``brewnet.analysis.heatmap``): one PNG per image (input,
heatmap, overlay) and a contact sheet. Images come from the TEST net's data layer
(``--iterations`` batches), or, for a deploy net, from files prepared as pycaffe's classify.py
does (``--mean B,G,R``, ``--raw-scale``)."""
from __future__ import annotations

import logging
from pathlib import Path

from .common import USER_ERRORS, add_gpu_flag, report, single_device

COMMAND = "heatmap"
HELP = "draw where a blob responds in each image (owl's heatmaps): PNGs and a contact sheet"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M")
    p.add_argument("--weights", "-weights", required=True, metavar="W")
    p.add_argument("--blob", "-blob", required=True, help="a N x C x H x W blob, e.g. conv5")
    p.add_argument("--out", "-out", required=True, metavar="DIR")
    p.add_argument("--images", default="", help="image files separated by ',' (a deploy net)")
    p.add_argument("--iterations", type=int, default=1, help="data-layer batches (default 1)")
    p.add_argument("--mean", default="", help="per-channel mean for --images, e.g. 104,117,123")
    p.add_argument("--raw-scale", type=float, default=255.0)
    add_gpu_flag(p)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    try:
        from .. import runtime
        from ..analysis.features import check_blobs
        from ..analysis.heatmap import from_files, from_net, save_pictures
        from ..net import Net
        from ..proto import caffe_pb2 as pb
        from ..weights import load_weights

        device = single_device(args.gpu, COMMAND)
        runtime.configure(device)
        net = Net(args.model, pb.TEST, device=device)
        check_blobs(net, [args.blob])
        if len(net.shapes[args.blob]) != 4:
            raise ValueError(f"blob '{args.blob}' has shape {net.shapes[args.blob]}; a heatmap needs "
                             "an N x C x H x W blob (a convolution or pooling output)")
        load_weights(net, args.weights, require_match=True)
        images = [s for s in args.images.split(",") if s]
        if images:
            if not net.inputs:
                raise ValueError(f"{args.model}: --images needs a net with an Input layer (a deploy net)")
            mean = [float(v) for v in args.mean.split(",")] if args.mean else None
            pairs = from_files(net, args.blob, images, mean, args.raw_scale)
        else:
            if not any(not b for b in net.bottom_lists):
                raise ValueError(f"{args.model}: no data layer; give --images")
            pairs = from_net(net, args.blob, args.iterations)
        written = save_pictures(pairs, Path(args.out), args.blob)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    log.info("Wrote %d pictures to %s", len(written), args.out)
    return 0
