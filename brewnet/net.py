"""Net: a DAG of layers over named blobs, built from a NetParameter for one NetState.

Forward runs the layers in prototxt order with torch ops; backward is autograd, seeded as
Caffe's backward is: every loss top by its loss weight (stored in the top's diff), every other
net output by whatever its diff holds. In-place layers (top == bottom) rebind the blob name to the
new value; the blob's diff is the gradient of the first value bound to the name, as in Caffe.
"""
from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from typing import Sequence

import torch

from .blob import Blob, ParamBlob
from .fusion import Folder
from .layers import Layer, LayerError, layer_class
from .passes import filter_net, make_state
from .proto import caffe_pb2 as pb
from .pycaffe import NetError, PycaffeNet

log = logging.getLogger("brewnet")
INT_MAX = 2 ** 31 - 1     # Caffe's blobs count elements in an int


def _load_param(source) -> "pb.NetParameter":
    from .proto.io import read_net

    if isinstance(source, pb.NetParameter):
        from .proto.upgrade import upgrade_net

        return upgrade_net(source)
    return read_net(os.fspath(source))


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in channels_last memory. One channel gets NHWC strides too: torch keeps the NCHW
    ones there (the same memory), and every layer after it would then compute in NCHW."""
    t = t.contiguous(memory_format=torch.channels_last)
    if t.shape[1] == 1 and t.stride(1) != 1:
        t = t.as_strided(t.shape, (t.stride(0), 1, t.stride(2), t.stride(3)))
    return t


class Net(PycaffeNet):
    """A Caffe network.

    ``Net(prototxt, phase, level=0, stages=(), weights=None)``; ``prototxt`` is a path, a
    NetParameter or prototxt text. pycaffe's older orders ``Net(prototxt, phase)`` and
    ``Net(prototxt, weights, phase)`` are accepted too.
    """

    def __init__(self, net, *args, level: int = 0, stages: Sequence[str] = (), weights=None,
                 phase=None, device=None):
        if args and isinstance(args[0], (str, os.PathLike)):      # Net(model, weights, phase)
            weights, args = args[0], args[1:]
        if args:
            phase = args[0]
        if len(args) > 1:
            raise TypeError("Net(net, phase[, level, stages, weights]) got too many positional arguments")
        phase = pb.TEST if phase is None else int(phase)
        param = _load_param(net)
        self.phase = phase
        self.param = filter_net(param, make_state(phase, level, stages, param.state))
        self.name = self.param.name
        from .mode import default_device

        self.device = torch.device(device) if device is not None else default_device()
        self._build()
        if weights:
            from .weights import load_weights

            load_weights(self, weights, require_match=True)   # another net's file is an error

    # -- construction ----------------------------------------------------------------------
    def _build(self) -> None:
        self.layer_list: list[Layer] = []              # torch side; pycaffe's views: .layers
        self.blobs: OrderedDict[str, Blob] = OrderedDict()
        self.bottom_lists: list[list[str]] = []
        self.top_lists: list[list[str]] = []
        self._loss_weights: dict[str, float] = {}     # blob name -> weight (Caffe's blob_loss_weights)
        self._propagate: list[list[bool]] = []
        self._owners: dict[str, tuple[Layer, int]] = {}  # shared param name -> owning (layer, index)
        self.lr_mults: list[float] = []                # per learnable param, in self.learnable order
        self.decay_mults: list[float] = []
        self.learnable: list[torch.Tensor] = []
        self._has_lr: list[bool] = []                  # per learnable: lr_mult/decay_mult given,
        self._has_decay: list[bool] = []               # and whether it can be learned at all
        self._capable: list[bool] = []
        self._shapes: dict[str, tuple] = {}
        names = set()
        for lp in self.param.layer:
            if lp.name in names:  # Caffe allows it (mnist_autoencoder has two 'loss' layers)
                log.warning("Net '%s': duplicate layer name '%s'; by-name lookups see the last one",
                            self.name, lp.name)
            names.add(lp.name)
            self._append(lp)
        consumed = {b for bs in self.bottom_lists for b in bs}
        # Caffe keeps the remaining blobs in a std::set: outputs come sorted by name.
        self.outputs = sorted(b for b in self.blobs if b not in consumed)
        self.inputs = [t for l, ts in zip(self.layer_list, self.top_lists) if l.type == "Input" for t in ts]
        self.layer_by_name = {l.name: l for l in self.layer_list}
        self.params = OrderedDict((l.name, [ParamBlob(l, i) for i in range(len(l.blobs))])
                                  for l in self.layer_list if l.blobs)
        self._needs_backward = self.param.force_backward or any(w != 0 for w in self._loss_weights.values())
        self._input_shapes = self._current_input_shapes()
        self._frontiers: dict[tuple[int, int], list] = {}
        self._folder = Folder(self)
        self._reset_loss_diffs()
        # oneDNN's CPU convolutions and pooling run much faster on NHWC activations
        # (benchmarks/inference.py); CUDA keeps NCHW.
        self._channels_last = any(l.type in ("Convolution", "Deconvolution", "Pooling")
                                  for l in self.layer_list)
        if self.device.type != "cpu":
            self.to(self.device)

    def _append(self, lp) -> None:
        cls = layer_class(lp.type, lp.name)
        if cls.is_loss and not lp.top:
            # Caffe's AutoTopBlobs: a loss layer written without a top still gets its loss top.
            name, k = "(automatic)", 0
            while name in self.blobs:
                k, name = k + 1, f"(automatic){k + 1}"
            lp.top.append(name)
        layer = cls(lp, self.phase)
        bottoms = list(lp.bottom)
        for j, b in enumerate(bottoms):
            if b not in self.blobs:
                raise NetError(f"Layer '{lp.name}' (type {lp.type}): unknown bottom blob '{b}' "
                               f"(bottom {j}); no earlier layer produces it")
        for t in lp.top:
            if t in self.blobs and t not in bottoms:
                raise NetError(f"Layer '{lp.name}': top blob '{t}' is produced by multiple layers")
        try:
            layer.check_counts(len(bottoms), len(lp.top))
            shapes = [self._shapes[b] for b in bottoms]
            layer.setup(shapes)
            tops = self._reshape_layer(layer, shapes)
        except (LayerError, NetError):
            raise
        except Exception as e:  # a layer bug or an unexpected param: name the layer at least
            if not layer.wrap_errors:
                raise
            raise NetError(f"Layer '{lp.name}' (type {lp.type}) failed to set up for bottom shapes "
                           f"{[self._shapes[b] for b in bottoms]}: {e}") from e
        for t, s in zip(lp.top, tops):
            # An empty blob: Caffe never allocates its data, so the net fails at build time
            # (only an Input left unshaped, (0,), waits for the user to reshape it).
            if 0 in s and not (layer.type == "Input" and s == (0,)):
                raise NetError(f"Layer '{lp.name}' (type {lp.type}): top '{t}' has shape {s}; a "
                               "dimension of 0 (batch size 0?) makes an empty blob, whose data "
                               "Caffe never allocates; every dimension must be positive")
        self.layer_list.append(layer)
        self.bottom_lists.append(bottoms)
        self.top_lists.append(list(lp.top))
        for t, s in zip(lp.top, tops):
            self._shapes[t] = s
            if t not in self.blobs:
                try:
                    self.blobs[t] = Blob(torch.zeros(s, dtype=torch.float32))
                except RuntimeError as e:    # out of memory
                    raise NetError(f"Layer '{lp.name}' (type {lp.type}): cannot allocate top "
                                   f"'{t}' of shape {s}: {str(e).splitlines()[0]}") from None
        # Loss weights: explicit per top, else 1 on top[0] of a loss layer.
        weights = list(lp.loss_weight) or ([1.0] + [0.0] * (len(lp.top) - 1) if layer.is_loss else [])
        if weights and len(weights) != len(lp.top):
            raise NetError(f"Layer '{lp.name}': loss_weight must be given once per top "
                           f"({len(lp.top)}), got {len(weights)}")
        for t, w in zip(lp.top, weights):
            if w:
                self._loss_weights[t] = float(w)
        pd = list(lp.propagate_down)
        if pd and len(pd) != len(bottoms):
            raise NetError(f"Layer '{lp.name}': propagate_down must be given once per bottom")
        self._propagate.append([(pd[j] if pd else True) and layer.allow_backward(j)
                                for j in range(len(bottoms))])
        self._append_params(layer, lp)

    def _reshape_layer(self, layer: Layer, shapes) -> list[tuple]:
        tops = [tuple(int(d) for d in s) for s in layer.reshape(shapes)]
        if len(tops) != len(layer.param.top):
            raise NetError(f"Layer '{layer.name}': produced {len(tops)} top shapes for "
                           f"{len(layer.param.top)} tops")
        for name, s in zip(layer.param.top, tops):   # Caffe's Blob::Reshape CHECKs
            if any(d < 0 for d in s):
                raise NetError(f"Layer '{layer.name}' (type {layer.type}): top '{name}' would "
                               f"have a negative dimension: {s} (bottom shapes {list(shapes)})")
            if math.prod(s) > INT_MAX:
                raise NetError(f"Layer '{layer.name}' (type {layer.type}): top '{name}' of shape "
                               f"{s} exceeds Caffe's blob size limit INT_MAX ({INT_MAX}) "
                               f"(bottom shapes {list(shapes)})")
        return tops

    def _append_params(self, layer: Layer, lp) -> None:
        """Caffe's ``AppendParam``: every owned blob is a learnable param (BatchNorm's statistics
        too, with lr_mult 0, so solver states line up with Caffe's); a blob shared by name takes
        an lr_mult/decay_mult the owner left unset, and a mismatch is an error."""
        if len(lp.param) > len(layer.blobs):
            raise NetError(f"Layer '{lp.name}': {len(lp.param)} param specs for "
                           f"{len(layer.blobs)} parameter blobs")
        for j in range(len(layer.blobs)):
            spec = lp.param[j] if j < len(lp.param) else pb.ParamSpec()
            if spec.name and spec.name in self._owners:
                owner, k, idx = self._owners[spec.name]
                src, dst = owner.blobs[k], layer.blobs[j]
                strict = spec.share_mode == pb.ParamSpec.STRICT
                if (tuple(src.shape) != tuple(dst.shape)) if strict else (src.numel() != dst.numel()):
                    raise NetError(f"Layer '{lp.name}': cannot share param '{spec.name}' of shape "
                                   f"{tuple(src.shape)} (layer '{owner.name}') with shape {tuple(dst.shape)}")
                layer.blobs[j] = src if tuple(src.shape) == tuple(dst.shape) else src.view(dst.shape)
                for field, values, given in (("lr_mult", self.lr_mults, self._has_lr),
                                             ("decay_mult", self.decay_mults, self._has_decay)):
                    if spec.HasField(field):
                        if given[idx] and values[idx] != getattr(spec, field):
                            raise NetError(f"Layer '{lp.name}': shared param '{spec.name}' has "
                                           f"mismatched {field} ({getattr(spec, field)} vs {values[idx]})")
                        given[idx], values[idx] = True, getattr(spec, field)
                if self._capable[idx]:
                    src.requires_grad_(self.lr_mults[idx] != 0)
                continue
            blob = layer.blobs[j]
            capable = blob.requires_grad            # BatchNorm's statistics are never learned
            if spec.name:
                self._owners[spec.name] = (layer, j, len(self.learnable))
            self.learnable.append(blob)
            self.lr_mults.append(spec.lr_mult if capable else 0.0)
            self.decay_mults.append(spec.decay_mult)
            self._has_lr.append(spec.HasField("lr_mult") or not capable)
            self._has_decay.append(spec.HasField("decay_mult"))
            self._capable.append(capable)
            if capable and spec.lr_mult == 0:
                blob.requires_grad_(False)

    def _current_input_shapes(self):
        return [tuple(self.blobs[n].shape) for n in self.inputs]

    def _reset_loss_diffs(self) -> None:
        for name, w in self._loss_weights.items():
            b = self.blobs[name]
            b.diff_tensor = torch.full_like(b.tensor.detach(), w)

    def reshape(self) -> None:
        """Re-infer every shape from the input blobs' current shapes (Caffe's ``Net::Reshape``)."""
        for n in self.inputs:
            self._shapes[n] = self.blobs[n].shape
        for layer, bottoms, tops in zip(self.layer_list, self.bottom_lists, self.top_lists):
            if layer.type == "Input":
                continue
            new = self._reshape_layer(layer, [self._shapes[b] for b in bottoms])
            for t, s in zip(tops, new):
                self._shapes[t] = s
        for name, s in self._shapes.items():
            if name not in self.inputs:
                self.blobs[name].reshape(*s)
        self._input_shapes = self._current_input_shapes()
        self._reset_loss_diffs()

    def to(self, device=None, dtype=None) -> "Net":
        """Move (and optionally cast) every blob and parameter, keeping parameter sharing."""
        device = torch.device(device) if device is not None else self.device
        moved: dict[int, torch.Tensor] = {}

        def mv(t):
            if id(t) not in moved:
                n = t.detach().to(device=device, dtype=dtype or t.dtype)
                moved[id(t)] = n.requires_grad_(t.requires_grad) if t.is_leaf else n
            return moved[id(t)]

        # Views of shared params (PERMISSIVE sharing) are re-made from the moved base.
        for layer in self.layer_list:
            layer.blobs = [mv(b) if b._base is None else mv(b._base).view(b.shape) for b in layer.blobs]
            if hasattr(layer, "to"):
                layer.to(device=device, dtype=dtype)
        self.learnable = [moved.get(id(t), t) for t in self.learnable]
        for b in self.blobs.values():
            b.tensor = b.tensor.detach().to(device=device, dtype=dtype or b.tensor.dtype)
            b.diff_tensor = b.diff_tensor.to(device=device, dtype=dtype or b.diff_tensor.dtype)
        self._channels_last = self._channels_last and device.type == "cpu"
        if device.type == "cuda":
            # cuDNN's default TF32 convolutions are ~1e-3 off; Caffe's numbers need true float32.
            torch.backends.cudnn.allow_tf32 = False
        self.device = device
        return self

    # -- running ----------------------------------------------------------------------------
    def _index(self, name_or_index, default: int) -> int:
        if name_or_index is None:
            return default
        if isinstance(name_or_index, int):
            return name_or_index
        try:
            return [l.name for l in self.layer_list].index(name_or_index)
        except ValueError:
            raise NetError(f"no layer named '{name_or_index}'") from None

    def forward_tensors(self, start=None, end=None) -> torch.Tensor:
        """Run layers ``start..end`` (names or indices, inclusive); returns the weighted loss."""
        i0, i1 = self._index(start, 0), self._index(end, len(self.layer_list) - 1)
        if self._current_input_shapes() != self._input_shapes:
            self.reshape()
        grad = self._needs_backward and torch.is_grad_enabled()
        if i0 == 0 or not hasattr(self, "_ran"):
            # Per-layer bottoms/tops as computed, for backward over any range (grad mode only:
            # in inference they would keep every in-place intermediate alive).
            self._ran: dict[int, tuple[list, list]] = {}
        fed: dict[str, torch.Tensor] = {}
        if i0 == 0:
            for j, layer in enumerate(self.layer_list):
                if layer.type != "Input":
                    continue
                ts = []
                for n in self.top_lists[j]:
                    t = self.blobs[n].tensor
                    if self.param.force_backward and t.is_floating_point() and not t.requires_grad:
                        t = t.detach().requires_grad_(True)
                        self.blobs[n].tensor = t
                    ts.append(t)
                    if self._channels_last and t.dim() == 4:
                        # The blob stays NCHW for numpy users; the layers compute in NHWC.
                        fed[n] = _nhwc(t)
                if grad:
                    self._ran[j] = ([], ts)
        loss = torch.zeros((), device=self.device)
        chains = {} if grad else self._folder.chains
        with torch.set_grad_enabled(grad):
            i = i0 - 1
            while i < i1:
                i += 1
                layer = self.layer_list[i]
                if layer.type == "Input":
                    continue
                last = chains.get(i, i1 + 1)
                if last <= i1:  # Convolution -> BatchNorm -> Scale folded into one convolution
                    b = self.bottom_lists[i][0]
                    x = fed[b] if b in fed else self.blobs[b].tensor
                    top = self.top_lists[i][0]
                    self.blobs[top].tensor = self._folder.run(i, x)
                    fed.pop(top, None)   # an in-place chain on an input: later layers read its result
                    i = last
                    continue
                bottoms = [fed[b] if b in fed else self.blobs[b].tensor for b in self.bottom_lists[i]]
                if not all(self._propagate[i]):
                    bottoms = [b if p else b.detach() for b, p in zip(bottoms, self._propagate[i])]
                tops = layer.forward(bottoms)
                if grad:
                    self._ran[i] = (bottoms, tops)
                for name, t in zip(self.top_lists[i], tops):
                    self.blobs[name].tensor = t
                    fed.pop(name, None)   # in place on an input: the NHWC copy is stale now
                    w = self._loss_weights.get(name)
                    if w:
                        loss = loss + w * t.detach().sum()
        return loss

    def _frontier(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(layer, top index) pairs that seed a backward over layers lo..hi: tops with a loss
        weight, and tops no later layer in the range consumes (the range's outputs)."""
        key = (lo, hi)
        if key not in self._frontiers:
            out = []
            for j in range(lo, hi + 1):
                for k, name in enumerate(self.top_lists[j]):
                    later = any(name in self.bottom_lists[i] for i in range(j + 1, hi + 1))
                    if name in self._loss_weights or not later:
                        out.append((j, k))
            self._frontiers[key] = out
        return self._frontiers[key]

    def backward_tensors(self, start=None, end=None, blob_diffs: bool = True) -> None:
        """Backpropagate over layers ``start`` down to ``end`` (default: all), seeded as Caffe:
        loss tops by their loss weight, the range's other outputs by their diffs. Accumulates
        parameter ``.grad`` (Caffe's param diffs); with ``blob_diffs`` also writes blob diffs
        (an in-place blob's diff is the gradient of the value its first producer wrote)."""
        if not self._needs_backward or not getattr(self, "_ran", None):
            return
        hi = self._index(start, len(self.layer_list) - 1)
        lo = self._index(end, 0)
        if any(j not in self._ran for j in range(lo, hi + 1)):
            raise NetError(f"backward over layers {lo}..{hi} needs a forward over them first")
        seeds, grads = [], []
        for j, k in self._frontier(lo, hi):
            t = self._ran[j][1][k]
            if t.requires_grad:
                seeds.append(t)
                grads.append(self.blobs[self.top_lists[j][k]].diff_tensor.to(t.dtype))
        params = [p for p in self._range_params(lo, hi) if p.requires_grad]
        if not blob_diffs:
            if seeds:
                torch.autograd.backward(seeds, grads, inputs=params)
            return
        targets: dict[str, torch.Tensor] = {}
        for j in range(lo, hi + 1):
            bottoms, tops = self._ran[j]
            for name, t in zip(self.bottom_lists[j], bottoms):
                targets.setdefault(name, t)
            for name, t in zip(self.top_lists[j], tops):
                if name not in self.bottom_lists[j] and name not in self._loss_weights:
                    targets.setdefault(name, t)
        names = [n for n, t in targets.items() if t.requires_grad]
        # No seed (e.g. only a Silence consumes the blobs): every diff in the range is zero.
        got = [None] * (len(names) + len(params))
        if seeds:
            got = torch.autograd.grad(seeds, [targets[n] for n in names] + params, grads,
                                      allow_unused=True, retain_graph=True)
        for n, g in zip(names, got[:len(names)]):
            b = self.blobs[n]
            b.diff_tensor = torch.zeros(b.shape, dtype=b.tensor.dtype, device=b.tensor.device) \
                if g is None else g.detach()
        for p, g in zip(params, got[len(names):]):
            if g is not None:
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad += g

    def _range_params(self, lo: int, hi: int) -> list[torch.Tensor]:
        return self._all_params(self.layer_list[lo:hi + 1])

    def _all_params(self, layers=None) -> list[torch.Tensor]:
        seen, out = set(), []
        for layer in self.layer_list if layers is None else layers:
            for b in layer.blobs:
                leaf = b if b._base is None else b._base
                if id(leaf) not in seen:
                    seen.add(id(leaf))
                    out.append(leaf)
        return out

    def clear_param_diffs(self) -> None:
        for p in self._all_params():
            if p.grad is not None:
                p.grad.zero_()

    def __repr__(self) -> str:
        return f"Net(name={self.name!r}, layers={len(self.layer_list)}, blobs={len(self.blobs)})"
