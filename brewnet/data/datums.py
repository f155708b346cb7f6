"""A batch of serialized raw Datums read as one array, without a Datum object per record.

Protobuf (Caffe's C++ and Python alike) writes a raw byte Datum as channels, height, width,
the data field's tag and length, the pixels, then the label. Records that are exactly that,
with the batch's first record's shape, parse to nothing else, so their pixels and labels are
read with numpy from the joined bytes. Any other record (encoded, float_data, a label past
2^31 or negative, fields in another order) makes ``raw_batch`` answer None, and the caller
decodes the batch record by record with protobuf (``decode_datum``), with its errors.
"""
from __future__ import annotations

import numpy as np

from ..proto import caffe_pb2 as pb

_LABEL_TAG = 0x28       # field 5 (label), varint
_MAX_VARINT = 5         # bytes of a non-negative int32


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def raw_layout(datum) -> tuple[np.ndarray, int] | None:
    """(the bytes before the pixels, the pixel count) of records shaped like ``datum``, a
    parsed raw byte Datum; None for an encoded or float_data one."""
    if datum.encoded or not datum.data:
        return None
    head = pb.Datum(channels=datum.channels, height=datum.height,
                    width=datum.width).SerializeToString()
    head += b'"' + _varint(len(datum.data))          # field 4 (data), length-delimited
    return np.frombuffer(head, np.uint8), len(datum.data)


def raw_batch(values: list, layout) -> tuple[np.ndarray, np.ndarray] | None:
    """(pixels (N, n) uint8, labels (N,) float32) of ``values`` when every one is a raw Datum
    of ``layout`` (from ``raw_layout``), else None. Records of one length (one label width)
    come back as a view of their joined bytes; several lengths, as a copy."""
    head, n = layout
    lens = set(map(len, values))
    if len(lens) == 1:
        return _group(b"".join(values), len(values), lens.pop(), head, n)
    lens = np.fromiter(map(len, values), np.int64, len(values))
    pixels, labels = np.empty((len(values), n), np.uint8), np.empty(len(values), np.float32)
    for length in np.unique(lens):
        idx = np.flatnonzero(lens == length)
        got = _group(b"".join([values[i] for i in idx]), len(idx), int(length), head, n)
        if got is None:
            return None
        pixels[idx], labels[idx] = got
    return pixels, labels


def _group(buf: bytes, count: int, length: int, head: np.ndarray, n: int):
    """Pixels and labels of ``count`` records of ``length`` bytes each, joined in ``buf``."""
    h = len(head)
    tail = length - h - n            # the label field: absent (0), or its tag and a varint
    if tail < 0 or tail == 1 or tail > 1 + _MAX_VARINT:
        return None
    rows = np.frombuffer(buf, np.uint8).reshape(count, length)
    if not (rows[:, :h] == head).all():
        return None
    if tail == 0:
        return rows[:, h:h + n], np.zeros(count, np.float32)
    t = rows[:, h + n:]
    if not ((t[:, 0] == _LABEL_TAG).all() and (t[:, -1] < 0x80).all()):
        return None
    if tail == 2:                    # labels 0..127: the varint is the value
        return rows[:, h:h + n], t[:, 1].astype(np.float32)
    if not (t[:, 1:-1] >= 0x80).all():
        return None
    label = np.zeros(count, np.int64)
    for j in range(tail - 1):        # little-endian groups of 7 bits
        label |= (t[:, 1 + j].astype(np.int64) & 0x7F) << (7 * j)
    if (label >= 2 ** 31).any():     # protobuf would wrap it to a negative int32
        return None
    return rows[:, h:h + n], label.astype(np.float32)
