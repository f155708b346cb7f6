"""In-memory data layers: Input, DummyData, MemoryData (database readers live in brewnet.data).

These layers have no bottoms, so they cannot take dtype/device from one: their tops are float32
on the CPU until the net calls ``to(device, dtype)``. Data tops have no backward.
"""
from __future__ import annotations

import numpy as np
import torch

from ..fillers import fill
from ..proto import caffe_pb2 as pb
from .base import Layer
from .registry import register


class SourceLayer(Layer):
    """The base of every data layer: no bottoms, tops it makes itself (float32 on the CPU until
    the net calls ``to``). The database readers in ``brewnet.data`` build on it."""

    routing = True
    exact_bottoms = 0
    device = torch.device("cpu")
    dtype = torch.float32

    def to(self, device=None, dtype=None):
        self.device = torch.device(device) if device is not None else self.device
        self.dtype = dtype or self.dtype
        return self


@register("Input")
class Input(SourceLayer):
    """Declares the net's externally fed blobs. Shapes: none -> input_param.shape (one for all
    tops, or one per top; none: (0,) until the blobs are reshaped). The net fills these tops
    itself; ``forward`` gives Caffe's initial (zero) blobs."""

    min_tops = 1

    def setup(self, bottom_shapes):
        shapes = [tuple(int(d) for d in s.dim) for s in self.param.input_param.shape]
        if len(shapes) not in (0, 1, self.num_tops):
            raise self.fail(f"give input_param.shape once, once per top ({self.num_tops}), or "
                            f"not at all; got {len(shapes)} shapes")
        if any(d < 0 for s in shapes for d in s):
            raise self.fail(f"input shapes must not be negative, got {shapes}")
        self.shapes = (shapes * self.num_tops if len(shapes) == 1 else shapes) or [(0,)] * self.num_tops

    def reshape(self, bottom_shapes):
        return list(self.shapes)

    def forward(self, bottoms):
        return [torch.zeros(s, dtype=self.dtype, device=self.device) for s in self.shapes]


@register("DummyData")
class DummyData(SourceLayer):
    """Tops filled by fillers. Shapes: dummy_data_param.shape (once or per top), or the legacy
    num/channels/height/width lists (each once or per top). data_filler: none (constant 0), one
    for all tops, or one per top. Constant fillers fill once at setup; every other filler
    refills its top at each forward (Caffe's refill rule)."""

    min_tops = 1

    def setup(self, bottom_shapes):
        p, n = self.param.dummy_data_param, self.num_tops
        if len(p.data_filler) not in (0, 1, n):
            raise self.fail(f"number of data fillers must be 0, 1 or the number of tops ({n}); "
                            f"got {len(p.data_filler)}")
        legacy = [list(p.num), list(p.channels), list(p.height), list(p.width)]
        if any(legacy):
            if len(p.shape):
                raise self.fail("both shape and legacy num/channels/height/width were given")
            for name, vals in zip(("num", "channels", "height", "width"), legacy):
                if len(vals) not in (1, n):
                    raise self.fail(f"give '{name}' once or once per top ({n}); got {len(vals)}")
            self.shapes = [tuple(v[0] if len(v) == 1 else v[i] for v in legacy) for i in range(n)]
        else:
            if len(p.shape) not in (1, n):
                raise self.fail(f"give 'shape' once or once per top ({n}); got {len(p.shape)}")
            self.shapes = [tuple(int(d) for d in p.shape[0 if len(p.shape) == 1 else i].dim)
                           for i in range(n)]
        fillers = list(p.data_filler) or [pb.FillerParameter(type="constant", value=0)]
        self.fillers = [fillers[0 if len(fillers) == 1 else i] for i in range(n)]
        self.tops = [self._filled(i) if f.type == "constant" else None
                     for i, f in enumerate(self.fillers)]

    def _filled(self, i):
        t = torch.empty(self.shapes[i], dtype=torch.float32)
        return fill(t, self.fillers[i]).to(device=self.device, dtype=self.dtype)

    def to(self, device=None, dtype=None):
        super().to(device, dtype)
        self.tops = [None if t is None else t.to(device=self.device, dtype=self.dtype) for t in self.tops]
        return self

    def reshape(self, bottom_shapes):
        return list(self.shapes)

    def forward(self, bottoms):
        return [t if t is not None else self._filled(i) for i, t in enumerate(self.tops)]


@register("MemoryData")
class MemoryData(SourceLayer):
    """Serves batches from arrays given with ``set_input_arrays(data, labels)``.
    Shapes: none -> data (batch_size, channels, height, width), label (batch_size,).
    Params: memory_data_param {batch_size, channels, height, width} (all required, positive).
    Each forward returns the next batch and wraps around at the end, as Caffe's Reset/Forward."""

    exact_tops = 2

    def setup(self, bottom_shapes):
        p = self.param.memory_data_param
        self.batch_size = p.batch_size
        self.item_shape = (p.channels, p.height, p.width)
        if self.batch_size <= 0 or min(self.item_shape) <= 0:
            raise self.fail("memory_data_param batch_size, channels, height and width must all be "
                            f"given and positive; got {self.batch_size}, {self.item_shape}")
        self.data = self.labels = None
        self.pos = 0

    def set_input_arrays(self, data, labels) -> None:
        """Use ``data`` (N, C, H, W) and ``labels`` (N,) or (N, 1, 1, 1); N a multiple of the
        batch size. Float32 C-contiguous numpy arrays are used without a copy (Caffe keeps the
        caller's memory too); anything else is converted."""
        d = torch.as_tensor(np.ascontiguousarray(data, dtype=np.float32))
        lab = torch.as_tensor(np.ascontiguousarray(labels, dtype=np.float32))
        if d.dim() != 4 or tuple(d.shape[1:]) != self.item_shape:
            raise self.fail(f"data array must have shape (N, {', '.join(map(str, self.item_shape))}), "
                            f"got {tuple(d.shape)}")
        if lab.dim() not in (1, 4) or (lab.dim() == 4 and tuple(lab.shape[1:]) != (1, 1, 1)):
            raise self.fail(f"labels array must have shape (N,) or (N, 1, 1, 1), got {tuple(lab.shape)}")
        if lab.shape[0] != d.shape[0]:
            raise self.fail(f"data and labels must have the same first dimension, got "
                            f"{d.shape[0]} and {lab.shape[0]}")
        if d.shape[0] == 0 or d.shape[0] % self.batch_size:
            raise self.fail(f"the number of items ({d.shape[0]}) must be a positive multiple of "
                            f"batch_size {self.batch_size}")
        self.data, self.labels, self.pos = d, lab.reshape(-1), 0

    def reshape(self, bottom_shapes):
        return [(self.batch_size,) + self.item_shape, (self.batch_size,)]

    def forward(self, bottoms):
        if self.data is None:
            raise self.fail("no data: call set_input_arrays(data, labels) before forward")
        i, b = self.pos, self.batch_size
        self.pos = (i + b) % self.data.shape[0]
        return [t[i:i + b].to(device=self.device, dtype=self.dtype) for t in (self.data, self.labels)]
