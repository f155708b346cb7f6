"""Data layers that read from disk: Data (LMDB/LevelDB Datums), ImageData (image list),
HDF5Data, HDF5Output and WindowData (R-CNN windows).

Each layer owns a loader (its own cursor, file position, shuffling and transform RNG, so
several nets reading one source never share a position) that makes host batches; Data,
ImageData and WindowData run it in a background Prefetcher thread (``data_param.prefetch``
batches ahead) or in the forward pass (0; unset: as ``source.py``'s timing picks). Tops are
float32 on the CPU until the net calls ``to(device, dtype)``; on CUDA batches are built in
pinned memory and copied non-blocking. Data tops have no backward. The loaders never
reference the layer, so a dropped net stops its thread.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..layers.origins import ListLines, Records
from ..layers.registry import register
from ..proto import caffe_pb2 as pb
from .convert import ListError, read_list
from .datums import raw_batch, raw_layout
from .db import DBError, _show, decode_datum, open_db
from .source import Loader, Prefetching, check_batch, layer_error
from .transform import DataTransformer, TransformError, hwc_to_chw, read_image

log = logging.getLogger("brewnet")


# ------------------------------------------------------------------------------------ Data

class _DatumLoader(Loader):
    """``offset`` is Caffe 1.0's running record index (it keeps counting across epochs): of
    ``count`` workers, worker ``rank`` takes the records with offset % count == rank and moves
    past the others without reading them (``DataLayer::Skip``)."""

    def __init__(self, cursor, source, batch_size, transformer, with_label):
        self.cursor, self.source, self.batch_size = cursor, source, batch_size
        self.tf, self.with_label = transformer, with_label
        self.offset, self.rank, self.count = 0, 0, 1
        self.keys: list = []        # the last batch's record keys

    def origin(self) -> Records:
        return Records(self.source, self.keys)

    def shard(self, rank: int, count: int) -> None:
        self.rank, self.count = rank, count

    def state(self) -> dict:
        return {"offset": self.offset, "key": self.cursor.peek()[0].hex(),
                "epochs": self.cursor.epochs, "rng": self.tf.rng.bit_generator.state}

    def set_state(self, state: dict) -> None:
        try:
            key = bytes.fromhex(state["key"])
            self.offset, epochs = int(state["offset"]), int(state["epochs"])
            self.tf.rng.bit_generator.state = state["rng"]
        except (KeyError, TypeError, ValueError) as e:
            raise DBError(f"{self.source}: a data cursor without a valid {e} field") from None
        self.cursor.seek(key)
        self.cursor.epochs = epochs

    def _read(self) -> tuple[list, list, tuple | None]:
        """The keys and values of the batch's records (this worker's share of them), and where
        they lie in memory (``Cursor.take``)."""
        if self.count == 1:
            self.offset += self.batch_size
            keys, values, where = self.cursor.take(self.batch_size)
            self.keys = keys
            return keys, values, where
        keys, values = [], []
        self.keys = keys
        for _ in range(self.batch_size):
            while self.offset % self.count != self.rank:
                self.cursor.advance()
                self.offset += 1
            self.offset += 1
            key, value = self.cursor.next()
            keys.append(key)
            values.append(value)
        return keys, values, None

    def next_batch(self):
        keys, values, where = self._read()
        first = decode_datum(values[0], keys[0], self.source)
        img = self.tf.image(first, keys[0], self.source)
        layout = raw_layout(first)
        raw = raw_batch(values, layout, where) if layout is not None else None
        if raw is not None:             # raw byte records: one array, no Datum per record
            images, labels = raw[0].reshape((len(values),) + img.shape), raw[1]
        else:
            images, labels = [img], np.empty(self.batch_size, np.float32)
            labels[0] = first.label
            for i in range(1, len(values)):
                datum = decode_datum(values[i], keys[i], self.source)
                img = self.tf.image(datum, keys[i], self.source)
                if img.shape != images[0].shape:
                    raise TransformError(f"{self.source}: record {_show(keys[i])} (item {i} of "
                                         f"the batch) has shape {img.shape}, the batch's first "
                                         f"has {images[0].shape}; a batch needs one shape")
                images.append(img)
                labels[i] = datum.label
        shape = images[0].shape[-3:]
        data = self.alloc((self.batch_size,) + self.tf.check(shape))
        self.tf.transform(images, out=data.numpy())
        return [data, self.alloc(labels.shape).copy_(torch.from_numpy(labels))][:1 + self.with_label]


@register("Data")
class Data(Prefetching):
    """Datums from an LMDB (or LevelDB) in key order, wrapping at the end, transformed.
    Shapes: none -> data (batch_size, C, H', W') [, label (batch_size,)].
    Params: data_param {source, batch_size, rand_skip, backend, prefetch, force_encoded_color},
    transform_param. Records may be raw (data bytes or float_data) or encoded images.
    Several workers (``shard``): each takes every count-th record from its rank on, as Caffe
    1.0; a TEST net is not sharded (Caffe tests on rank 0 alone).
    Differs from Caffe: the database kind is read from disk (Caffe's default backend is LEVELDB,
    which prototxts with an LMDB source often leave unset); rand_skip skips a uniform
    0..rand_skip-1 records at setup, as Caffe's single-reader layer did."""

    min_tops, max_tops = 1, 2

    def setup(self, bottom_shapes):
        p = self.param.data_param
        bs = check_batch(self, p.batch_size)
        tparam = pb.TransformationParameter()
        tparam.CopyFrom(self.param.transform_param)
        if p.force_encoded_color:
            tparam.force_color = True
        try:
            db = open_db(p.source, p.backend if p.HasField("backend") else None)
            cursor = db.cursor()
            tf = DataTransformer(tparam, self.phase, who=f"Layer '{self.name}' (type Data)")
            if p.rand_skip:
                skip = int(tf.rng.integers(0, p.rand_skip))
                log.info("Layer '%s': skipping first %d data points", self.name, skip)
                cursor.advance(skip)
            key, value = cursor.peek()
            item = tf.check(tf.image(decode_datum(value, key, p.source), key, p.source).shape)
        except (DBError, TransformError) as e:
            raise layer_error(self, e) from None
        self.db = db
        self.shapes = [(bs,) + item, (bs,)][:self.num_tops]
        self.start_loader(_DatumLoader(cursor, p.source, bs, tf, self.num_tops == 2), p)

    def reshape(self, bottom_shapes):
        return list(self.shapes)

    def shard(self, rank: int, count: int) -> None:
        """Read only worker ``rank``'s share of ``count`` (from the next batch on)."""
        if self.phase == pb.TRAIN:
            self.reposition(lambda loader: loader.shard(rank, count))


