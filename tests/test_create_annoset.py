"""``brewnet create-annoset``: VOC XML, CSV and JSON boxes -> AnnotatedDatum LMDB records as
SSD's create_annoset writes them (groups by label in order of appearance, instance ids within
a group, boxes normalised by the image size, encoded image bytes), the label map, and bad
inputs as one-line errors naming the record."""
from __future__ import annotations

import json
import re

import cv2
import numpy as np
import pytest
from google.protobuf import text_format

from brewnet import cli
from brewnet.data.db import open_db
from brewnet.proto import caffe_pb2 as pb

VOC = """<annotation><filename>{name}</filename>
<size><width>{w}</width><height>{h}</height><depth>3</depth></size>
{objects}</annotation>"""
OBJ = """<object><name>{label}</name><difficult>{diff}</difficult>
<bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"""


def _image(path, w=40, h=30):
    cv2.imwrite(str(path), np.full((h, w, 3), 77, np.uint8))
    return path


def _records(db):
    out = []
    for k, v in open_db(db).items():
        ad = pb.AnnotatedDatum()
        ad.ParseFromString(v)
        out.append((k.decode(), ad))
    return out


def _groups(ad):
    return [(g.group_label, [(a.instance_id, round(a.bbox.xmin, 6), round(a.bbox.ymin, 6),
                              round(a.bbox.xmax, 6), round(a.bbox.ymax, 6), a.bbox.difficult)
                             for a in g.annotation]) for g in ad.annotation_group]


def test_voc_list_groups_and_normalises(tmp_path):
    _image(tmp_path / "a.jpg")
    objs = [dict(label="dog", diff=0, x0=4, y0=3, x1=20, y1=15), dict(label="cat", diff=1, x0=0, y0=0, x1=40, y1=30),
            dict(label="dog", diff=0, x0=10, y0=6, x1=30, y1=24)]
    (tmp_path / "a.xml").write_text(VOC.format(name="a.jpg", w=40, h=30,
                                               objects="".join(OBJ.format(**o) for o in objs)))
    (tmp_path / "list.txt").write_text("a.jpg a.xml\n")
    lm = tmp_path / "labelmap.prototxt"
    assert cli.main(["create-annoset", str(tmp_path / "list.txt"), str(tmp_path / "db"),
                     "--label-map", str(lm), "--root-folder", f"{tmp_path}/"]) == 0
    labels = text_format.Parse(lm.read_text(), pb.LabelMap())
    assert [(i.name, i.label) for i in labels.item] == [("none_of_the_above", 0), ("cat", 1), ("dog", 2)]
    [(key, ad)] = _records(tmp_path / "db")
    assert key == "00000000_a.jpg" and ad.type == pb.AnnotatedDatum.BBOX and ad.datum.encoded
    assert ad.datum.data == (tmp_path / "a.jpg").read_bytes()
    assert _groups(ad) == [(2, [(0, 0.1, 0.1, 0.5, 0.5, False), (1, 0.25, 0.2, 0.75, 0.8, False)]),
                           (1, [(0, 0.0, 0.0, 1.0, 1.0, True)])]


def test_csv_and_json_with_a_given_label_map(tmp_path):
    for n in ("x.png", "y.png"):
        _image(tmp_path / n)
    lm = tmp_path / "lm.prototxt"
    lm.write_text('item { name: "bg" label: 0 } item { name: "car" label: 3 } item { name: "bus" label: 5 }')
    (tmp_path / "b.csv").write_text("image,label,xmin,ymin,xmax,ymax\nx.png,bus,0,0,20,15\n"
                                    "y.png,car,20,15,40,30\nx.png,car,2,3,4,6\n")
    assert cli.main(["create-annoset", str(tmp_path / "b.csv"), str(tmp_path / "db"), "--label-map",
                     str(lm), "--root-folder", f"{tmp_path}/"]) == 0
    recs = _records(tmp_path / "db")
    assert [k for k, _ in recs] == ["00000000_x.png", "00000001_y.png"]
    assert _groups(recs[0][1]) == [(5, [(0, 0, 0, 0.5, 0.5, False)]), (3, [(0, 0.05, 0.1, 0.1, 0.2, False)])]
    items = [{"image": "y.png", "objects": [{"label": "car", "bbox": [20, 15, 40, 30], "difficult": 1}]}]
    (tmp_path / "b.json").write_text(json.dumps(items))
    assert cli.main(["create-annoset", str(tmp_path / "b.json"), str(tmp_path / "db2"), "--label-map",
                     str(lm), "--root-folder", f"{tmp_path}/"]) == 0
    assert _groups(_records(tmp_path / "db2")[0][1]) == [(3, [(0, 0.5, 0.5, 1, 1, True)])]


@pytest.mark.parametrize("case, row, expect", [
    ("outside", "y.png,car,30,10,41,20", r"record 00000001 \(y\.png\): object 0 \('car'\) box "
                                         r"\[30, 10, 41, 20\] lies outside the 40x30 image"),
    ("inverted", "y.png,car,30,10,20,20", r"record 00000001 \(y\.png\): object 0 .*\(or is inverted\)"),
    ("unknown", "y.png,truck,1,1,5,5", r"record 00000001 \(y\.png\): object 0 has label 'truck', which "
                                       r"is not in the label map \(known: bg, car\)"),
    ("missing", "z.png,car,1,1,5,5", r"record 00000001 \(z\.png\): cannot open image .*z\.png"),
    ("not a number", "y.png,car,1,a,5,5", r"b\.csv line 3: xmin, ymin, xmax, ymax must be numbers"),
])
def test_bad_inputs_name_the_record(tmp_path, capsys, case, row, expect):
    _image(tmp_path / "x.png")
    _image(tmp_path / "y.png")
    lm = tmp_path / "lm.prototxt"
    lm.write_text('item { name: "bg" label: 0 } item { name: "car" label: 1 }')
    (tmp_path / "b.csv").write_text(f"image,label,xmin,ymin,xmax,ymax\nx.png,car,1,1,5,5\n{row}\n")
    assert cli.main(["create-annoset", str(tmp_path / "b.csv"), str(tmp_path / "db"), "--label-map",
                     str(lm), "--root-folder", f"{tmp_path}/"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("brewnet create-annoset: ") and "Traceback" not in err
    assert len(err.splitlines()) == 1
    assert re.search(expect, err), err
    assert not (tmp_path / "db").exists()          # the partial database is removed


def test_voc_errors_name_the_annotation_file(tmp_path, capsys):
    _image(tmp_path / "a.jpg")
    (tmp_path / "a.xml").write_text(VOC.format(name="a.jpg", w=40, h=30, objects=OBJ.format(
        label="dog", diff=0, x0=4, y0=3, x1=50, y1=15)))
    (tmp_path / "b.xml").write_text("<annotation><object>")
    (tmp_path / "list.txt").write_text("a.jpg a.xml\n")
    lm = tmp_path / "lm.prototxt"
    lm.write_text('item { name: "bg" label: 0 } item { name: "dog" label: 1 }')
    args = ["create-annoset", str(tmp_path / "list.txt"), str(tmp_path / "db"), "--label-map", str(lm),
            "--root-folder", f"{tmp_path}/"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "record 00000000 (a.jpg), " in err and "a.xml (list line 1)" in err and "outside the 40x30" in err
    (tmp_path / "list.txt").write_text("a.jpg b.xml\n")
    assert cli.main(args) == 1
    assert "b.xml: cannot read the VOC annotation" in capsys.readouterr().err
