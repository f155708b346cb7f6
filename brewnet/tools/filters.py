"""``brewnet filters --model M --weights W --blob conv2 --images N --out DIR``: for every channel
of a convolution or InnerProduct blob, the 9 patches of N test images that activate it most, cut
at the unit's receptive field (``brewnet.analysis.filters``): a 3 x 3 grid per channel and one
overview PNG; memory stays flat in N."""
from __future__ import annotations

import logging
from pathlib import Path

from .common import USER_ERRORS, add_gpu_flag, progress_bar, report, trained_net

COMMAND = "filters"
HELP = "show what each channel of a blob responds to: its 9 strongest input patches"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="a net with a TEST data layer")
    p.add_argument("--weights", "-weights", required=True, metavar="W")
    p.add_argument("--blob", "-blob", required=True, help="a convolution or InnerProduct output")
    p.add_argument("--images", type=int, default=1000, metavar="N", help="images to scan (default 1000)")
    p.add_argument("--out", "-out", required=True, metavar="DIR")
    add_gpu_flag(p)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.images < 1:
        return report(COMMAND, f"--images must be at least 1, got {args.images}")
    try:
        from ..analysis.features import check_blobs
        from ..analysis.filters import save_grids, scan

        net = trained_net(args, COMMAND)
        check_blobs(net, [args.blob])
        if not any(not b for b in net.bottom_lists) or net.inputs:
            raise ValueError(f"{args.model}: filters scans the net's own TEST data; it needs a data "
                             "layer (Data, ImageData, HDF5Data...), not Input blobs")
        with progress_bar(args.images, desc="filters") as bar:
            top = scan(net, args.blob, args.images, bar.update if bar is not None else None)
        written = save_grids(top, Path(args.out), args.blob)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    log.info("Scanned %d images; wrote %d pictures to %s", top.seen, len(written), args.out)
    return 0