# ------------------------------------------------------------------------------- ImageData

class _ImageLoader(Loader):
    def __init__(self, lines, list_path, root, size, color, shuffle, batch_size, tf, pos):
        self.lines, self.list_path, self.root = lines, list_path, root
        self.size, self.color, self.shuffle = size, color, shuffle
        self.batch_size, self.tf, self.pos = batch_size, tf, pos
        self.picked: list = []      # the last batch's (name, label, line number) entries

    def state(self) -> dict:
        return {"pos": self.pos, "rng": self.tf.rng.bit_generator.state,
                "order": [ln for _, _, ln in self.lines] if self.shuffle else None}

    def set_state(self, state: dict) -> None:
        try:
            if state["order"] is not None:
                by_line = {ln: item for item in self.lines for ln in [item[2]]}
                self.lines = [by_line[ln] for ln in state["order"]]
            self.pos, self.tf.rng.bit_generator.state = int(state["pos"]), state["rng"]
        except (KeyError, TypeError, ValueError) as e:
            raise ListError(f"{self.list_path}: a data cursor that does not fit this list "
                            f"({type(e).__name__}: {e})") from None

    def read(self, i: int) -> np.ndarray:
        name, _, lineno = self.lines[i]
        try:
            img = read_image(self.root + name, *self.size, color=self.color)
        except OSError as e:
            raise OSError(f"{self.list_path} line {lineno}: {e}") from None
        return hwc_to_chw(img)

    def origin(self) -> ListLines:
        return ListLines(self.list_path, self.root, self.picked)

    def next_batch(self):
        images, labels = [], np.empty(self.batch_size, np.float32)
        self.picked = []            # the batch's list lines, for origin()
        for i in range(self.batch_size):
            images.append(self.read(self.pos))
            self.picked.append(self.lines[self.pos])
            labels[i] = self.lines[self.pos][1]
            self.pos += 1
            if self.pos >= len(self.lines):
                self.pos = 0
                if self.shuffle:
                    self.tf.rng.shuffle(self.lines)
        data = self.alloc((self.batch_size,) + self.tf.check(images[0].shape))
        self.tf.transform(images, out=data.numpy())
        return [data, self.alloc(labels.shape).copy_(torch.from_numpy(labels))]


def open_list(layer, p, read, what: str):
    """An image list layer's start (ImageData's, DenseImageData's): the list read by ``read``
    from ``p.source``, its transformer, the list shuffled (``p.shuffle``) and the first position
    (``p.rand_skip``, drawn as Caffe does)."""
    if (p.new_height > 0) != (p.new_width > 0):
        raise layer.fail("new_height and new_width must be set together (or neither), got "
                         f"{p.new_height} x {p.new_width}")
    try:
        lines = read(p.source)
        tf = DataTransformer(layer.param.transform_param, layer.phase,
                             who=f"Layer '{layer.name}' (type {layer.type})")
    except (ListError, TransformError) as e:
        raise layer_error(layer, e) from None
    if p.shuffle:
        tf.rng.shuffle(lines)
    pos = 0
    if p.rand_skip:
        pos = int(tf.rng.integers(0, p.rand_skip))
        if pos >= len(lines):
            raise layer.fail(f"not enough points to skip: rand_skip drew {pos}, the list has "
                             f"{len(lines)} {what}")
    return lines, tf, pos


@register("ImageData")
class ImageData(Prefetching):
    """Images named in a list file ('path label' per line), read with OpenCV (BGR), optionally
    resized (bilinear) to new_height x new_width, transformed.
    Shapes: none -> data (batch_size, C, H', W'), label (batch_size,).
    Params: image_data_param {source, batch_size, rand_skip, shuffle, new_height, new_width,
    is_color, root_folder}, transform_param; data_param.prefetch sets the queue depth.
    Differs from Caffe: a list line without a label is an error (Caffe reads label 0)."""

    exact_tops = 2

    def setup(self, bottom_shapes):
        p = self.param.image_data_param
        bs = check_batch(self, p.batch_size)
        lines, tf, pos = open_list(self, p, read_list, "lines")
        loader = _ImageLoader(lines, p.source, p.root_folder, (p.new_height, p.new_width),
                              p.is_color, p.shuffle, bs, tf, pos)
        try:
            item = tf.check(loader.read(pos).shape)
        except (OSError, TransformError) as e:
            raise layer_error(self, e) from None
        self.shapes = [(bs,) + item, (bs,)]
        self.start_loader(loader, self.param.data_param)

    def reshape(self, bottom_shapes):
        return list(self.shapes)
