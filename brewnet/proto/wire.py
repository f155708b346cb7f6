"""Protobuf's wire format by hand, where the runtime offers no call: varints, and a message's
top-level fields renumbered (a fork's fields carried at other numbers, proto/schema.py), and
packed fields written straight from numpy (proto/io.py)."""
from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a base-128 varint."""
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def read_varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``data[i:]`` and the position after it."""
    n = shift = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7


def renumber(data: bytes, new) -> bytes:
    """``data`` (top-level fields of one message) with each field number ``n`` as ``new(n)``;
    groups (wire types 3/4) raise ValueError."""
    out, i = bytearray(), 0
    while i < len(data):
        key, j = read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, k = read_varint(data, j)
        elif wire == 1:
            k = j + 8
        elif wire == 2:
            size, k = read_varint(data, j)
            k += size
        elif wire == 5:
            k = j + 4
        else:
            raise ValueError(f"field {number}: protobuf groups are not supported")
        out += varint(new(number) << 3 | wire) + data[j:k]
        i = k
    return bytes(out)
