"""Blob: a named tensor with its diff, seen from Python as pycaffe's writable numpy arrays.

On the CPU ``.data``/``.diff`` are numpy views sharing memory with the torch tensors. On CUDA
they are host mirrors (Caffe's SyncedMemory): reading one copies device -> host and marks the
mirror as possibly written, and the next use of ``.tensor`` copies it back.
"""
from __future__ import annotations

import numpy as np
import torch


class Blob:
    def __init__(self, tensor: torch.Tensor, diff: torch.Tensor | None = None):
        self._t = tensor
        self._d = torch.zeros_like(tensor) if diff is None else diff
        self._host: dict[str, np.ndarray] = {}   # CUDA only: name -> mirror handed out

    # -- torch side -------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        self._sync_to_device("data")
        return self._t

    @tensor.setter
    def tensor(self, t: torch.Tensor) -> None:
        self._host.pop("data", None)
        if t.shape != self._d.shape:   # a data-dependent top (Filter) changed shape in forward
            self._host.pop("diff", None)
            self._d = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        self._t = t

    @property
    def diff_tensor(self) -> torch.Tensor:
        self._sync_to_device("diff")
        return self._d

    @diff_tensor.setter
    def diff_tensor(self, t: torch.Tensor) -> None:
        self._host.pop("diff", None)
        self._d = t

    def _sync_to_device(self, which: str) -> None:
        host = self._host.pop(which, None)
        if host is not None:
            dst = self._t if which == "data" else self._d
            with torch.no_grad():
                dst.copy_(torch.from_numpy(host))

    def _view(self, which: str) -> np.ndarray:
        t = self._t if which == "data" else self._d
        if t.device.type == "cpu":
            return t.detach().numpy()
        if which not in self._host:
            self._host[which] = t.detach().cpu().numpy()
        return self._host[which]

    # -- pycaffe side -----------------------------------------------------------------------
    @property
    def data(self) -> np.ndarray:
        return self._view("data")

    @data.setter
    def data(self, value) -> None:
        self.data[...] = value

    @property
    def diff(self) -> np.ndarray:
        return self._view("diff")

    @diff.setter
    def diff(self, value) -> None:
        self.diff[...] = value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._t.shape)

    @property
    def count(self) -> int:
        return self._t.numel()

    def _legacy(self, i: int) -> int:
        # Caffe's num()/channels()/height()/width(): 1 past the last axis.
        s = self.shape
        if len(s) > 4:
            raise ValueError(f"legacy accessor on a {len(s)}-D blob")
        return s[i] if i < len(s) else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def reshape(self, *shape) -> None:
        """Resize (pycaffe's ``blob.reshape(n, c, h, w)``); keeps device and dtype."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if shape != self.shape:
            t = self._t
            self._host.clear()
            self._t = torch.zeros(shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad and t.is_leaf)
            self._d = torch.zeros(shape, dtype=t.dtype, device=t.device)

    def __repr__(self) -> str:
        return f"Blob(shape={self.shape})"


_param_views = 0


def param_views() -> int:
    """How many numpy views of parameters were handed out (they may have been written)."""
    return _param_views


class ParamBlob(Blob):
    """A layer parameter: ``tensor`` is the layer's leaf tensor, ``diff`` its ``.grad``.

    Caffe accumulates parameter diffs until the solver clears them, as torch's ``.grad`` does.
    """

    def __init__(self, layer, index: int):
        self._layer, self._index = layer, index
        self._host = {}

    @property
    def _t(self):
        return self._layer.blobs[self._index]

    @_t.setter
    def _t(self, t):
        self._layer.blobs[self._index] = t

    @property
    def _d(self):
        t = self._t
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        return t.grad

    @_d.setter
    def _d(self, d):
        self._t.grad = d

    def _view(self, which: str):
        global _param_views
        _param_views += 1
        return super()._view(which)

    def reshape(self, *shape) -> None:
        raise ValueError("parameter blobs cannot be reshaped")
