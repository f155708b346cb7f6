"""``brewnet heatmap --model M --weights W --blob conv5 --out DIR [--images A.jpg,B.png]``:
owl's class-agnostic heatmaps (``brewnet.analysis.heatmap``): one PNG per image (input,
heatmap, overlay) and a contact sheet. Images come from the TEST net's data layer
(``--iterations`` batches), or, for a deploy net, from files prepared as pycaffe's classify.py
does (``--mean B,G,R``, ``--raw-scale``)."""
from __future__ import annotations

import logging
from pathlib import Path

from .common import USER_ERRORS, add_gpu_flag, report, trained_net

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
        from ..analysis.features import check_blobs
        from ..analysis.heatmap import from_net, save_pictures

        net = trained_net(args, COMMAND)
        check_blobs(net, [args.blob])
        if len(net.shapes[args.blob]) != 4:
            raise ValueError(f"blob '{args.blob}' has shape {net.shapes[args.blob]}; a heatmap needs "
                             "an N x C x H x W blob (a convolution or pooling output)")
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


def from_files(net, blob: str, paths, mean=None, raw_scale: float = 255.0, channel_swap=(2, 1, 0)):
    """Yield (RGB image, heatmap) for image files through a deploy net, prepared as pycaffe's
    classify.py does (resize to the input, RGB->BGR, [0, 255], per-channel mean subtracted)."""
    import numpy as np
    import torch

    from ..analysis.heatmap import heatmap
    from ..pycaffe import io

    name = net.inputs[0]
    shape = net.blobs[name].shape
    t = io.Transformer({name: (1,) + tuple(shape[1:])})
    t.set_transpose(name, (2, 0, 1))
    if shape[1] == 3:
        t.set_channel_swap(name, channel_swap)
    t.set_raw_scale(name, raw_scale)
    if mean is not None:
        t.set_mean(name, np.asarray(mean, np.float32))
    for path in paths:
        img = io.load_image(str(path), color=shape[1] == 3)
        x = t.preprocess(name, img)
        net.blobs[name].reshape(1, *x.shape)
        net.blobs[name].data[...] = x
        with torch.no_grad():
            net.forward_tensors()
        f = net.blobs[blob].tensor.float().cpu().numpy()[0]
        shown = (io.resize_image(img, shape[2:]) * 255).clip(0, 255).astype(np.uint8)
        yield (shown if shown.ndim == 2 or shown.shape[2] == 3 else shown[:, :, 0]), heatmap(f, shape[2:])
