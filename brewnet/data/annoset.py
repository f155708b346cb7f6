"""SSD's ``create_annoset``: images and their boxes -> an LMDB of AnnotatedDatum records, and
the label map that names the classes.

Inputs (pixel coordinates, as the image is stored): a list file, one ``image annotation`` pair a
line (SSD's ``trainval.txt``), each annotation a Pascal VOC ``.xml`` or a ``.json`` object
``{"objects": [{"label": "cat", "bbox": [xmin, ymin, xmax, ymax], "difficult": 0}, ...]}``; a
``.csv`` of boxes, header ``image,label,xmin,ymin,xmax,ymax[,difficult]``, one row per box; or a
``.json`` list of ``{"image": path, "objects": [...]}``. Boxes are grouped by class and numbered
within it (instance_id) as the fork's ``ReadXMLToAnnotatedDatum`` does, normalised by the image's
size. Records are keyed ``%08d_<image>`` and hold the image file's own bytes (``encoded``). A box
outside the image, a label the map lacks, a missing or undecodable image is an error naming the
record; the partly written database is then removed.
"""
from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import xml.etree.ElementTree as ET

import numpy as np

from ..proto import caffe_pb2 as pb
from .convert import _progress
from .db import open_writer
from .transform import decode_image

log = logging.getLogger("brewnet")


class AnnosetError(ValueError):
    """Bad annotation input; the message names the file and line or record."""


def _objects_json(objs, where: str) -> list[tuple]:
    out = []
    if not isinstance(objs, list):
        raise AnnosetError(f"{where}: 'objects' must be a list of {{label, bbox}} objects")
    for i, o in enumerate(objs):
        try:
            box = [float(v) for v in o["bbox"]]
            if len(box) != 4:
                raise ValueError("bbox needs 4 numbers [xmin, ymin, xmax, ymax]")
            out.append((str(o["label"]), *box, bool(o.get("difficult", 0))))
        except (KeyError, TypeError, ValueError) as e:
            raise AnnosetError(f"{where}: object {i}: {type(e).__name__}: {e}") from None
    return out


