"""Caffe's data converters as library functions: ``convert_mnist`` (idx files -> LMDB),
``convert_imageset`` (image list -> LMDB) and ``compute_mean`` (LMDB -> mean BlobProto).

They write what Caffe's tools write: the same keys, the same serialized Datums, the same
mean (summed in float32, record by record, as ``compute_image_mean`` does).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from ..proto import caffe_pb2 as pb
from .db import DBError, decode_datum, open_db, open_writer
from .idx import read_idx
from .transform import _seed_rng, chw_to_datum, datum_to_chw, encode_image, hwc_to_chw, read_image

log = logging.getLogger("brewnet")


class ListError(ValueError):
    """A malformed image list (the message names the file and line)."""


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=None if enabled else True,
                dynamic_ncols=True, leave=False)


def read_list(path) -> list[tuple[str, int, int]]:
    """An image list: lines 'path label', the label after the last space ->
    [(path, label, line number)]. Blank lines are skipped; a line without a label is an error."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ListError(f"cannot read image list {path}: {e.strerror or e}") from None
    lines = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        name, sep, label = line.rpartition(" ")
        if not sep or not name or not label.lstrip("-").isdigit():
            raise ListError(f"{path} line {n}: expected 'path label', got {line!r}")
        lines.append((name, int(label), n))
    if not lines:
        raise ListError(f"image list {path} is empty")
    return lines


def convert_mnist(images, labels, db_path, backend: str = "lmdb", progress: bool = True) -> int:
    """Caffe's ``convert_mnist_data``: idx image and label files (gzipped or not) -> a database
    of Datums {1 x rows x cols raw bytes, label} keyed ``%08d``. Returns the record count."""
    imgs, labs = read_idx(images), read_idx(labels)
    if imgs.ndim != 3 or imgs.dtype != np.uint8:
        raise ValueError(f"{images}: expected an idx3 file of uint8 images, got {imgs.dtype} {imgs.shape}")
    if labs.ndim != 1:
        raise ValueError(f"{labels}: expected an idx1 label file, got shape {labs.shape}")
    if len(imgs) != len(labs):
        raise ValueError(f"{images} holds {len(imgs)} images but {labels} holds {len(labs)} labels")
    n, rows, cols = imgs.shape
    log.info("A total of %d items.", n)
    log.info("Rows: %d Cols: %d", rows, cols)
    datum = pb.Datum(channels=1, height=rows, width=cols)
    with open_writer(db_path, backend) as db, _progress(n, "convert-mnist", progress) as bar:
        for i in range(n):
            datum.data = imgs[i].tobytes()
            datum.label = int(labs[i])
            db.put(f"{i:08d}", datum.SerializeToString())
            if (i + 1) % 1000 == 0:
                bar.update(1000)
    log.info("Processed %d files.", n)
    return n


def _match_ext(name: str, enc: str) -> bool:
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    enc = enc.lower()
    return ext == enc or (enc == "jpg" and ext == "jpeg")


def image_to_datum(path, label: int, height: int = 0, width: int = 0, color: bool = True,
                   encoding: str = "") -> "pb.Datum":
    """Caffe's ``ReadImageToDatum``: raw CHW bytes, or with ``encoding`` the file's own bytes
    when they already are that format at the asked size and colour, else re-encoded."""
    img = read_image(path, height, width, color)
    if encoding:
        if (img.ndim == 3) == color and not height and not width and _match_ext(str(path), encoding):
            return pb.Datum(data=Path(path).read_bytes(), label=label, encoded=True)
        return pb.Datum(data=encode_image(img, encoding), label=label, encoded=True)
    return chw_to_datum(hwc_to_chw(img), label)


def convert_imageset(root, list_file, db_path, gray: bool = False, shuffle: bool = False,
                     backend: str = "lmdb", resize_height: int = 0, resize_width: int = 0,
                     check_size: bool = False, encoded: bool = False, encode_type: str = "",
                     progress: bool = True) -> dict:
    """Caffe's ``convert_imageset``: images named in ``list_file`` (relative to ``root``) ->
    Datums keyed ``%08d_<name>`` (the index of the line after any shuffle). Unreadable images
    are skipped with a warning naming the list line, as Caffe does.
    Returns {"written": n, "skipped": [(line, path), ...]}."""
    lines = read_list(list_file)
    if shuffle:
        log.info("Shuffling data")
        _seed_rng().shuffle(lines)
    log.info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
        encoded = True
    root = os.fspath(root)
    written, skipped, first_shape = 0, [], None
    with open_writer(db_path, backend) as db, _progress(len(lines), "convert-imageset", progress) as bar:
        for line_id, (name, label, lineno) in enumerate(lines):
            bar.update(1)
            enc = encode_type
            if encoded and not enc:
                if "." not in name:
                    log.warning("Failed to guess the encoding of '%s'", name)
                enc = name.rsplit(".", 1)[-1].lower()
            try:
                datum = image_to_datum(root + name, label, resize_height, resize_width, not gray, enc)
            except (OSError, ValueError) as e:
                log.warning("%s line %d: %s; skipped", list_file, lineno, e)
                skipped.append((lineno, root + name))
                continue
            if check_size:
                shape = datum_to_chw(datum).shape
                if first_shape is None:
                    first_shape = shape
                elif shape != first_shape:
                    raise ValueError(f"{list_file} line {lineno}: image {name} has shape {shape}, "
                                     f"the first image has {first_shape} (check_size)")
            db.put(f"{line_id:08d}_{name}", datum.SerializeToString())
            written += 1
            if written % 1000 == 0:
                log.info("Processed %d files.", written)
    if written % 1000:
        log.info("Processed %d files.", written)
    return {"written": written, "skipped": skipped}


def compute_mean(db_path, out_file=None, backend=None, progress: bool = True) -> np.ndarray:
    """Caffe's ``compute_image_mean``: the per-pixel mean of every Datum (encoded ones decoded
    natively) as (1, C, H, W) float32, written as a legacy BlobProto to ``out_file`` if given.
    Logs the per-channel means."""
    db = open_db(db_path, backend)
    total = None
    count = 0
    with _progress(len(db) if db.backend == "lmdb" else None, "compute-mean", progress) as bar:
        for key, value in db.items():
            img = datum_to_chw(decode_datum(value, key, str(db_path)), key=key, source=str(db_path))
            if total is None:
                total = np.zeros(img.shape, np.float32)
            elif img.shape != total.shape:
                raise DBError(f"{db_path}: record {key.decode(errors='replace')!r} has shape "
                              f"{img.shape}, the first has {total.shape}; a mean needs one size")
            np.add(total, img, out=total)      # float32, record by record: Caffe's sum order
            count += 1
            if count % 10000 == 0:
                log.info("Processed %d files.", count)
            bar.update(1)
    if count % 10000:
        log.info("Processed %d files.", count)
    mean = (total / np.float32(count)).astype(np.float32)[None]
    if out_file is not None:
        from ..proto.io import write_binaryproto

        log.info("Write to %s", out_file)
        write_binaryproto(out_file, mean, legacy=True)
    c = mean.shape[1]
    log.info("Number of channels: %d", c)
    for k in range(c):
        s = np.cumsum(mean[0, k].ravel(), dtype=np.float32)[-1]   # a float accumulator, as Caffe
        log.info("mean_value channel [%d]: %g", k, s / np.float32(mean[0, k].size))
    return mean
