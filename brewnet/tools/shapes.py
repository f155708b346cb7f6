"""``brewnet shapes NET.prototxt``: every blob's shape, each layer's params and FLOPs, totals."""
from __future__ import annotations

COMMAND = "shapes"
HELP = "print every blob's shape, each layer's parameter count and FLOPs, and totals"


def add_arguments(p) -> None:
    p.add_argument("model", help="network .prototxt")
    p.add_argument("--phase", "-phase", default="TEST", choices=["TRAIN", "TEST"])
    p.add_argument("--level", "-level", type=int, default=0)
    p.add_argument("--stage", "-stage", default="", help="comma-separated stages")


def run(args) -> int:
    from ..analysis.summary import format_table
    from ..net import Net

    net = Net(args.model, 0 if args.phase == "TRAIN" else 1, level=args.level,
              stages=[s for s in args.stage.split(",") if s])
    print(format_table(net))
    return 0
