"""Blob: a named tensor with its diff, seen from Python as pycaffe's writable numpy arrays.

On the CPU ``.data``/``.diff`` are numpy views sharing memory with the torch tensors. On CUDA they
are host mirrors (Caffe's SyncedMemory): reading one refreshes the mirror from the device (in place:
the same array every time) and marks it possibly written; the next use of ``.tensor`` copies it back.

Memory is stable as in Caffe: the executor's ``write`` copies a computed value into the existing
memory while a numpy view of it is alive (so ``conv0 = blob.data[0, 0]`` shows the next forward's
values), else takes the new tensor (no copy: nobody can tell). Such a tensor may share memory with
another blob (a Flatten's view, a Split's tops, a gradient autograd passed through), so the first
view handed out of it gives the blob memory of its own (one copy) before anything is ever written
into it. ``reshape`` keeps the memory when the new shape fits in it (Caffe's capacity rule).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch


def _fit(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A contiguous tensor of ``shape`` on ``t``'s memory when it is large enough, else None."""
    n = 1
    for d in shape:
        n *= d
    storage = t.untyped_storage()
    if (t.storage_offset() + n) * t.element_size() > storage.nbytes():
        return None
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), shape)


COPY_UNDER = 1 << 16    # elements: an engine's output copied into the blob's memory, not taken


