"""``brewnet shapes NET.prototxt``: every blob's shape, each layer's params and FLOPs, totals.
``--allow-unknown`` prints them up to the first layer of a type brewnet does not know."""
from __future__ import annotations

import sys

COMMAND = "shapes"
HELP = "print every blob's shape, each layer's parameter count and FLOPs, and totals"


def add_arguments(p) -> None:
    p.add_argument("model", help="network .prototxt")
    p.add_argument("--phase", "-phase", default="TEST", choices=["TRAIN", "TEST"])
    p.add_argument("--level", "-level", type=int, default=0)
    p.add_argument("--stage", "-stage", default="", help="comma-separated stages")
    p.add_argument("--allow-unknown", action="store_true",
                   help="stop at the first layer of an unknown type instead of failing, and print "
                        "the shapes up to it")


def run(args) -> int:
    from ..analysis.summary import format_table
    from ..net import Net
    from ..proto.filter import filter_net, make_state
    from ..proto.io import read_net

    phase = 0 if args.phase == "TRAIN" else 1
    stages = [s for s in args.stage.split(",") if s]
    model, stopped = args.model, None
    if args.allow_unknown:
        model, stopped = _up_to_unknown(filter_net(read_net(args.model), make_state(phase, args.level, stages)))
    net = Net(model, phase, level=args.level, stages=stages)
    print(format_table(net))
    if stopped is not None:
        print(f"{args.model}: layer '{stopped.name}' (type {stopped.type}) and the layers after it "
              "are not shown: brewnet has no layer of that type", file=sys.stderr)
    return 0


def _up_to_unknown(param):
    """``param`` cut before its first layer of an unregistered type, and that layer (None: none)."""
    from ..layers.base import LayerError
    from ..layers.registry import layer_class

    for i, lp in enumerate(param.layer):
        try:
            layer_class(lp.type, lp.name)
        except LayerError:
            del param.layer[i:]
            return param, lp
    return param, None
