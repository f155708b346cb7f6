"""``brewnet upgrade-net IN OUT``: rewrite a V0/V1/old-style net in the current format.

Counterpart of Caffe's ``upgrade_net_proto_text`` / ``upgrade_net_proto_binary``.
"""
from __future__ import annotations

import sys

COMMAND = "upgrade-net"
HELP = "upgrade a legacy net prototxt (or, with --binary, a caffemodel) to the current format"


def add_arguments(p) -> None:
    p.add_argument("input", help="legacy .prototxt (or .caffemodel with --binary)")
    p.add_argument("output", help="where to write the upgraded net")
    p.add_argument("--binary", "-binary", action="store_true",
                   help="read and write binary NetParameter (caffemodel) files")


def run(args) -> int:
    from ..proto.errors import ProtoError
    from ..proto.io import upgrade_net_file

    try:
        upgrade_net_file(args.input, args.output, binary=args.binary)
    except (ProtoError, OSError) as e:
        print(f"brewnet upgrade-net: {e}", file=sys.stderr)
        return 1
    print(f"Wrote upgraded NetParameter to {args.output}")
    return 0
