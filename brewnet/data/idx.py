"""The idx format of MNIST-style datasets (gzipped or not) as numpy arrays."""
from __future__ import annotations

import gzip
import os

import numpy as np

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path) -> np.ndarray:
    """Read an idx file (``train-images-idx3-ubyte[.gz]``): magic 0x0000TTNN, N big-endian dims."""
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in _DTYPES:
        raise ValueError(f"{path}: not an idx file (bad magic {raw[:4]!r})")
    ndim = raw[3]
    dims = np.frombuffer(raw, ">u4", ndim, 4).astype(int)
    dtype = np.dtype(_DTYPES[raw[2]])
    need = 4 + 4 * ndim + int(np.prod(dims)) * dtype.itemsize
    if len(raw) < need:
        raise ValueError(f"{path}: truncated idx file ({len(raw)} bytes, header says {need})")
    return np.frombuffer(raw, dtype, int(np.prod(dims)), 4 + 4 * ndim).reshape(dims)
