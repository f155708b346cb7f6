"""``brewnet compute-mean INPUT_DB [OUTPUT_FILE]``: per-pixel mean of a Datum database.

Caffe's ``compute_image_mean``: writes a BlobProto (1 x C x H x W) and logs the per-channel means.
"""
from __future__ import annotations

import sys

from .common import log_to_stderr

COMMAND = "compute-mean"
HELP = "compute the mean image of an LMDB/LevelDB of Datums into a .binaryproto"


def add_arguments(p) -> None:
    p.add_argument("db", metavar="INPUT_DB", help="LMDB (or LevelDB) of Datums")
    p.add_argument("output", metavar="OUTPUT_FILE", nargs="?", help="mean .binaryproto to write")
    p.add_argument("--backend", default=None, choices=["lmdb", "leveldb"],
                   help="database kind (default: what the path holds)")


def run(args) -> int:
    from ..data.convert import compute_mean
    from ..data.db import DBError
    from ..proto.errors import ProtoError

    log_to_stderr()
    try:
        mean = compute_mean(args.db, args.output, backend=args.backend)
    except (DBError, ProtoError, ValueError, OSError) as e:
        print(f"brewnet compute-mean: {e}", file=sys.stderr)
        return 1
    print(f"Mean of {args.db}: shape {tuple(mean.shape)}"
          + (f", written to {args.output}" if args.output else " (no OUTPUT_FILE given: not written)"))
    return 0
