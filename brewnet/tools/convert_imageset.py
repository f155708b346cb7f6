"""``brewnet convert-imageset ROOTFOLDER/ LISTFILE DB_NAME``: images -> LMDB of Datums.

Caffe's ``convert_imageset`` with the same flags; the work is ``brewnet.data.convert``.
"""
from __future__ import annotations

import sys

from .common import add_bool, log_to_stderr

COMMAND = "convert-imageset"
HELP = "convert a list of images ('path label' lines) into an LMDB/LevelDB of Datums"


def add_arguments(p) -> None:
    p.add_argument("root", metavar="ROOTFOLDER/", help="folder the list's paths are relative to "
                   "(joined as a string, as Caffe does: end it with '/')")
    p.add_argument("list_file", metavar="LISTFILE", help="text file, one 'relative/path label' per line")
    p.add_argument("db", metavar="DB_NAME", help="database to create")
    add_bool(p, "gray", "read images as grayscale")
    add_bool(p, "shuffle", "shuffle the order of images and their labels")
    p.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"], help="database kind (lmdb)")
    p.add_argument("--resize_width", type=int, default=0, help="resize images to this width (0: keep)")
    p.add_argument("--resize_height", type=int, default=0, help="resize images to this height (0: keep)")
    add_bool(p, "check_size", "check that all the images have the same size")
    add_bool(p, "encoded", "store the encoded image (JPEG/PNG bytes) in the Datum")
    p.add_argument("--encode_type", default="", help="re-encode images as this type ('png', 'jpg', ...)")


def run(args) -> int:
    from ..data.convert import ListError, convert_imageset
    from ..data.db import DBError

    log_to_stderr()
    try:
        stats = convert_imageset(args.root, args.list_file, args.db, gray=args.gray,
                                 shuffle=args.shuffle, backend=args.backend,
                                 resize_height=args.resize_height, resize_width=args.resize_width,
                                 check_size=args.check_size, encoded=args.encoded,
                                 encode_type=args.encode_type)
    except (ListError, DBError, ValueError, OSError) as e:
        print(f"brewnet convert-imageset: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {stats['written']} images to {args.db}"
          + (f" ({len(stats['skipped'])} unreadable, skipped)" if stats["skipped"] else ""))
    return 0
