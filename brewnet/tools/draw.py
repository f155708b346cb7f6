"""``brewnet draw NET.prototxt OUT.(png|svg|pdf|dot) [--rankdir LR] [--phase TRAIN|TEST]``:
pycaffe's ``draw_net.py`` (the drawing is ``brewnet.pycaffe.draw``; Graphviz renders it)."""
from __future__ import annotations

COMMAND = "draw"
HELP = "draw a net as a graph of layers and blobs (Graphviz): png, svg, pdf, or dot text"


def add_arguments(p) -> None:
    p.add_argument("model", help="network .prototxt")
    p.add_argument("output", help="image to write; its extension picks the format")
    p.add_argument("--rankdir", "-rankdir", default="LR", choices=["LR", "RL", "TB", "BT"],
                   help="direction of the layout (default LR: left to right)")
    p.add_argument("--phase", "-phase", default="ALL", choices=["TRAIN", "TEST", "ALL"],
                   help="draw only the layers of this phase (default: all layers)")
    p.add_argument("--display-lrm", "--display_lrm", action="store_true",
                   help="show the lr multipliers of learnable layers")


def run(args) -> int:
    from ..proto import caffe_pb2 as pb
    from ..proto.io import read_net
    from ..pycaffe.draw import DrawError, draw_net_to_file
    from .common import USER_ERRORS, report

    try:
        net = read_net(args.model)
        phase = None if args.phase == "ALL" else getattr(pb, args.phase)
        draw_net_to_file(net, args.output, args.rankdir, phase, args.display_lrm)
    except (DrawError, *USER_ERRORS) as e:
        return report(COMMAND, e)
    print(f"Drawing net to {args.output}")
    return 0
