"""``brewnet create-annoset SOURCE DB_NAME --label-map labelmap.prototxt``: images and boxes ->
an LMDB of AnnotatedDatum records for SSD's AnnotatedData layer (the fork's create_annoset).

SOURCE is a list file of 'image annotation' lines (Pascal VOC .xml or .json annotations), a
.csv of boxes (image,label,xmin,ymin,xmax,ymax[,difficult]) or a .json list of
{image, objects}; see ``brewnet.data.annoset``. An existing --label-map names the classes (a
label it lacks is an error); a missing one is written, background 0 and the names sorted.
"""
from __future__ import annotations

import os

from .common import add_bool, log_to_stderr, report

COMMAND = "create-annoset"
HELP = "convert images with boxes (VOC XML, CSV, JSON) into an LMDB of AnnotatedDatum (SSD)"


def add_arguments(p) -> None:
    p.add_argument("source", metavar="SOURCE", help="list file, .csv or .json of boxes")
    p.add_argument("db", metavar="DB_NAME", help="database to create")
    p.add_argument("--label-map", "--label_map_file", required=True, metavar="FILE",
                   help="LabelMap prototxt: read if it exists, else written from the labels found")
    p.add_argument("--root-folder", "--root_folder", default="",
                   help="prefix of the image and annotation paths (joined as a string)")
    add_bool(p, "gray", "read images as grayscale (to check their size)")
    add_bool(p, "shuffle", "shuffle the order of the records")
    p.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"], help="database kind")


def run(args) -> int:
    from google.protobuf import text_format

    from ..data.annoset import _read_anno, create_annoset, label_map_from, read_sources
    from ..data.annotated import read_label_map

    log_to_stderr()
    try:
        sources = read_sources(args.source, args.root_folder)
        if os.path.exists(args.label_map):
            label_map = read_label_map(args.label_map)
        else:
            names = {o[0] for _, _, objs in sources for o in objs if o[0] != "__file__"}
            for _, _, objs in sources:
                if objs and objs[0][0] == "__file__":
                    names |= {o[0] for o in _read_anno(objs[0][1])[0]}
            label_map = label_map_from(names)
            with open(args.label_map, "w") as f:
                f.write(text_format.MessageToString(label_map))
            print(f"Wrote the label map of {len(label_map.item)} labels to {args.label_map}")
        n = create_annoset(sources, args.db, label_map, gray=args.gray, shuffle=args.shuffle,
                           backend=args.backend)
    except (ValueError, OSError) as e:
        return report(COMMAND, e)
    print(f"Wrote {n} annotated images to {args.db}")
    return 0
