"""SSD's AnnotatedData layer (weiliu89/caffe ``layers/annotated_data_layer.cpp``) and its label
maps: AnnotatedDatum records (an image and its boxes, grouped by class) from an LMDB, augmented
per image as the fork does (distort, expand, crop to a sampled box, resize, crop_size, mirror,
mean and scale), with the boxes carried through every step.
"""
from __future__ import annotations

import numpy as np
import torch
from google.protobuf import text_format

from ..layers.registry import register
from ..proto import caffe_pb2 as pb
from . import augment as A
from .boxes import Annos, batch_samples, transform_annos
from .db import DBError, _show, open_db, parse_record
from .layers import _DatumLoader
from .source import Prefetching, check_batch, layer_error
from .transform import DataTransformer, TransformError, datum_to_chw

f32 = np.float32
_AUGMENT = ("resize_param", "noise_param", "distort_param", "expand_param", "emit_constraint")


def read_label_map(path) -> "pb.LabelMap":
    """A LabelMap prototxt (SSD's labelmap_voc.prototxt); clear errors naming the file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise DBError(f"cannot read label map {path}: {e.strerror or e}") from None
    lm = pb.LabelMap()
    try:
        text_format.Parse(text, lm)
    except text_format.ParseError as e:
        raise DBError(f"{path}: not a LabelMap prototxt: {e}") from None
    seen: dict = {}
    for item in lm.item:
        for field in ("name", "label"):
            v = getattr(item, field)
            if (field, v) in seen:
                raise DBError(f"{path}: {field} {v!r} appears twice in the label map")
            seen[(field, v)] = True
    return lm


def decode_annotated(value: bytes, key=b"", source="") -> "pb.AnnotatedDatum":
    """Parse a serialized AnnotatedDatum; a corrupt record raises DBError naming key and source."""
    ad = parse_record(pb.AnnotatedDatum(), value, key, source)
    if not ad.HasField("datum"):
        raise DBError(f"{source}: record {_show(key)} holds no datum (is this an AnnotatedDatum "
                      "database? create it with 'brewnet create-annoset')")
    return ad


class _Augment:
    """One image's path through the fork's AnnotatedDataLayer::load_batch and
    DataTransformer::Transform(AnnotatedDatum): returns the (C, h, w) float32 item and its
    surviving boxes."""

    def __init__(self, tparam, samplers, phase, who, rng):
        self.p, self.samplers, self.phase = tparam, list(samplers), phase
        base = pb.TransformationParameter()
        base.CopyFrom(tparam)
        for field in _AUGMENT:
            base.ClearField(field)
        self.tf = DataTransformer(base, phase, rng=rng, who=who)     # mean, scale, crop, checks
        self.rng = rng
        # TransformAnnotation tests it at every step (expand, sampled crop, final crop)
        self.emit = tparam.emit_constraint if tparam.HasField("emit_constraint") else None
        if tparam.HasField("noise_param"):
            raise TransformError(f"{who}: noise_param is not supported")
        rp = tparam.resize_param
        if tparam.HasField("resize_param") and (rp.height <= 0 or rp.width <= 0):
            raise TransformError(f"{who}: resize_param needs height and width > 0")
        if tparam.HasField("expand_param") and tparam.expand_param.max_expand_ratio <= 1:
            raise TransformError(f"{who}: expand_param.max_expand_ratio must be > 1")

    def fill(self) -> np.ndarray:
        tf = self.tf
        return tf.mean if tf.mean is not None else tf.mean_values

    def shape(self, img: np.ndarray) -> tuple[int, int, int]:
        """InferBlobShape of an (H, W[, C]) image: resized, then crop_size."""
        h, w = img.shape[:2]
        if self.p.HasField("resize_param"):
            w, h = A.new_size(self.p.resize_param, w, h)
        c = 1 if img.ndim == 2 else img.shape[2]
        return self.tf.check((c, h, w))

    def __call__(self, img: np.ndarray, annos: Annos) -> tuple[np.ndarray, Annos]:
        p, rng = self.p, self.rng
        if p.HasField("distort_param"):
            img = A.distort(img, p.distort_param, rng)
        if p.HasField("expand_param"):
            img, box = A.random_expand(img, p.expand_param, self.fill(), rng)
            if box is not None:
                annos = transform_annos(annos, box, emit=self.emit)
        if self.samplers:
            boxes = batch_samples(annos.box, self.samplers, rng)
            if boxes:
                box = np.clip(boxes[int(rng.integers(len(boxes)))], f32(0), f32(1))
                img = A.crop(img, box)
                annos = transform_annos(annos, box, emit=self.emit)
        return self.final(img, annos)

    def final(self, img: np.ndarray, annos: Annos) -> tuple[np.ndarray, Annos]:
        """Transform(cv::Mat) with its annotation: resize, crop_size crop, mirror, mean, scale."""
        p, tf = self.p, self.tf
        mirror = bool(tf.mirror and self.rng.integers(0, 2))
        h0, w0 = img.shape[:2]
        resize = None
        if p.HasField("resize_param"):
            img = A.resize(img, p.resize_param, self.rng)
            resize = (p.resize_param, w0, h0)
        chw = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
        c, H, W = chw.shape
        c, h, w = tf.check((c, H, W))
        if tf.crop and self.phase == pb.TRAIN:
            a, b = int(self.rng.integers(0, H - h + 1)), int(self.rng.integers(0, W - w + 1))
        else:
            a, b = (H - h) // 2, (W - w) // 2
        crop_box = np.array([b / f32(W), a / f32(H), (b + w) / f32(W), (a + h) / f32(H)], f32)
        x = chw[:, a:a + h, b:b + w]
        if tf.mean is not None:
            out = (x - tf.mean[:, a:a + h, b:b + w]).astype(f32)
        elif len(tf.mean_values):
            out = np.subtract(x, tf.mean_values.reshape(-1, 1, 1), dtype=f32)
        else:
            out = x.astype(f32)
        if tf.scale != 1:
            out *= tf.scale
        if mirror:
            out = out[..., ::-1]
        return out, transform_annos(annos, crop_box, mirror, resize, self.emit)


class _AnnoLoader(_DatumLoader):
    """Batches of (images, label rows) from AnnotatedDatum records (cursor and sharding as
    the Data layer's loader)."""

    def __init__(self, cursor, source, batch_size, aug: _Augment, shape, label_mode, labels):
        super().__init__(cursor, source, batch_size, aug.tf, label_mode is not None)
        self.aug, self.shape, self.label_mode, self.labels = aug, shape, label_mode, labels

    def item(self, key, value):
        ad = decode_annotated(value, key, self.source)
        img = datum_to_chw(ad.datum, self.aug.tf.force_color, self.aug.tf.force_gray, key, self.source)
        if img.dtype != np.uint8:
            raise TransformError(f"{self.source}: record {_show(key)}: AnnotatedData needs byte "
                                 "images (data or encoded), not float_data")
        img = img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)
        annos = Annos.of(ad)
        if self.labels is not None and len(annos):
            bad = ~np.isin(annos.label, self.labels)
            if bad.any():
                raise DBError(f"{self.source}: record {_show(key)} has a box of label "
                              f"{int(annos.label[bad][0])}, which is not in the label map "
                              f"(labels {sorted(int(v) for v in self.labels)})")
        bad = ~((annos.box >= 0) & (annos.box <= 1)).all(1) if len(annos) else []
        if len(annos) and bad.any():
            raise DBError(f"{self.source}: record {_show(key)} has a box outside the image: "
                          f"{annos.box[bad][0].tolist()} (coordinates are normalised to [0, 1])")
        if self.label_mode == "bbox" and len(ad.annotation_group) and ad.type != pb.AnnotatedDatum.BBOX:
            raise DBError(f"{self.source}: record {_show(key)}: unknown annotation type {ad.type}")
        try:
            out, annos = self.aug(img, annos)
        except ValueError as e:
            raise TransformError(f"{self.source}: record {_show(key)}: {e}") from None
        if out.shape != self.shape:
            raise TransformError(f"{self.source}: record {_show(key)} transforms to shape "
                                 f"{out.shape}, the batch's is {self.shape}; set resize_param "
                                 "(or crop_size) so every image has one size")
        return out, annos, ad.datum.label

    def next_batch(self):
        keys, values, _ = self._read()
        data = self.alloc((self.batch_size,) + self.shape)
        rows, labels = [], np.empty(self.batch_size, f32)
        arr = data.numpy()
        for i, (k, v) in enumerate(zip(keys, values)):
            arr[i], annos, labels[i] = self.item(k, v)
            if len(annos):
                rows.append(np.column_stack([np.full(len(annos), i), annos.label, annos.instance,
                                             annos.box, annos.difficult]).astype(f32))
        if self.label_mode is None:
            return [data]
        if self.label_mode == "label":
            return [data, torch.from_numpy(labels)]
        label = np.concatenate(rows) if rows else np.full((1, 8), -1, f32)
        return [data, torch.from_numpy(label.reshape(1, 1, -1, 8))]


