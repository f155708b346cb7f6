"""Where each item of a data layer's batch came from, so that a bad label names its record.

A data layer ``note``s every batch it emits: its top tensors and an ``Origin`` (the items'
records: database keys, list file lines, HDF5 rows). Only each layer's newest batch is kept,
and its tensors only by weak reference. ``find(tensor, position)``, called only when a check
fails (``loss.check_labels``), matches the checked tensor by its memory: a label that reaches a
loss through Split, Reshape, Flatten, Slice, an in-place layer or a detach is a view of the data
layer's top, and element ``position`` of the view lies in one item of the batch. The batch a
loss checks is the one whose memory it reads, so a prefetch thread reading ahead, or the step
graph checking its inputs before a replay, cannot mix up two batches' records.
"""
from __future__ import annotations

import threading
import weakref

import torch

# the data layers that noted a batch; each holds ``batch_origin``: (its newest batch's Origin,
# weak references to that batch's tops). The lock: nets training together on threads.
_NOTED: "weakref.WeakSet" = weakref.WeakSet()
_LOCK = threading.Lock()


class Origin:
    """The records of one batch, item by item (``len``); ``where(i)`` names item i's record."""

    def __len__(self) -> int:
        raise NotImplementedError

    def where(self, i: int) -> str:
        raise NotImplementedError


class Records(Origin):
    """Database records by key (Data, AnnotatedData): ``record '00000042' of PATH``."""

    __slots__ = ("source", "keys")

    def __init__(self, source: str, keys: list):
        self.source, self.keys = source, keys

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, i: int) -> str:
        key = self.keys[i]
        shown = repr(key.decode("utf-8", "replace")) if isinstance(key, bytes) else repr(key)
        return f"record {shown} of {self.source}"


class ListLines(Origin):
    """Lines of an image list file (ImageData): ``line 7 of LIST (image PATH)``; ``lines``
    holds (name, label, line number) as ``convert.read_list`` gives them."""

    __slots__ = ("list_path", "root", "lines")

    def __init__(self, list_path: str, root: str, lines: list):
        self.list_path, self.root, self.lines = list_path, root, lines

    def __len__(self) -> int:
        return len(self.lines)

    def where(self, i: int) -> str:
        name, _, lineno = self.lines[i]
        return f"line {lineno} of {self.list_path} (image {self.root + name})"


class FileRows(Origin):
    """Rows of HDF5 files (HDF5Data): ``row 13 of FILE``. ``runs``: (file, row indices) in
    batch order; a batch that wraps or changes files has several."""

    __slots__ = ("runs",)

    def __init__(self, runs: list):
        self.runs = runs

    def __len__(self) -> int:
        return sum(len(rows) for _, rows in self.runs)

    def where(self, i: int) -> str:
        for path, rows in self.runs:
            if i < len(rows):
                return f"row {int(rows[i])} of {path}"
            i -= len(rows)
        raise IndexError(i)


def note(layer, tops, origin: Origin | None) -> None:
    """``layer`` emitted ``tops`` (items along axis 0) read from ``origin`` (None: unknown)."""
    layer.batch_origin = None if origin is None else (origin, [weakref.ref(t) for t in tops])
    if layer.__dict__.get("_noted") is not _NOTED:   # a WeakSet lookup per batch costs more
        with _LOCK:
            _NOTED.add(layer)
        layer._noted = _NOTED        # a deep copy of the layer gets a copy: it adds itself


def _storage_index(t: torch.Tensor, position: int) -> int:
    """The storage element of ``t.reshape(-1)[position]``."""
    index, rest = t.storage_offset(), position
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        index += (rest % size) * stride
        rest //= size
    return index


def find(t: torch.Tensor, position: int) -> str | None:
    """Which record element ``position`` of ``t`` (flattened) came from, as words, or None when
    ``t`` is not (a view of) the newest batch of a data layer that noted one."""
    if t.numel() == 0 or t.is_sparse:
        return None
    try:
        ptr, index = t.untyped_storage().data_ptr(), _storage_index(t, position)
    except (RuntimeError, NotImplementedError):     # no storage (meta, a traced fake tensor)
        return None
    with _LOCK:
        layers = list(_NOTED)
    for layer in layers:
        if layer.batch_origin is None:
            continue
        origin, refs = layer.batch_origin
        for ref in refs:
            top = ref()
            if (top is None or top.dim() == 0 or top.dtype != t.dtype or top.device != t.device
                    or not top.is_contiguous() or top.shape[0] != len(origin)
                    or top.untyped_storage().data_ptr() != ptr):
                continue
            offset = index - top.storage_offset()
            if 0 <= offset < top.numel():
                item = offset // (top.numel() // top.shape[0])
                return f"{origin.where(item)} (item {item} of the batch of layer '{layer.name}')"
    return None
