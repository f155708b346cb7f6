"""``brewnet parse-log LOG [OUTDIR] [--delimiter ,] [--prefix "[s1]"]``: Caffe's ``tools/extra/parse_log.py``.

Writes ``OUTDIR/<log name>.train`` and ``.test``: CSV (excel dialect) with columns NumIters,
Seconds, LearningRate and one per net output, rows as Caffe's script assembles them (see
``brewnet.analysis.logparse``). OUTDIR defaults to the log's folder.
"""
from __future__ import annotations

COMMAND = "parse-log"
HELP = "parse a training log into <log>.train and <log>.test CSV files (Caffe's parse_log.py)"


def add_arguments(p) -> None:
    p.add_argument("log", help="a training log (Caffe's or brewnet's stderr)")
    p.add_argument("output_dir", nargs="?", default=None,
                   help="folder for the CSV files (default: the log's folder)")
    p.add_argument("--delimiter", "-delimiter", default=",", help="column delimiter (default ',')")
    p.add_argument("--prefix", "-prefix", default=None, metavar="P",
                   help="only the lines of the solver whose messages start with P ('[s1]' in a "
                        "log of several solvers trained together)")
    p.add_argument("--verbose", "-verbose", action="store_true", help="print the files written")


def run(args) -> int:
    import os
    import sys

    from ..analysis.logparse import parse_log, save_csv_files

    out_dir = args.output_dir or os.path.dirname(os.path.abspath(args.log))
    if len(args.delimiter) != 1:
        print(f"brewnet parse-log: --delimiter must be one character, got {args.delimiter!r}",
              file=sys.stderr)
        return 1
    try:
        with open(args.log, "rb") as f:
            head = f.read(8192)
        # A text log has no NUL bytes and decodes; anything else would give empty CSVs.
        if b"\0" in head or head.decode("utf-8", "replace").count("\ufffd") > len(head) // 100:
            print(f"brewnet parse-log: {args.log} is not a text log (binary data); nothing parsed",
                  file=sys.stderr)
            return 1
        train, test = parse_log(args.log, args.prefix)
        if not train and not test:
            where = f" with prefix '{args.prefix}'" if args.prefix else ""
            print(f"brewnet parse-log: {args.log}: no training or test iterations found{where}",
                  file=sys.stderr)
        paths = save_csv_files(args.log, out_dir, train, test, delimiter=args.delimiter)
    except OSError as e:
        print(f"brewnet parse-log: {e}", file=sys.stderr)
        return 1
    if args.verbose:
        for p in paths:
            print(f"Wrote {p}")
    return 0