class Blob:
    _pending = None     # lean inference (brewnet/execution/lean.py): brings a stale blob up to date
    _taken = None       # (tensor, array): the engine output array the blob last took (take)

    def __init__(self, tensor: torch.Tensor, diff: torch.Tensor | None = None):
        self._t = tensor
        self._d = torch.zeros_like(tensor) if diff is None else diff
        self._host: dict[str, np.ndarray] = {}      # CUDA: which -> mirror handed out
        self._dirty: set[str] = set()               # CUDA: mirrors that may have been written
        self._views: dict[str, list] = {"data": [], "diff": []}   # weakrefs to handed-out arrays
        self._owned = {"data": True, "diff": True}    # False: memory taken from a computation

    # -- torch side -------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        if self._pending is not None:
            self._pending()
        self._sync_to_device("data")
        return self._t

    @tensor.setter
    def tensor(self, t: torch.Tensor) -> None:
        """Point the blob at ``t`` (old views keep the old memory; the executor uses ``write``)."""
        self._dirty.discard("data")
        if t.shape != self._d.shape:   # a data-dependent top (Filter) changed shape in forward
            self._dirty.discard("diff")
            self._d = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
            self._owned["diff"] = True
        self._t = t
        self._owned["data"] = True

    @property
    def diff_tensor(self) -> torch.Tensor:
        self._sync_to_device("diff")
        return self._d

    @diff_tensor.setter
    def diff_tensor(self, t: torch.Tensor) -> None:
        self._dirty.discard("diff")
        self._d = t
        self._owned["diff"] = True

    def write(self, t: torch.Tensor, fresh: bool = False) -> None:
        """Store a computed value as Caffe does: into the blob's memory while a view of it is
        alive (reshaped to fit, keeping the memory when it is large enough), else take ``t``;
        ``fresh``: nothing else holds ``t``'s memory, so a view of it needs no copy."""
        if self._viewed("data"):
            if t.shape != self._t.shape:
                self.reshape(*t.shape)
            self._dirty.discard("data")
            host_copy(self._t, t)
        else:
            self.tensor = t
            self._owned["data"] = fresh

    def take(self, arr: np.ndarray, owned: bool = True) -> np.ndarray:
        """``write(torch.from_numpy(arr), fresh=True)`` for an engine's CPU output, and a view
        to hand out. A small output, one whose view is kept, or one not ``owned`` (a buffer the
        engine keeps) is copied into the array the blob last took (no tensor made, no memory
        held across the engine's next run)."""
        fits = self._fits(arr)
        if not owned and not fits:
            arr, owned = arr.copy(), True
        if fits and (not owned or arr.size <= COPY_UNDER or self._viewed("data")):
            mem = self._taken[1]
            np.copyto(mem, arr)
        elif self._viewed("data"):           # a view is alive: its memory is written into
            self.write(torch.from_numpy(arr))
            mem = self._t.detach().numpy()
            self._taken = (self._t, mem)
        else:
            self.tensor = torch.from_numpy(arr)
            mem, self._taken = arr, (self._t, arr)
        view = mem.view()                     # (an object of its own: the weakref dies with it)
        refs = self._views["data"]
        if len(refs) > 4:
            refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(view))
        return view

    def _fits(self, arr: np.ndarray) -> bool:
        last = self._taken
        return (last is not None and last[0] is self._t and last[1].shape == arr.shape
                and last[1].dtype == arr.dtype)

    def write_diff(self, g: torch.Tensor) -> None:
        if self._viewed("diff") and g.shape == self._d.shape:
            self._dirty.discard("diff")
            with torch.no_grad():
                self._d.copy_(g)
        else:
            self.diff_tensor = g
            self._owned["diff"] = False

    def _viewed(self, which: str) -> bool:
        refs = self._views[which]
        if not refs:
            return which in self._host
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs) or which in self._host

    def _sync_to_device(self, which: str) -> None:
        if which in self._dirty:
            self._dirty.discard(which)
            dst = self._t if which == "data" else self._d
            with torch.no_grad():
                dst.copy_(torch.from_numpy(self._host[which]))

    def _own(self, which: str) -> None:
        """Give the blob memory of its own before a view of it is handed out (see above)."""
        if self._owned[which]:
            return
        src = (self._t if which == "data" else self._d).detach()
        mine = torch.empty_like(src)          # same layout (channels_last stays)
        mine.copy_(src)
        if which == "data":
            self._t = mine.requires_grad_(self._t.requires_grad and self._t.is_leaf)
        else:
            self._d = mine
        self._owned[which] = True

    def _view(self, which: str) -> np.ndarray:
        if self._pending is not None:
            self._pending()
        self._own(which)
        t = (self._t if which == "data" else self._d).detach()
        if t.device.type == "cpu":
            arr = t.numpy()
            refs = self._views[which]
            if len(refs) > 4:                   # drop the dead ones (input blobs are never written)
                refs[:] = [r for r in refs if r() is not None]
            refs.append(weakref.ref(arr))
            return arr
        host = self._host.get(which)
        if which not in self._dirty:            # refresh from the device, in place when it fits
            if host is None or host.shape != tuple(t.shape) or host.dtype != np.dtype(str(t.dtype)[6:]):
                host = self._host[which] = t.cpu().numpy()
            else:
                np.copyto(host, t.cpu().numpy())
        self._dirty.add(which)
        return host

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
        """Resize (pycaffe's ``blob.reshape(n, c, h, w)``); keeps device and dtype, and the
        memory when the new shape fits in it (Caffe's capacity rule; values are then whatever
        the memory held, as in Caffe)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if shape == self.shape:
            return
        for which in ("data", "diff"):
            self._sync_to_device(which)
        t, d = self._t.detach(), self._d.detach()
        self._host.clear()
        self._dirty.clear()
        grad = self._t.requires_grad and self._t.is_leaf
        new_t = _fit(t, shape)
        self._t = (new_t if new_t is not None else torch.zeros(shape, dtype=t.dtype, device=t.device)
                   ).requires_grad_(grad)
        new_d = _fit(d, shape)
        self._d = new_d if new_d is not None else torch.zeros(shape, dtype=d.dtype, device=d.device)
        # Memory kept stays as owned as it was; fresh memory is the blob's own.
        self._owned["data"] = self._owned["data"] or new_t is None
        self._owned["diff"] = self._owned["diff"] or new_d is None

    def __repr__(self) -> str:
        return f"Blob(shape={self.shape})"


_param_views = 0
_live: list = []        # (weakref to a parameter's numpy view, its bits at the last forward)


def param_views() -> int:
    """Changes whenever a numpy view of a parameter was handed out, or one still alive was
    written since ``look_at_param_views`` last ran: the key of every cache of derived weights
    (folded, packed, an engine's), as torch's version counters miss numpy's writes."""
    return _param_views


def _bits(arr: np.ndarray) -> np.ndarray:
    return arr.view(f"u{arr.itemsize}")     # compared as bits: a NaN weight equals itself


def look_at_param_views() -> None:
    """Before a forward that may use cached derived weights: count a write through a live
    parameter view (a user's ``W = net.params[..][0].data`` kept and written after a forward).
    Costs a compare of the viewed parameters, only while such views are alive."""
    global _param_views
    if not _live:
        return
    keep = []
    for ref, seen in _live:
        arr = ref()
        if arr is None:
            continue
        if seen is None or not np.array_equal(_bits(arr), seen):
            _param_views += seen is not None    # (a new view: counted when handed out)
            seen = _bits(arr).copy()
        keep.append((ref, seen))
    _live[:] = keep


def diff_viewed(param: torch.Tensor) -> bool:
    """Whether a numpy view of ``param``'s diff (its ``.grad``) is alive: then the solver
    clears the diff in place instead of dropping it, so the view follows (Caffe's memory)."""
    refs = getattr(param, "_brewnet_diff_views", None)
    if not refs:
        return False
    refs[:] = [r for r in refs if r() is not None]
    return bool(refs)


class ParamBlob(Blob):
    """A layer parameter: ``tensor`` is the layer's leaf tensor, ``diff`` its ``.grad``.

    Caffe accumulates parameter diffs until the solver clears them, as torch's ``.grad`` does.
    """

    def __init__(self, layer, index: int):
        self._layer, self._index = layer, index
        self._host, self._dirty = {}, set()
        self._views = {"data": [], "diff": []}
        self._owned = {"data": True, "diff": True}     # the layer's own tensors

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
        arr = super()._view(which)
        if which == "data" and arr.dtype.kind == "f":
            if len(_live) > 64:
                _live[:] = [e for e in _live if e[0]() is not None]
            _live.append((weakref.ref(arr), None))     # its bits: at the next forward
        if which == "diff":
            t = self._t if self._t._base is None else self._t._base
            if not hasattr(t, "_brewnet_diff_views"):
                t._brewnet_diff_views = []          # on the tensor: dies with it
            t._brewnet_diff_views.append(weakref.ref(arr))
        return arr

    def reshape(self, *shape) -> None:
        raise ValueError("parameter blobs cannot be reshaped")


def for_layers(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """An input's or a data layer's top as the layers after it read it: NHWC in a CPU conv net
    (``channels_last``), where an NCHW batch would keep every convolution after it in NCHW."""
    return nhwc(t) if channels_last and t.dim() == 4 else t


def nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in channels_last memory. One channel gets NHWC strides too: torch keeps the NCHW
    ones there (the same memory), and every layer after it would then compute in NCHW."""
    t = t.contiguous(memory_format=torch.channels_last)
    if t.shape[1] == 1 and t.stride(1) != 1:
        # view + permute, not as_strided: a recorded step replays these on other batches'
        # memory, where as_strided's fixed strides and offset would not fit
        n, _, h, w = t.shape
        t = t.reshape(n, h, w, 1).permute(0, 3, 1, 2)
    return t


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, on the calling thread where both are plain CPU float arrays of one
    layout: torch's copy of a large array wakes its thread pool, and a worker that must wait for
    a core another runtime's pool is spinning on (ONNX Runtime's, OpenCV's) stalls the call by
    milliseconds (benchmarks/zoo.py)."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.dtype in (torch.float32, torch.float64)):
        np.copyto(dst.detach().numpy(), src.detach().numpy())   # any strides: numpy's loop
    else:
        with torch.no_grad():
            dst.copy_(src)
