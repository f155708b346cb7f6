"""``brewnet plot LOG [-o OUT.png]``: the training curves of a Caffe or brewnet log as a PNG.

Three panels against iteration: train outputs with the test losses, the test net's other
outputs (accuracy...), and the learning rate; the losses on a log axis (``--no-log-y``: linear),
where a linear one shows everything after the first few hundred iterations as a flat line.
Parsing is ``brewnet.analysis.logparse`` (Caffe's ``parse_log.py`` rules); drawing uses
matplotlib's Agg canvas, so no display is needed.
"""
from __future__ import annotations

import argparse

COMMAND = "plot"
HELP = "plot train loss, test accuracy/loss and learning rate of a training log to a PNG"


def add_arguments(p) -> None:
    p.add_argument("log", help="a training log (Caffe's or brewnet's stderr)")
    p.add_argument("-o", "--output", default=None, metavar="OUT.png",
                   help="where to write the PNG (default: LOG.png)")
    p.add_argument("--title", default=None, help="figure title (default: the log's file name)")
    p.add_argument("--log-y", action=argparse.BooleanOptionalAction, default=True,
                   help="the loss panel on a log axis (the default; --no-log-y: linear)")


def run(args) -> int:
    import sys

    from ..analysis.logparse import plot_log

    out = args.output or args.log + ".png"
    try:
        plot_log(args.log, out, title=args.title, log_y=args.log_y)
    except (ValueError, OSError) as e:
        print(f"brewnet plot: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {out}")
    return 0
