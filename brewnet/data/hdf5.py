"""HDF5 data layers: HDF5Data (rows of datasets named like the tops) and HDF5Output."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..layers.data import SourceLayer
from ..layers.origins import FileRows
from ..layers.origins import note as note_origin
from ..layers.registry import register
from ..proto import caffe_pb2 as pb
from .source import check_batch
from .transform import _seed_rng

log = logging.getLogger("brewnet")


def _resolve(name: str, list_path: str) -> str:
    # Caffe opens list entries relative to the working directory; entries relative to the
    # list file are accepted too.
    if os.path.exists(name) or os.path.isabs(name):
        return name
    alt = os.path.join(os.path.dirname(os.path.abspath(list_path)), name)
    return alt if os.path.exists(alt) else name


def _check_finite(values: np.ndarray, name: str, path: str, layer, chunk: int = 1 << 20) -> None:
    """A NaN or inf in a dataset is an error naming the file, dataset and row (as a Data
    layer's float record names its key): checked once per file load, ``chunk`` values at a
    time so a large file needs no second copy in memory."""
    flat = values.reshape(len(values), -1)
    step = max(1, chunk // max(1, flat.shape[1]))
    for lo in range(0, len(flat), step):
        bad = ~np.isfinite(flat[lo:lo + step])
        if bad.any():
            r, j = (int(v[0]) for v in np.nonzero(bad))
            raise layer.fail(f"HDF5 file {path}: row {lo + r} of dataset {name!r} holds a "
                             f"non-finite value ({flat[lo + r, j]} at element {j} of the row)")


@register("HDF5Data")
class HDF5Data(SourceLayer):
    """Rows of HDF5 datasets named like the tops, from the files listed in ``source``, read in
    file order (or shuffled files and rows), wrapping around. Values become float32.
    Shapes: none -> one top per dataset, (batch_size,) + dataset.shape[1:].
    Params: hdf5_data_param {source, batch_size, shuffle}. Several workers (``shard``): each
    takes the rows whose running index is its rank mod the count, as Caffe 1.0's Skip.
    Differs from Caffe: a NaN or inf in a file is an error naming file, dataset and row (Caffe
    trains on it, into a NaN loss)."""

    min_tops = 1

    def setup(self, bottom_shapes):
        p = self.param.hdf5_data_param
        self.batch_size = check_batch(self, p.batch_size)
        try:
            names = Path(p.source).read_text().split()
        except OSError as e:
            raise self.fail(f"cannot read HDF5 file list {p.source}: {e.strerror or e}") from None
        if not names:
            raise self.fail(f"must have at least 1 HDF5 filename listed in {p.source}")
        self.files = [_resolve(n, p.source) for n in names]
        self.shuffle = p.shuffle
        self.rng = _seed_rng()
        self.file_order = np.arange(len(self.files))
        if self.shuffle:
            self.rng.shuffle(self.file_order)
        self.current_file = 0
        self.offset, self.rank, self.count = 0, 0, 1     # running row index, the worker's share
        self._load(self.files[self.file_order[0]])
        self.shapes = [(self.batch_size,) + b.shape[1:] for b in self.blobs_in_file]

    def _load(self, path: str) -> None:
        import h5py

        tops = list(self.param.top)
        try:
            with h5py.File(path, "r") as f:
                missing = [t for t in tops if t not in f]
                if missing:
                    raise self.fail(f"HDF5 file {path} has no dataset {missing[0]!r} (a top's name "
                                    f"selects its dataset); it has {sorted(f.keys())}")
                blobs = [np.asarray(f[t][()], dtype=np.float32) for t in tops]
        except OSError as e:
            raise self.fail(f"cannot read HDF5 file {path}: {e}") from None
        for t, b in zip(tops, blobs):
            if b.ndim < 1:
                raise self.fail(f"dataset {t!r} in {path} is a scalar; it needs a row axis")
            if b.shape[0] != blobs[0].shape[0]:
                raise self.fail(f"datasets in {path} have different row counts: {tops[0]!r} "
                                f"{blobs[0].shape[0]}, {t!r} {b.shape[0]}")
        if blobs[0].shape[0] == 0:
            raise self.fail(f"HDF5 file {path} holds no rows")
        if hasattr(self, "shapes"):
            for t, b, s in zip(tops, blobs, self.shapes):
                if b.shape[1:] != s[1:]:
                    raise self.fail(f"dataset {t!r} in {path} has rows of shape {b.shape[1:]}, "
                                    f"the first file's have {s[1:]}")
        for t, b in zip(tops, blobs):
            _check_finite(b, t, path, self)
        self.blobs_in_file, self.path = blobs, path
        self.row_order = np.arange(blobs[0].shape[0])
        if self.shuffle:
            self.rng.shuffle(self.row_order)
        self.current_row = 0

    def shard(self, rank: int, count: int) -> None:
        if self.phase == pb.TRAIN:
            self.rank, self.count = rank, count

    def _next(self) -> None:
        self.offset += 1
        self.current_row += 1
        if self.current_row == len(self.row_order):
            if len(self.files) > 1:
                self.current_file += 1
                if self.current_file == len(self.files):
                    self.current_file = 0
                    if self.shuffle:
                        self.rng.shuffle(self.file_order)
                self._load(self.files[self.file_order[self.current_file]])
            self.current_row = 0
            if self.shuffle:
                self.rng.shuffle(self.row_order)

    def reshape(self, bottom_shapes):
        return list(self.shapes)

    def _tops(self, arrays, runs) -> list:
        """The batch's tops; ``runs``: the (file, rows) it was read from, for ``origins``."""
        tops = [torch.from_numpy(a) for a in arrays]
        if self.device.type != "cpu" or self.dtype != torch.float32:
            tops = [t.to(device=self.device, dtype=self.dtype) for t in tops]
        note_origin(self, tops, FileRows(runs))
        return tops

    def take_batches(self, most: int) -> tuple | None:
        """Up to ``most`` next batches at once, each top as a (batches, batch_size, ...) tensor:
        the batches ``forward`` would give one by one, while they lie inside the current file
        with a row left after them (then no file or shuffle changes); None where none do.
        Returns (tops, origin): ``origin(b)`` is batch b's ``Origin`` (origins.py)."""
        n, row = self.batch_size, self.current_row
        j = min(most, (len(self.row_order) - 1 - row) // n) if self.count == 1 else 0
        if j < 1:
            return None
        rows = self.row_order[row:row + j * n]
        self.current_row, self.offset = row + j * n, self.offset + j * n
        tops = [torch.from_numpy(b[rows].reshape((j, n) + b.shape[1:])) for b in self.blobs_in_file]
        if self.device.type != "cpu" or self.dtype != torch.float32:
            tops = [t.to(device=self.device, dtype=self.dtype) for t in tops]
        path = self.path

        def origin(b: int) -> FileRows:
            return FileRows([(path, rows[b * n:(b + 1) * n].copy())])
        note_origin(self, [t[-1] for t in tops], origin(j - 1))
        return tops, origin

    def forward(self, bottoms):
        n, row = self.batch_size, self.current_row
        if self.count == 1 and row + n < len(self.row_order):
            # inside the current file with a row left after it: nothing wraps, no file changes,
            # so one fancy-index copy per top (the rows copied: a reshuffle reorders row_order)
            rows = self.row_order[row:row + n].copy()
            self.current_row, self.offset = row + n, self.offset + n
            return self._tops([b[rows] for b in self.blobs_in_file], [(self.path, rows)])
        outs = [np.empty(s, np.float32) for s in self.shapes]
        runs = []
        if self.count > 1:              # a worker's share: Caffe 1.0's Skip, row by row
            for i in range(self.batch_size):
                while self.offset % self.count != self.rank:
                    self._next()
                row = self.row_order[self.current_row]
                runs.append((self.path, [row]))
                for o, b in zip(outs, self.blobs_in_file):
                    o[i] = b[row]
                self._next()
            return self._tops(outs, runs)
        i = 0
        while i < self.batch_size:      # runs of rows within the current file, one take each
            n = min(self.batch_size - i, len(self.row_order) - self.current_row)
            rows = self.row_order[self.current_row:self.current_row + n].copy()
            runs.append((self.path, rows))
            for o, b in zip(outs, self.blobs_in_file):
                np.take(b, rows, axis=0, out=o[i:i + n])
            self.current_row += n - 1
            self.offset += n - 1
            self._next()                # the last row of the run: wraps files as Caffe does
            i += n
        return self._tops(outs, runs)


@register("HDF5Output")
class HDF5Output(SourceLayer):
    """Writes its two bottoms to datasets "data" and "label" of ``file_name`` (created, or
    truncated, at setup), in Caffe's 4-D (num, channels, height, width) layout.
    Shapes: data (N, ...), label (N, ...) -> no tops. Params: hdf5_output_param {file_name}.
    Differs from Caffe: each forward appends its rows (Caffe's second forward fails because
    the datasets already exist), and the file is open only while a forward writes it."""

    exact_bottoms, exact_tops = 2, 0

    def setup(self, bottom_shapes):
        import h5py

        self.file_name = self.param.hdf5_output_param.file_name
        try:
            h5py.File(self.file_name, "w").close()
        except OSError as e:
            raise self.fail(f"failed to open HDF5 file {self.file_name}: {e}") from None

    def reshape(self, bottom_shapes):
        a, b = bottom_shapes
        if not a or not b or a[0] != b[0] or len(a) > 4 or len(b) > 4:
            raise self.fail("data and label must have the same num and at most 4 axes, got "
                            f"shapes {tuple(a)} and {tuple(b)}")
        return []

    def forward(self, bottoms):
        import h5py

        with h5py.File(self.file_name, "a") as f:
            for name, t in zip(("data", "label"), bottoms):
                arr = t.detach().cpu().numpy()
                arr = arr.reshape(arr.shape + (1,) * (4 - arr.ndim))   # Caffe's legacy 4-D shape
                if name not in f:
                    f.create_dataset(name, data=arr, maxshape=(None,) + arr.shape[1:], chunks=True)
                    continue
                ds = f[name]
                if ds.shape[1:] != arr.shape[1:]:
                    raise self.fail(f"bottom '{name}' rows changed shape from {ds.shape[1:]} to "
                                    f"{arr.shape[1:]} between forwards")
                ds.resize(ds.shape[0] + arr.shape[0], axis=0)
                ds[-arr.shape[0]:] = arr
        log.info("Layer '%s': saved %d rows to %s", self.name, bottoms[0].shape[0], self.file_name)
        return []
