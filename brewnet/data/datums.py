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


def raw_batch(values: list, layout, where=None) -> tuple[np.ndarray, np.ndarray] | None:
    """(pixels (N, n) uint8, labels (N,) float32) of ``values`` when every one is a raw Datum
    of ``layout`` (from ``raw_layout``), else None. ``where``: (records in memory, the index of
    the first value in them) from ``Cursor.take``; a database of records of one length is then
    read as one array once, and a batch is a slice of it."""
    if where is not None:
        table = _table(where[0], layout)
        if table is not None:
            first, count = where[1], len(values)
            rows = slice(first, first + count) if first + count <= len(table[2]) else \
                np.arange(first, first + count) % len(table[2])
            pixels, labels, ok = (a[rows] for a in table)
            return (pixels, labels) if ok.all() else None
    head, n = layout
    lens = set(map(len, values))
    if len(lens) == 1:
        got = _group(b"".join(values), len(values), lens.pop(), head, n)
        return got[:2] if got is not None and got[2].all() else None
    lens = np.fromiter(map(len, values), np.int64, len(values))
    pixels, labels = np.empty((len(values), n), np.uint8), np.empty(len(values), np.float32)
    for length in np.unique(lens):
        idx = np.flatnonzero(lens == length)
        got = _group(b"".join([values[i] for i in idx]), len(idx), int(length), head, n)
        if got is None or not got[2].all():
            return None
        pixels[idx], labels[idx] = got[:2]
    return pixels, labels


def _table(records, layout):
    """``_group`` of all ``records`` (once per layout; None when their lengths differ)."""
    key = ("raw", layout[0].tobytes(), layout[1])
    table = records.derived.get(key, False)
    if table is False:
        lens = set(map(len, records.values))
        table = _group(b"".join(records.values), len(records.values), lens.pop(), *layout) \
            if len(lens) == 1 else None
        records.derived[key] = table
    return table


def _group(buf: bytes, count: int, length: int, head: np.ndarray, n: int):
    """(pixels, labels, ok) of ``count`` records of ``length`` bytes each, joined in ``buf``:
    ``ok`` says which are raw Datums of the layout (the others' pixels and labels mean
    nothing); None when none can be."""
    h = len(head)
    tail = length - h - n            # the label field: absent (0), or its tag and a varint
    if tail < 0 or tail == 1 or tail > 1 + _MAX_VARINT:
        return None
    rows = np.frombuffer(buf, np.uint8).reshape(count, length)
    ok = (rows[:, :h] == head).all(axis=1)
    if tail == 0:
        return rows[:, h:h + n], np.zeros(count, np.float32), ok
    t = rows[:, h + n:]
    ok &= (t[:, 0] == _LABEL_TAG) & (t[:, -1] < 0x80)
    if tail == 2:                    # labels 0..127: the varint is the value
        return rows[:, h:h + n], t[:, 1].astype(np.float32), ok
    ok &= (t[:, 1:-1] >= 0x80).all(axis=1)
    label = np.zeros(count, np.int64)
    for j in range(tail - 1):        # little-endian groups of 7 bits
        label |= (t[:, 1 + j].astype(np.int64) & 0x7F) << (7 * j)
    ok &= label < 2 ** 31            # protobuf would wrap it to a negative int32
    return rows[:, h:h + n], label.astype(np.float32), ok
