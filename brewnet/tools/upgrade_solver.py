"""``brewnet upgrade-solver IN OUT``: replace the old ``solver_type`` enum by ``type``.

Counterpart of Caffe's ``upgrade_solver_proto_text``.
"""
from __future__ import annotations

import sys

COMMAND = "upgrade-solver"
HELP = "upgrade a legacy solver prototxt (solver_type enum -> type string) to the current format"


def add_arguments(p) -> None:
    p.add_argument("input", help="legacy solver .prototxt")
    p.add_argument("output", help="where to write the upgraded solver")


def run(args) -> int:
    from ..proto.errors import ProtoError
    from ..proto.io import upgrade_solver_file

    try:
        upgrade_solver_file(args.input, args.output)
    except (ProtoError, OSError) as e:
        print(f"brewnet upgrade-solver: {e}", file=sys.stderr)
        return 1
    print(f"Wrote upgraded SolverParameter to {args.output}")
    return 0
