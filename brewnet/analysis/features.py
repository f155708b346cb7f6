"""Feature extraction (Caffe's ``extract_features``, owl's FeatureExtractor): run a net over its
own data and keep chosen blobs, streaming, with memory flat in the number of images.

``batches(net, blobs, iterations)`` yields ``({blob: array (batch, ...)}, labels or None)`` per
forward. ``FeatureWriter`` writes them as they come, by the output's extension:

- ``.npy``: a memory-mapped ``<stem>_<blob>.npy`` per blob (and ``<stem>_labels.npy``), filled in place;
- ``.h5``: one file, a dataset per blob (and ``label``), grown batch by batch;
- ``.lmdb``: one ``<stem>_<blob>.lmdb`` per blob in Caffe's extract_features format: a Datum per
  image with the blob's channels/height/width (legacy axes: (N, K) gives K x 1 x 1), float_data,
  keys ``format_int(index, 10)``, commits every 1000, the net's label (if any) in Datum.label;
- ``.txt``: owl's matrix, a ``<stem>_<blob>.txt`` per blob (and ``<stem>_labels.txt``), a line per image.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

FORMATS = (".npy", ".h5", ".lmdb", ".txt")


def check_blobs(net, blobs: list[str]) -> None:
    missing = [b for b in blobs if b not in net.blobs]
    if missing:
        raise ValueError(f"no blob {', '.join(repr(b) for b in missing)} in net '{net.name}'; "
                         f"its blobs are: {', '.join(net.blobs)}")


def batches(net, blobs: list[str], iterations: int, label_blob: str | None = "label"):
    """Yield ``({blob: float32 array}, labels)`` for ``iterations`` forwards of ``net``."""
    check_blobs(net, blobs)
    label_blob = label_blob if label_blob in net.blobs else None
    with torch.no_grad():
        for _ in range(iterations):
            net.forward_tensors()
            feats = {b: net.blobs[b].tensor.detach().float().cpu().numpy().copy() for b in blobs}
            labels = (net.blobs[label_blob].tensor.detach().cpu().numpy().reshape(-1).copy()
                      if label_blob else None)
            yield feats, labels


def _legacy(shape) -> tuple[int, int, int]:
    s = list(shape[1:]) + [1, 1, 1]
    return s[0], s[1], s[2]


class FeatureWriter:
    """Writes feature batches to ``out`` (see the module docstring) for ``total`` images."""

    def __init__(self, out, blobs: list[str], total: int):
        self.out, self.blobs, self.total = Path(out), list(blobs), int(total)
        self.kind = self.out.suffix.lower()
        if self.kind not in FORMATS:
            raise ValueError(f"{out}: the output must end in {', '.join(FORMATS)}")
        folder = self.out.parent if str(self.out.parent) else Path(".")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise OSError(f"{out}: cannot write there (folder '{folder}' is missing or not writable)")
        self.n = 0
        self._files: dict = {}

    def path(self, name: str) -> Path:
        return self.out.with_name(f"{self.out.stem}_{name}{self.kind}")

    def write(self, feats: dict, labels) -> None:
        n = len(next(iter(feats.values())))
        if self.n + n > self.total:
            raise ValueError(f"{self.out}: more images ({self.n + n}) than announced ({self.total})")
        getattr(self, "_write_" + self.kind[1:])(feats, labels, n)
        self.n += n

    def _write_npy(self, feats, labels, n):
        from numpy.lib.format import open_memmap

        items = dict(feats, **({"labels": labels} if labels is not None else {}))
        for name, arr in items.items():
            if name not in self._files:
                self._files[name] = open_memmap(self.path(name), mode="w+", dtype=arr.dtype,
                                                shape=(self.total,) + arr.shape[1:])
            self._files[name][self.n:self.n + n] = arr

    def _write_h5(self, feats, labels, n):
        import h5py

        if "h5" not in self._files:
            self._files["h5"] = h5py.File(self.out, "w")
        f = self._files["h5"]
        items = dict(feats, **({"label": labels} if labels is not None else {}))
        for name, arr in items.items():
            if name not in f:
                f.create_dataset(name, shape=(0,) + arr.shape[1:], maxshape=(None,) + arr.shape[1:],
                                 dtype=arr.dtype, chunks=True)
            d = f[name]
            d.resize(self.n + n, axis=0)
            d[self.n:self.n + n] = arr

    def _write_lmdb(self, feats, labels, n):
        from ..data.db import open_writer
        from ..proto import caffe_pb2 as pb

        for name, arr in feats.items():
            if name not in self._files:
                self._files[name] = open_writer(self.path(name))
            c, h, w = _legacy(arr.shape)
            for k in range(n):
                d = pb.Datum(channels=c, height=h, width=w)
                d.float_data.extend(arr[k].reshape(-1).tolist())
                if labels is not None:
                    d.label = int(labels[k])
                self._files[name].put(f"{self.n + k:010d}", d.SerializeToString())

    def _write_txt(self, feats, labels, n):
        items = dict(feats, **({"labels": labels} if labels is not None else {}))
        for name, arr in items.items():
            if name not in self._files:
                self._files[name] = open(self.path(name), "w")
            fmt = "%d" if name == "labels" else "%.9g"
            np.savetxt(self._files[name], arr.reshape(n, -1), fmt=fmt)

    def close(self) -> list[Path]:
        """Finish every file; returns the paths written."""
        written = []
        for name, f in self._files.items():
            if self.kind == ".npy":
                f.flush()
                del f
            else:
                f.close()
            written.append(self.out if self.kind == ".h5" else self.path(name))
        self._files = {}
        return written