def read_voc(path: str) -> tuple[tuple[int, int] | None, list[tuple]]:
    """((width, height) from <size> or None, [(name, xmin, ymin, xmax, ymax, difficult)])."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise AnnosetError(f"{path}: cannot read the VOC annotation: {e}") from None
    size = root.find("size")
    wh = None
    if size is not None and size.findtext("width") and size.findtext("height"):
        wh = (int(float(size.findtext("width"))), int(float(size.findtext("height"))))
    objs = []
    for i, o in enumerate(root.iter("object")):
        b = o.find("bndbox")
        try:
            box = [float(b.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")]
        except (AttributeError, TypeError, ValueError):
            raise AnnosetError(f"{path}: object {i} has no valid <bndbox> xmin/ymin/xmax/ymax") from None
        objs.append(((o.findtext("name") or "").strip(), *box, (o.findtext("difficult") or "0").strip() == "1"))
    return wh, objs


def read_sources(path: str, root: str = "") -> list[tuple[str, str, list[tuple]]]:
    """[(record name, image path, objects)] from a list file, a .csv or a .json of boxes."""
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, newline="") as f:
            if ext == ".csv":
                return _read_csv(f, path, root)
            if ext == ".json":
                items = json.load(f)
                if not isinstance(items, list):
                    raise AnnosetError(f"{path}: expected a JSON list of {{image, objects}}")
                return [(str(it["image"]), root + str(it["image"]),
                         _objects_json(it.get("objects", []), f"{path} item {i} ({it['image']})"))
                        for i, it in enumerate(items)]
            lines = f.read().splitlines()
    except OSError as e:
        raise AnnosetError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise AnnosetError(f"{path}: {type(e).__name__}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise AnnosetError(f"{path} line {n}: expected 'image annotation', got {line!r}")
        img, anno = parts
        out.append((img, root + img, [("__file__", root + anno, n)]))
    return out


def _read_csv(f, path: str, root: str) -> list[tuple[str, str, list[tuple]]]:
    reader = csv.DictReader(f)
    need = ["image", "label", "xmin", "ymin", "xmax", "ymax"]
    if reader.fieldnames is None or any(k not in reader.fieldnames for k in need):
        raise AnnosetError(f"{path}: the header must name {','.join(need)}[,difficult]; "
                           f"got {reader.fieldnames}")
    by_image: dict[str, list] = {}
    for row in reader:
        where = f"{path} line {reader.line_num}"
        try:
            box = [float(row[k]) for k in need[2:]]
        except (TypeError, ValueError):
            raise AnnosetError(f"{where}: xmin, ymin, xmax, ymax must be numbers") from None
        diff = (row.get("difficult") or "0").strip() in ("1", "true", "True")
        by_image.setdefault(row["image"], []).append((row["label"].strip(), *box, diff))
    return [(img, root + img, objs) for img, objs in by_image.items()]


def annotated_datum(image_bytes: bytes, wh: tuple[int, int], objs, name_to_label: dict,
                    where: str) -> "pb.AnnotatedDatum":
    """The record for one image: groups by label in order of first appearance, instance ids
    counting within a group, boxes normalised by (width, height)."""
    w, h = wh
    ad = pb.AnnotatedDatum(type=pb.AnnotatedDatum.BBOX)
    ad.datum.encoded, ad.datum.data = True, image_bytes
    groups: dict[int, pb.AnnotationGroup] = {}
    for i, (name, x0, y0, x1, y1, diff) in enumerate(objs):
        if name not in name_to_label:
            raise AnnosetError(f"{where}: object {i} has label '{name}', which is not in the label "
                               f"map (known: {', '.join(sorted(name_to_label))})")
        if not (0 <= x0 <= x1 <= w and 0 <= y0 <= y1 <= h):
            raise AnnosetError(f"{where}: object {i} ('{name}') box [{x0:g}, {y0:g}, {x1:g}, "
                               f"{y1:g}] lies outside the {w}x{h} image (or is inverted)")
        label = name_to_label[name]
        g = groups.get(label)
        if g is None:
            g = groups[label] = ad.annotation_group.add(group_label=label)
        a = g.annotation.add(instance_id=len(g.annotation))
        a.bbox.xmin, a.bbox.ymin = np.float32(x0) / np.float32(w), np.float32(y0) / np.float32(h)
        a.bbox.xmax, a.bbox.ymax = np.float32(x1) / np.float32(w), np.float32(y1) / np.float32(h)
        a.bbox.difficult = diff
    return ad


def label_map_from(names) -> "pb.LabelMap":
    """A label map for ``names``: 0 is the background ('none_of_the_above', as SSD's VOC map),
    then the names in sorted order from 1."""
    lm = pb.LabelMap()
    lm.item.add(name="none_of_the_above", label=0, display_name="background")
    for i, n in enumerate(sorted(set(names)), 1):
        lm.item.add(name=n, label=i, display_name=n)
    return lm


def create_annoset(sources, out: str, label_map: "pb.LabelMap", gray: bool = False,
                   shuffle: bool = False, seed: int = 0, backend: str = "lmdb",
                   progress: bool = True) -> int:
    """Write ``sources`` (from ``read_sources``) to a new database at ``out``; returns the count."""
    names = {it.name: it.label for it in label_map.item}
    order = list(range(len(sources)))
    if shuffle:
        np.random.default_rng(seed).shuffle(order)
    writer = open_writer(out, backend)
    try:
        with writer, _progress(len(order), "create-annoset", progress) as bar:
            for n, i in enumerate(order):
                name, img_path, objs = sources[i]
                where = f"record {n:08d} ({name})"
                try:
                    raw = np.fromfile(img_path, np.uint8)
                except OSError as e:
                    raise AnnosetError(f"{where}: cannot open image {img_path}: {e.strerror or e}") from None
                img = decode_image(raw, not gray)
                if img is None:
                    raise AnnosetError(f"{where}: {img_path} is not a decodable image")
                wh = (img.shape[1], img.shape[0])
                if objs and objs[0][0] == "__file__":
                    anno, line = objs[0][1], objs[0][2]
                    where = f"{where}, {anno} (list line {line})"
                    objs, size = _read_anno(anno)
                    if size is not None and size != wh:
                        log.warning("%s: size %s differs from the image's %s; using the image's",
                                    anno, size, wh)
                ad = annotated_datum(raw.tobytes(), wh, objs, names, where)
                writer.put(f"{n:08d}_{name}", ad.SerializeToString())
                bar.update(1)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return len(order)


def _read_anno(path: str):
    if path.lower().endswith(".json"):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise AnnosetError(f"cannot read annotation {path}: {e}") from None
        size = (int(doc["width"]), int(doc["height"])) if "width" in doc and "height" in doc else None
        return _objects_json(doc.get("objects", []), path), size
    size, objs = read_voc(path)
    return objs, size
