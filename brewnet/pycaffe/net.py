"""pycaffe's view of a Net: numpy arrays in and out, name-keyed dictionaries, layer views.

The core ``brewnet.net.Net`` (torch tensors, ``forward_tensors``/``backward_tensors``, the
per-layer step API) knows nothing of pycaffe's quirks; this subclass alone does.
"""
from __future__ import annotations

import functools
import time
from collections import OrderedDict

import numpy as np

from .. import net as core
from ..blob import ParamBlob
from ..execution import engines, process, runners, threads
from ..execution.lean import LeanForward
from ..net import NetError


class LayerView:
    """pycaffe's view of a layer: ``type``, ``name`` and ``blobs`` as numpy-backed Blobs."""

    def __init__(self, layer):
        self.layer, self.type, self.name = layer, layer.type, layer.name
        self.blobs = [ParamBlob(layer, i) for i in range(len(layer.blobs))]

    def __repr__(self) -> str:
        return f"<{self.type} layer '{self.name}'>"


class Net(core.Net):
    """pycaffe's ``caffe.Net``: ``Net(prototxt, phase, level=0, stages=(), weights=None)``, and
    the older orders ``Net(prototxt, phase)`` and ``Net(prototxt, weights, phase)``.
    ``engine``: what runs repeated whole forwards of a forward-only net (auto, eager, compiled,
    onnxruntime, onnxruntime-1thread, onnxruntime-nospin, openvino, opencv: brewnet/execution/engines.py; default
    ``BREWNET_ENGINE``, else auto).
    ``precision="bf16"`` (opt-in, ``BREWNET_PRECISION``): those forwards in bfloat16 from the
    first call, on CPUs with AMX or AVX512-BF16; fp32 (Caffe's numbers) is the default."""

    def __init__(self, *args, engine: str | None = None, precision: str | None = None, **kwargs):
        self.engine = engines.engine_name(engine)
        self.precision = engines.precision_name(precision)
        if self.engine in runners.ORT_ENGINES:
            runners.need_onnxruntime()      # asked for by name: missing is the user's error now
        elif self.engine == "openvino":
            runners.need_openvino()
        refusal = runners.bf16_refusal() if self.precision == "bf16" else None
        if refusal:
            raise NetError(refusal)
        super().__init__(*args, **kwargs)
        # the engine a cache knows, ready for the first call; only on trained weights (a net
        # filled at random gets its weights next: an ONNX file of those would be waste)
        if self.weights_file:
            self._prepare_engine()

    def copy_from(self, path) -> None:
        """pycaffe's ``copy_from``; the engine the cache knows for these weights is made ready."""
        super().copy_from(path)
        lean = self._lean
        if not lean.running and lean.gm is None:      # (a running graph rebuilds its engine)
            lean.engine = None
            self._prepare_engine()

    def forward(self, blobs=None, start=None, end=None, **inputs):
        """pycaffe's ``Net.forward``: feed ``inputs`` (numpy arrays keyed by input blob name),
        run, and return ``{blob name: numpy array}`` for the outputs (or ``end``'s tops). The
        arrays are views of the blobs: the next forward writes its values into them, as Caffe's."""
        if blobs is None and start is None and end is None:
            outs = self._lean.direct(inputs)     # the steady call on an engine
            if outs is not None:
                return outs
        if inputs and set(inputs) != set(self.inputs):
            raise NetError(f"forward: input arguments {sorted(inputs)} do not match the net's "
                           f"inputs {self.inputs}")
        for name, value in inputs.items():
            blob = self.blobs[name]
            # pycaffe insists on the blob's batch size; reshaping is what a user expects.
            if tuple(value.shape) != blob.shape:
                blob.reshape(*value.shape)
            blob.data[...] = value
        whole = start is None and end is None
        t0 = time.perf_counter()
        with self._threads as tuner:
            one_off = (self._lean.traces, self._lean.picks)
            if not (whole and not blobs and not self.hooked() and self._lean.run()):
                if not whole:
                    self._lean.settle()      # a partial pass reads what the graph did not write
                self._lean.drop()
                self.forward_tensors(start, end)
            if self._lean.traces != one_off[0]:
                tuner.restart()   # a one-off trace, and the graph's calls timed afresh
            elif self._lean.picks != one_off[1] or self._lean.engine is not None:
                tuner.discard()   # another engine's threads: no sample
        if whole:
            self._lean.spent += time.perf_counter() - t0
        i1 = self._index(end, len(self.layer_list) - 1)
        outs = self.top_lists[i1] if end is not None else self.outputs
        return {n: self.blobs[n].data for n in list(outs) + list(blobs or [])}

    def reshape(self) -> None:
        """Caffe's ``Net::Reshape``; a user's reshape to shapes the engine cache knows readies
        that engine, as construction does."""
        super().reshape()
        lean = self.__dict__.get("_lean")        # (none yet while the net is being built)
        if lean is not None and not lean.running:
            self._prepare_engine()

    def _prepare_engine(self) -> None:
        """The engine the cache chose, built for the first call, which can then take the steady
        call's short path: the allocator is set now, as the first general forward sets it."""
        self._lean.prepare()
        if self._lean.engine is not None:
            process.configure(self.device, keep_memory=True)

    @functools.cached_property
    def _lean(self) -> LeanForward:
        return LeanForward(self)

    @functools.cached_property
    def _threads(self) -> threads.Tuner:
        # Repeated inference keeps its memory (steady latency: process.keep_freed_memory) and
        # gets torch's threads chosen for this net (brewnet/execution/threads.py).
        process.configure(self.device, keep_memory=True)
        return threads.Tuner(self)

    def backward(self, diffs=None, start=None, end=None, **top_diffs):
        """pycaffe's ``Net.backward``: optional output diffs by name; returns input diffs. Runs
        on the blobs' current data and diffs even where no forward ran (as Caffe's)."""
        allowed = self.outputs if start is None else self.top_lists[self._index(start, 0)]
        for name, value in top_diffs.items():
            if name not in allowed:
                raise NetError(f"backward: '{name}' is not among {allowed}")
            self.blobs[name].diff[...] = value
        self._lean.before_backward()     # after a forward the lean graph ran: autograd's forward
        self.backward_tensors(start, end, blob_diffs=True)
        outs = self.inputs if end is None else self.bottom_lists[self._index(end, 0)]
        return {n: self.blobs[n].diff for n in list(outs) + list(diffs or [])}

    def before_forward(self, fn) -> None:
        """pycaffe's ``net.before_forward(fn)``: ``fn(layer index)`` before each layer's forward."""
        self.add_hook("before_forward", fn)

    def after_forward(self, fn) -> None:
        """pycaffe's ``net.after_forward(fn)``: ``fn(layer index)`` after each layer's forward."""
        self.add_hook("after_forward", fn)

    def before_backward(self, fn) -> None:
        """pycaffe's ``net.before_backward(fn)``: ``fn(layer index)`` before each layer's backward."""
        self.add_hook("before_backward", fn)

    def after_backward(self, fn) -> None:
        """pycaffe's ``net.after_backward(fn)``: ``fn(layer index)`` after each layer's backward;
        given an NCCL (``net.after_backward(nccl)``), gradients are reduced during the pass."""
        if hasattr(fn, "reduce_during_backward"):
            fn.reduce_during_backward(self)
        else:
            self.add_hook("after_backward", fn)

    def forward_all(self, blobs=None, **inputs):
        """pycaffe's ``forward_all``: any number of items, run batch by batch (the last one
        padded), outputs concatenated with the padding stripped."""
        outs = {n: [] for n in list(self.outputs) + list(blobs or [])}
        if not inputs:
            return self.forward(blobs)
        total = len(next(iter(inputs.values())))
        batch = self.blobs[self.inputs[0]].shape[0]
        for i in range(0, total, batch):
            chunk = {}
            for name, arr in inputs.items():
                part = np.asarray(arr[i:i + batch])
                if len(part) < batch:
                    part = np.concatenate([part, np.zeros((batch - len(part),) + part.shape[1:], part.dtype)])
                chunk[name] = part
            for name, value in self.forward(blobs, **chunk).items():
                outs[name].append(value[:min(batch, total - i)].copy())
        return {n: np.concatenate(v) for n, v in outs.items()}

    def save_hdf5(self, path) -> None:
        """Write the params in Caffe's HDF5 layout (pycaffe's ``Net.save_hdf5``)."""
        from ..weights import save_weights_h5

        save_weights_h5(self, path)

    def load_hdf5(self, path) -> None:
        """Load params from a Caffe HDF5 weights file (pycaffe's ``Net.load_hdf5``)."""
        self.copy_from(path)

    def set_input_arrays(self, data, labels) -> None:
        """Feed a MemoryData first layer (pycaffe's rule) from numpy arrays."""
        first = self.layer_list[0] if self.layer_list else None
        if first is None or first.type != "MemoryData":
            raise NetError("set_input_arrays needs a MemoryData layer as the first layer")
        first.set_input_arrays(data, labels)

    @functools.cached_property
    def params(self) -> "OrderedDict[str, list[ParamBlob]]":
        """``{layer name: [param blobs]}`` for layers that have params (numpy ``.data``/``.diff``)."""
        return OrderedDict((l.name, [ParamBlob(l, i) for i in range(len(l.blobs))])
                           for l in self.layer_list if l.blobs)

    @property
    def layers(self) -> list["LayerView"]:
        """A view of each layer, in net order (pycaffe's ``Net.layers``)."""
        return [LayerView(l) for l in self.layer_list]

    @property
    def layer_dict(self) -> "OrderedDict[str, LayerView]":
        """``{layer name: layer view}`` in net order (pycaffe's ``Net.layer_dict``)."""
        return OrderedDict((l.name, LayerView(l)) for l in self.layer_list)

    @property
    def top_names(self) -> "OrderedDict[str, list[str]]":
        """``{layer name: [its top blob names]}`` (pycaffe's ``Net.top_names``)."""
        return OrderedDict((l.name, list(t)) for l, t in zip(self.layer_list, self.top_lists))

    @property
    def bottom_names(self) -> "OrderedDict[str, list[str]]":
        """``{layer name: [its bottom blob names]}`` (pycaffe's ``Net.bottom_names``)."""
        return OrderedDict((l.name, list(b)) for l, b in zip(self.layer_list, self.bottom_lists))

    @property
    def _layer_names(self) -> list[str]:
        return [l.name for l in self.layer_list]

    @property
    def _blob_names(self) -> list[str]:
        return list(self.blobs)
