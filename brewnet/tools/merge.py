"""``brewnet merge a.prototxt b.prototxt ... -o merged.prototxt``: nideep's merge of independent
nets onto one copy of their data (``brewnet.merge_nets``): net i's layers, tops and param names
get ``_nidx_%02d``; the data layers are net 0's, and nets whose data layers differ are refused."""
from __future__ import annotations

COMMAND = "merge"
HELP = "merge independent nets over one data copy into one prototxt (nideep's merge_indep_net_spec)"


def add_arguments(p) -> None:
    p.add_argument("nets", nargs="+", metavar="NET", help="net prototxts (train_val, with data layers)")
    p.add_argument("--out", "-o", required=True, metavar="OUT", help="the merged prototxt to write")


def run(args) -> int:
    from ..many.merge import merge_nets
    from ..proto.io import write_text
    from .common import USER_ERRORS, report

    try:
        merged = merge_nets(args.nets, names=list(args.nets))
        write_text(args.out, merged)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    print(f"Merged {len(args.nets)} nets ({len(merged.layer)} layers) into {args.out}")
    return 0
