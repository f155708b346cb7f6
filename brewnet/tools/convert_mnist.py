"""``brewnet convert-mnist IMAGES LABELS DB``: MNIST-style idx files -> LMDB of Datums.

Caffe's ``examples/mnist/convert_mnist_data``; idx files may be gzipped. Keys ``%08d``.
"""
from __future__ import annotations

import sys

from .common import log_to_stderr

COMMAND = "convert-mnist"
HELP = "convert MNIST idx image/label files (gzipped or not) into an LMDB/LevelDB of Datums"


def add_arguments(p) -> None:
    p.add_argument("images", help="idx3 image file, e.g. train-images-idx3-ubyte[.gz]")
    p.add_argument("labels", help="idx1 label file, e.g. train-labels-idx1-ubyte[.gz]")
    p.add_argument("db", help="database to create, e.g. mnist_train_lmdb")
    p.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"], help="database kind (lmdb)")


def run(args) -> int:
    from ..data.convert import convert_mnist
    from ..data.db import DBError

    log_to_stderr()
    try:
        n = convert_mnist(args.images, args.labels, args.db, backend=args.backend)
    except (DBError, ValueError, OSError) as e:
        print(f"brewnet convert-mnist: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {n} records to {args.db}")
    return 0
