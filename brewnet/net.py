"""Net: a DAG of layers over named blobs, built from a NetParameter for one NetState.

Forward runs the layers in prototxt order with torch ops and stores each top with ``Blob.write``
(into the blob's memory while a numpy view of it is alive, as Caffe's blobs keep theirs). Backward
is autograd, seeded as Caffe's: every loss top by its loss weight (stored in the top's diff), every
other output of the range by whatever its diff holds. In-place layers (top == bottom) rebind the
blob name; its diff is the gradient of the first value bound to it, as in Caffe. One executor, two
speeds: ``forward_tensors``/``backward_tensors`` run a range in one autograd graph (training);
``forward_layer(i)``/``backward_layer(i)`` run one layer (``brewnet time``; and a backward where no
recorded graph covers the range). Why, and the layout: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from typing import Sequence

import torch

from . import backprop
from .blob import Blob, for_layers, look_at_param_views
from .data import layers as _data_layers  # noqa: F401  (registers the database readers)
from .errors import NetError
from .execution.folding import Folder
from .layers import Layer, LayerError, layer_class
from .params import LearnableParams
from .proto import caffe_pb2 as pb
from .proto import schema
from .proto.filter import filter_net, make_state
from .proto.io import read_net_and_source

log = logging.getLogger("brewnet")
__all__ = ["Net", "NetError"]
INT_MAX = 2 ** 31 - 1     # Caffe's blobs count elements in an int
HOOKS = ("before_forward", "after_forward", "before_backward", "after_backward")


class Net:
    """A Caffe network (the core: torch tensors; pycaffe's numpy surface is ``brewnet.Net``).

    ``Net(prototxt, phase, level=0, stages=(), weights=None, device=None)``; ``prototxt`` is a path,
    a NetParameter or prototxt text (pycaffe's older ``Net(prototxt, phase)`` and ``Net(prototxt,
    weights, phase)`` work too). Public structure: ``layer_list``, ``bottom_lists``/``top_lists``
    (blob names per layer), ``blobs``, ``shapes`` (blob name -> shape), ``propagate_down`` (per
    layer and bottom: may a gradient flow there, Caffe's propagate_down and AllowForceBackward),
    ``bottom_need_backward`` (Caffe's: does it get one), ``learnable_params``, ``inputs``, ``outputs``."""

    def __init__(self, net, *args, level: int = 0, stages: Sequence[str] = (), weights=None,
                 phase=None, device=None, proto=None):
        if args and isinstance(args[0], (str, os.PathLike)):      # Net(model, weights, phase)
            weights, args = args[0], args[1:]
        if args:
            phase = args[0]
        if len(args) > 1:
            raise TypeError("Net(net, phase[, level, stages, weights]) got too many positional arguments")
        phase = pb.TEST if phase is None else int(phase)
        # a fork's caffe.proto (``proto=``, else use_proto's or BREWNET_PROTO's) reads this net's
        # files and writes its weights (proto/schema.py)
        self.schema = schema.load(proto) if proto is not None else schema.active()
        with schema.using(self.schema):
            param, self.source = read_net_and_source(net)
        self.phase = phase
        self.param = filter_net(param, make_state(phase, level, stages, param.state))
        self.name = self.param.name
        from .execution.process import default_device

        self.device = torch.device(device) if device is not None else default_device()
        self.hooks: dict[str, list] = {w: [] for w in HOOKS}
        self._build()
        self.weights_file = weights     # the weights it was built with (None: filled at random)
        if weights:
            from .weights import load_weights

            with schema.using(self.schema):
                load_weights(self, weights, require_match=True)   # another net's file is an error

    # -- construction ----------------------------------------------------------------------
    def _build(self) -> None:
        self.layer_list: list[Layer] = []
        self.blobs: OrderedDict[str, Blob] = OrderedDict()
        self.bottom_lists: list[list[str]] = []
        self.top_lists: list[list[str]] = []
        self.shapes: dict[str, tuple] = {}
        self.propagate_down: list[list[bool]] = []
        self.learnable_params = LearnableParams()
        self._loss_weights: dict[str, float] = {}     # blob name -> weight (Caffe's blob_loss_weights)
        names = set()
        for lp in self.param.layer:
            if lp.name in names:  # Caffe allows it (mnist_autoencoder has two 'loss' layers)
                log.warning("Net '%s': duplicate layer name '%s'; by-name lookups see the last one",
                            self.name, lp.name)
            names.add(lp.name)
            self._append(lp)
        # Caffe's available_blobs: each layer takes its bottoms out and puts its tops in, so a
        # last layer working in place leaves its blob an output; a std::set: sorted by name.
        available: set[str] = set()
        for bottoms, tops in zip(self.bottom_lists, self.top_lists):
            available.difference_update(bottoms)
            available.update(tops)
        self.outputs = sorted(available)
        self.inputs = [t for l, ts in zip(self.layer_list, self.top_lists) if l.type == "Input" for t in ts]
        self.layer_by_name = {l.name: l for l in self.layer_list}
        self._needs_backward = self.param.force_backward or any(w != 0 for w in self._loss_weights.values())
        self._plan_backward()
        self._input_shapes = self._current_input_shapes()
        self._frontiers: dict[tuple[int, int], list] = {}
        self._ran: dict[int, tuple[list, list, bool]] = {}   # layer -> (bottoms, tops, connected)
        self._fed: dict[str, tuple] = {}       # step API: input blob -> (its tensor, NHWC copy)
        self._folder = Folder(self)
        self._reset_loss_diffs()
        # CPU conv nets compute in NHWC (why: docs/internals.md, *Design notes by module*); CUDA: NCHW.
        self._channels_last = any(l.type in ("Convolution", "Deconvolution", "Pooling")
                                  for l in self.layer_list)
        if self.device.type != "cpu":
            self.to(self.device)

    def _append(self, lp) -> None:
        try:
            cls = layer_class(lp.type, lp.name)
        except LayerError as e:
            raise LayerError(f"{self.source}: {e}" if self.source else str(e)) from None
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
        if hasattr(layer, "set_net"):   # Caffe's Layer::set_net: a layer that reads the net so far
            layer.set_net(self)         # (AutoCrop walks it for its offsets)
        tops = layer.set_up([self.shapes[b] for b in bottoms])
        self._check_sizes(layer, tops, [self.shapes[b] for b in bottoms])
        for t, s in zip(lp.top, tops):
            # Caffe never allocates an empty blob's data: fail now (an Input left unshaped, (0,), waits).
            if 0 in s and not (layer.type == "Input" and s == (0,)):
                raise NetError(f"Layer '{lp.name}' (type {lp.type}): top '{t}' has shape {s}; a "
                               "dimension of 0 (batch size 0?) makes an empty blob, whose data "
                               "Caffe never allocates; every dimension must be positive")
        self.layer_list.append(layer)
        self.bottom_lists.append(bottoms)
        self.top_lists.append(list(lp.top))
        for t, s in zip(lp.top, tops):
            self.shapes[t] = s
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
        self.propagate_down.append([(pd[j] if pd else True) and layer.allow_backward(j)
                                    for j in range(len(bottoms))])
        self.learnable_params.append_layer(layer, lp)

    def _top_shapes(self, layer: Layer, shapes) -> list[tuple]:
        tops = layer.top_shapes(shapes)
        self._check_sizes(layer, tops, shapes)
        return tops

    @staticmethod
    def _check_sizes(layer: Layer, tops, shapes) -> None:
        for name, s in zip(layer.param.top, tops):   # Caffe's Blob::Reshape CHECKs
            if any(d < 0 for d in s):
                raise NetError(f"Layer '{layer.name}' (type {layer.type}): top '{name}' would "
                               f"have a negative dimension: {s} (bottom shapes {list(shapes)})")
            if math.prod(s) > INT_MAX:
                raise NetError(f"Layer '{layer.name}' (type {layer.type}): top '{name}' of shape "
                               f"{s} exceeds Caffe's blob size limit INT_MAX ({INT_MAX}) "
                               f"(bottom shapes {list(shapes)})")

    def _plan_backward(self) -> None:
        """Caffe's need-backward flags: a layer needs backward when a bottom needs it or it has
        a param with a gradient; its tops then need it; inputs need it under force_backward."""
        need: dict[str, bool] = {}
        self.bottom_need_backward: list[list[bool]] = []
        for layer, bottoms, tops, prop in zip(self.layer_list, self.bottom_lists, self.top_lists,
                                              self.propagate_down):
            flags = [p and (need.get(b, False) or bool(self.param.force_backward))
                     for b, p in zip(bottoms, prop)]
            self.bottom_need_backward.append(flags)
            reaches = (bool(self.param.force_backward) if layer.type == "Input"
                       else any(flags) or any(p.requires_grad for p in layer.blobs))
            for t in tops:
                need[t] = reaches
        self._blob_needs = need

    def _current_input_shapes(self):
        return [tuple(self.blobs[n].shape) for n in self.inputs]

    def _reset_loss_diffs(self) -> None:
        for name, w in self._loss_weights.items():
            b = self.blobs[name]
            b.write_diff(torch.full_like(b.tensor.detach(), w))

    def reshape(self) -> None:
        """Re-infer every shape from the input blobs' current shapes (Caffe's ``Net::Reshape``)."""
        for n in self.inputs:
            self.shapes[n] = self.blobs[n].shape
        for layer, bottoms, tops in zip(self.layer_list, self.bottom_lists, self.top_lists):
            if layer.type == "Input":
                continue
            for t, s in zip(tops, self._top_shapes(layer, [self.shapes[b] for b in bottoms])):
                self.shapes[t] = s
        for name, s in self.shapes.items():
            if name not in self.inputs:
                self.blobs[name].reshape(*s)
        self._input_shapes = self._current_input_shapes()
        self._reset_loss_diffs()

    def to(self, device=None, dtype=None) -> "Net":
        """Move (and optionally cast) every blob and parameter, keeping parameter sharing.
        Process-wide settings for the device are ``brewnet.execution.process.configure``'s job."""
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
        self.learnable_params.remap(moved)
        for b in self.blobs.values():
            b.tensor = b.tensor.detach().to(device=device, dtype=dtype or b.tensor.dtype)
            b.diff_tensor = b.diff_tensor.to(device=device, dtype=dtype or b.diff_tensor.dtype)
        self._channels_last = self._channels_last and device.type == "cpu"
        self._ran, self._fed = {}, {}
        self.device = device
        return self

    # -- what solvers and tools read ---------------------------------------------------------
    @property
    def learnable(self) -> list[torch.Tensor]:
        return self.learnable_params.tensors

    @property
    def lr_mults(self) -> list[float]:
        return self.learnable_params.lr_mults

    @property
    def decay_mults(self) -> list[float]:
        return self.learnable_params.decay_mults

    @property
    def blob_loss_weights(self) -> "OrderedDict[str, float]":
        return OrderedDict((n, self._loss_weights.get(n, 0.0)) for n in self.blobs)

    def copy_from(self, path) -> None:
        """Load weights from a ``.caffemodel`` (binary or legacy V1) or ``.caffemodel.h5``."""
        from .weights import load_weights

        with schema.using(self.schema):
            load_weights(self, path)

    def save(self, path) -> None:
        """Write the net with its weights as a binary ``.caffemodel`` (atomically)."""
        from .weights import save_weights

        with schema.using(self.schema):
            save_weights(self, path)

    def share_with(self, other: "Net") -> None:
        """Use ``other``'s parameter tensors in the layers both nets name (Caffe's
        ``ShareTrainedLayersWith``; a solver's test nets share the train net's weights)."""
        for layer in self.layer_list:
            src = other.layer_by_name.get(layer.name)
            if src is None or not layer.blobs:
                continue
            if [tuple(b.shape) for b in src.blobs] != [tuple(b.shape) for b in layer.blobs]:
                raise NetError(f"share_with: layer '{layer.name}' has param shapes "
                               f"{[tuple(b.shape) for b in layer.blobs]} here and "
                               f"{[tuple(b.shape) for b in src.blobs]} in the other net")
            layer.blobs = list(src.blobs)

    def layer_index(self, name_or_index, default: int | None = None) -> int:
        """A layer's index from its name (or an index, returned as it is)."""
        if name_or_index is None:
            if default is None:
                raise NetError("layer_index: no layer given")
            return default
        if isinstance(name_or_index, int):
            return name_or_index
        try:
            return [l.name for l in self.layer_list].index(name_or_index)
        except ValueError:
            raise NetError(f"no layer named '{name_or_index}'") from None

    _index = layer_index

    # -- whole passes -----------------------------------------------------------------------
    def forward_tensors(self, start=None, end=None) -> torch.Tensor:
        """Run layers ``start..end`` (names or indices, inclusive); returns the weighted loss."""
        i0, i1 = self._index(start, 0), self._index(end, len(self.layer_list) - 1)
        if self._current_input_shapes() != self._input_shapes:
            self.reshape()
        look_at_param_views()                   # (the folded weights' cache key)
        grad = self._needs_backward and torch.is_grad_enabled()
        if i0 == 0:
            # Per-layer bottoms/tops for any range's backward (grad mode only: they keep intermediates alive).
            self._ran = {}
        self._fed = {}
        cur: dict[str, torch.Tensor] = {}      # this pass's values, as the layers see them
        if i0 == 0:
            for j, layer in enumerate(self.layer_list):
                if layer.type == "Input":
                    ts = [self._input_value(n, cur) for n in self.top_lists[j]]
                    if grad:
                        self._ran[j] = ([], ts, True)
        if self.hooked():
            return self._forward_hooked(i0, i1)
        losses = []                             # (weight, loss top) of this pass
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
                    top = self.top_lists[i][0]
                    cur[top] = self._folder.run(i, cur[b] if b in cur else self.blobs[b].tensor)
                    self.blobs[top].write(cur[top])
                    i = last
                    continue
                for b in self.bottom_lists[i]:
                    if b not in cur:
                        cur[b] = self._leaf(b, grad)
                bottoms = [cur[b] for b in self.bottom_lists[i]]
                if not all(self.propagate_down[i]):
                    bottoms = [b if p else b.detach() for b, p in zip(bottoms, self.propagate_down[i])]
                tops = layer.forward(bottoms)
                if grad:
                    self._ran[i] = (bottoms, tops, True)
                for name, t in zip(self.top_lists[i], tops):
                    cur[name] = t if bottoms else for_layers(t, self._channels_last)
                    self.blobs[name].write(t)
                    w = self._loss_weights.get(name)
                    if w:
                        losses.append((w, t))
        return self._weighted_loss(losses)

    def add_hook(self, when: str, fn) -> None:
        """Caffe's Net callbacks (``Net::add_before_forward`` ...): ``fn(i)`` runs before or after
        layer ``i``'s forward or backward, every layer in order as ``ForwardFromTo`` and
        ``BackwardFromTo`` call them. A hooked net runs layer by layer (no fused or recorded
        passes), so each call brackets exactly its layer's work."""
        if when not in self.hooks:
            raise ValueError(f"add_hook: '{when}' is not one of {list(self.hooks)}")
        if not callable(fn):
            raise TypeError(f"{when}: expected a callable taking the layer index, got {fn!r}")
        self.hooks[when].append(fn)

    def hooked(self) -> bool:
        return any(self.hooks.values())

    def _forward_hooked(self, i0: int, i1: int) -> torch.Tensor:
        losses = []
        for i in range(i0, i1 + 1):
            for fn in self.hooks["before_forward"]:
                fn(i)
            for name, t in zip(self.top_lists[i], self.forward_layer(i)):
                w = self._loss_weights.get(name)
                if w:
                    losses.append((w, t))
            for fn in self.hooks["after_forward"]:
                fn(i)
        return self._weighted_loss(losses)

    def _weighted_loss(self, losses) -> torch.Tensor:
        """Sum of weight * top over the loss tops, 0-D. The usual single scalar loss of weight
        1 is the top's own value (0 + 1 * x is x): no tensor ops for it."""
        if len(losses) == 1 and losses[0][0] == 1 and losses[0][1].dim() == 0:
            return losses[0][1].detach()
        loss = torch.zeros((), device=self.device)
        for w, t in losses:
            loss = loss + w * t.detach().sum()
        return loss

    def _input_value(self, name: str, cur: dict) -> torch.Tensor:
        """An input blob's tensor for a pass (a leaf with a gradient under force_backward); the
        layers get it in NHWC on a CPU conv net (the blob itself stays NCHW for numpy users)."""
        blob = self.blobs[name]
        t = blob.tensor
        if self.param.force_backward and t.is_floating_point() and not t.requires_grad:
            t = t.detach().requires_grad_(True)
            blob.tensor = t
        cur[name] = for_layers(t, self._channels_last)
        return t

    def _leaf(self, name: str, grad: bool) -> torch.Tensor:
        """A bottom read from its blob (not computed in this pass): under autograd, a leaf on the
        blob's memory when Caffe would backpropagate to it (a backward over the range gives its diff)."""
        t = self.blobs[name].tensor
        if grad and self._blob_needs.get(name, False) and t.is_floating_point():
            return t.detach().requires_grad_(True)
        return t

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
        """Backpropagate over layers ``start`` down to ``end`` (default: all), seeded as Caffe: loss
        tops by their loss weight, the range's other outputs by their diffs. Accumulates parameter
        ``.grad`` (Caffe's param diffs); with ``blob_diffs`` also writes blob diffs (an in-place
        blob's diff is the gradient of the value its first producer wrote). Where no forward of this
        net recorded the range, the layers run one by one on the blobs' current data and diffs."""
        if not self._needs_backward:
            return
        hi = self._index(start, len(self.layer_list) - 1)
        lo = self._index(end, 0)
        hooked = self.hooked()
        if hooked or not all(self._ran.get(j, (0, 0, False))[2] for j in range(lo, hi + 1)):
            done: set[str] = set()
            for j in range(hi, lo - 1, -1):
                for fn in self.hooks["before_backward"]:
                    fn(j)
                self.backward_layer(j, done, blob_diffs or hooked)   # layer by layer: diffs carry it
                for fn in self.hooks["after_backward"]:
                    fn(j)
            return
        seeds, grads = [], []
        for j, k in self._frontier(lo, hi):
            t = self._ran[j][1][k]
            if t.requires_grad:
                seeds.append(t)
                grads.append(self.blobs[self.top_lists[j][k]].diff_tensor.to(t.dtype))
        params = [p for p in self._range_params(lo, hi) if p.requires_grad]
        if not blob_diffs:
            if seeds:
                backprop.backward(seeds, grads, params)
            return
        targets: dict[str, torch.Tensor] = {}
        for j in range(lo, hi + 1):
            bottoms, tops, _ = self._ran[j]
            for name, t in zip(self.bottom_lists[j], bottoms):
                targets.setdefault(name, t)
            for name, t in zip(self.top_lists[j], tops):
                if name not in self.bottom_lists[j] and name not in self._loss_weights:
                    targets.setdefault(name, t)
        names = [n for n, t in targets.items() if t.requires_grad]
        # No seed (e.g. only a Silence consumes the blobs): every diff in the range is zero.
        got = [None] * (len(names) + len(params))
        if seeds:
            got = backprop.grad(seeds, [targets[n] for n in names] + params, grads,
                                retain_graph=True)
        for n, g in zip(names, got[:len(names)]):
            b = self.blobs[n]
            b.write_diff(torch.zeros(b.shape, dtype=b.tensor.dtype, device=b.tensor.device)
                         if g is None else g.detach())
        for p, g in zip(params, got[len(names):]):
            _add_grad(p, g)

    # -- per-layer steps --------------------------------------------------------------------
    def forward_layer(self, i: int, train: bool = False) -> list[torch.Tensor]:
        """Run layer ``i`` alone (Caffe's ``ForwardFromTo(i, i)``): its bottoms read from their
        blobs (as leaves where Caffe would backpropagate), its tops written to theirs; records
        the layer's own graph for ``backward_layer``. Returns the tops. ``train``: record the
        graph even in a net without a loss (``brewnet time`` times deploy nets as training)."""
        layer = self.layer_list[i]
        grad = (train or self._needs_backward) and torch.is_grad_enabled()
        if layer.type == "Input":
            self._fed, tops = {}, [self.blobs[n].tensor for n in self.top_lists[i]]
        else:
            bottoms = self._bottoms_alone(i, grad)
            with torch.set_grad_enabled(grad):
                tops = layer.forward(bottoms)
            if grad:
                self._ran[i] = (bottoms, tops, False)
            for name, t in zip(self.top_lists[i], tops):
                self.blobs[name].write(t)
        for name, t in zip(self.top_lists[i], tops if not self.bottom_lists[i] else ()):
            if (v := for_layers(t, self._channels_last)) is not t:   # an input, a data layer's top
                self._fed[name] = (t, v)     # the conversion is their work, once
        return tops

    def _bottoms_alone(self, i: int, grad: bool) -> list[torch.Tensor]:
        out = []
        for j, name in enumerate(self.bottom_lists[i]):
            t = self.blobs[name].tensor
            fed = self._fed.get(name)
            x = (fed[1] if fed is not None and fed[0] is t else t).detach()
            if grad and self.bottom_need_backward[i][j] and x.is_floating_point():
                x.requires_grad_(True)
            out.append(x)
        return out

    def backward_layer(self, i: int, done: set | None = None, blob_diffs: bool = True,
                       train: bool = False) -> None:
        """Layer ``i``'s backward alone (Caffe's ``BackwardFromTo(i, i)``): from its tops' diffs to
        its bottoms' diffs (overwritten, as Caffe's) and its params' gradients (accumulated). Over a
        pass, ``done`` collects the blob names already given a diff, so a blob several layers read
        sums their diffs (what Caffe's inserted Split layers do). Without a recorded graph the
        layer's forward is re-run on the blobs' current data (tops left as they are)."""
        layer = self.layer_list[i]
        if layer.type == "Input" or not (train or self._needs_backward):
            return
        graph = self._ran.get(i)
        if graph is None:
            bottoms = self._bottoms_alone(i, True)
            with torch.enable_grad():
                graph = (bottoms, layer.forward(bottoms), False)
        bottoms, tops, _ = graph
        seeds, grads = [], []
        for name, t in zip(self.top_lists[i], tops):
            if t.requires_grad:
                seeds.append(t)
                grads.append(self.blobs[name].diff_tensor.to(t.dtype))
        params = [p for p in self._all_params([layer]) if p.requires_grad]
        wanted = [(n, b) for n, b, need in zip(self.bottom_lists[i], bottoms, self.bottom_need_backward[i])
                  if need and b.requires_grad] if blob_diffs else []
        wrt = [b for _, b in wanted] + params
        if not seeds or not wrt:
            return
        got = backprop.grad(seeds, wrt, grads, retain_graph=True)
        if done is None:
            done = set()
        done.difference_update(self.top_lists[i])      # in place: the top's diff is used up
        for (name, b), g in zip(wanted, got):
            g = torch.zeros_like(b) if g is None else g.detach()
            blob = self.blobs[name]
            if name in done:
                blob.write_diff(blob.diff_tensor + g)
            else:
                blob.write_diff(g)
                done.add(name)
        for p, g in zip(params, got[len(wanted):]):
            # A fresh gradient is taken as it is, unless it is a seed itself (a Parameter top).
            _add_grad(p, g, copy=any(g is s for s in grads))

    # -- parameters -------------------------------------------------------------------------
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


def _add_grad(p: torch.Tensor, g: torch.Tensor | None, copy: bool = True) -> None:
    """Caffe accumulates param diffs until the solver clears them (torch's ``.grad``)."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone() if copy else g.detach()
    else:
        p.grad += g