@register("AnnotatedData")
class AnnotatedData(Prefetching):
    """Images and boxes from AnnotatedDatum records (SSD's LMDBs), augmented as SSD trains.
    Shapes: none -> data (batch_size, C, H', W') [, label (1, 1, num_boxes, 8)]: one row per
    surviving box [item, group_label, instance_id, xmin, ymin, xmax, ymax, difficult]
    (normalised), or one row of -1 when the batch has none; records without an annotation
    type (and no anno_type) give a (batch_size,) label of the datum's labels instead.
    Params: data_param {source, batch_size, rand_skip, prefetch}, annotated_data_param
    {batch_sampler, label_map_file, anno_type}, transform_param {resize_param, distort_param,
    expand_param, emit_constraint, crop_size, mirror, mean_value/mean_file, scale,
    force_color/force_gray}.
    Differs from the fork: see ``brewnet.data.augment`` (no JPEG round trips); a box whose
    group_label is not in label_map_file, or a stored box outside [0, 1], is an error naming
    the record (the fork reads label_map_file and never uses it); noise_param is refused."""

    min_tops, max_tops = 1, 2

    def setup(self, bottom_shapes):
        p, ap = self.param.data_param, self.param.annotated_data_param
        bs = check_batch(self, p.batch_size)
        who = f"Layer '{self.name}' (type AnnotatedData)"
        rp = self.param.transform_param.resize_param
        if self.param.transform_param.HasField("resize_param") and \
                rp.resize_mode == pb.ResizeParameter.FIT_SMALL_SIZE and bs != 1:
            raise self.fail("resize_mode FIT_SMALL_SIZE needs batch_size 1 (image sizes differ)")
        try:
            labels = None
            if ap.label_map_file:
                labels = np.array([it.label for it in read_label_map(ap.label_map_file).item])
            db = open_db(p.source, p.backend if p.HasField("backend") else None)
            cursor = db.cursor()
            tf = DataTransformer(None, self.phase, who=who)
            aug = _Augment(self.param.transform_param, ap.batch_sampler, self.phase, who, tf.rng)
            if p.rand_skip:
                cursor.advance(int(aug.rng.integers(0, p.rand_skip)))
            key, value = cursor.peek()
            first = decode_annotated(value, key, p.source)
            img = datum_to_chw(first.datum, aug.tf.force_color, aug.tf.force_gray, key, p.source)
            shape = aug.shape(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))
        except (DBError, TransformError) as e:
            raise layer_error(self, e) from None
        typed = first.HasField("type") or ap.HasField("anno_type")
        mode = None if self.num_tops == 1 else ("bbox" if typed else "label")
        self.db = db
        nbox = max(sum(len(g.annotation) for g in first.annotation_group), 1)
        self.shapes = [(bs,) + shape, (1, 1, nbox, 8) if mode == "bbox" else (bs,)][:self.num_tops]
        self.start_loader(_AnnoLoader(cursor, p.source, bs, aug, shape, mode, labels), p)

    def reshape(self, bottom_shapes):
        return list(self.shapes)

    def shard(self, rank: int, count: int) -> None:
        if self.phase == pb.TRAIN:
            self.reposition(lambda loader: loader.shard(rank, count))
