"""LearnableParams: a net's learnable parameters as Caffe lists them (``Net::learnable_params_``
with ``params_lr_``, ``params_weight_decay_``, ``param_display_names_`` and the owners).

Every blob a layer owns is a learnable param, in layer order (BatchNorm's statistics too, with
lr_mult 0, so solver states line up with Caffe's). A ``param { name: ... }`` seen again shares
the first owner's tensor (Caffe's ``AppendParam``): STRICT sharing needs equal shapes,
PERMISSIVE equal counts (the sharer gets a view); the sharer's lr_mult/decay_mult fill in what
the owner left unset, and a mismatch is an error. The columns are plain lists a solver indexes.
"""
from __future__ import annotations

import torch

from .errors import NetError
from .proto import caffe_pb2 as pb


class LearnableParams:
    """Columns, one entry per learnable param: ``tensors``, ``lr_mults``, ``decay_mults``,
    ``names`` (the spec's name, else ``"<layer>.<j>"``) and ``owners`` ((layer name, blob j))."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.lr_mults: list[float] = []
        self.decay_mults: list[float] = []
        self.names: list[str] = []
        self.owners: list[tuple[str, int]] = []
        self._lr_given: list[bool] = []      # lr_mult/decay_mult given (sharers may fill them)
        self._decay_given: list[bool] = []
        self._capable: list[bool] = []        # whether it can be learned at all
        self._shared: dict[str, tuple] = {}   # spec name -> (owner layer, blob j, index)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self):
        return iter(self.tensors)

    def __getitem__(self, i):
        return self.tensors[i]

    def __setitem__(self, i, value):
        self.tensors[i] = value

    def index(self, name: str) -> int:
        return self.names.index(name)

    def append_layer(self, layer, lp) -> None:
        """Add ``layer``'s blobs under the ParamSpecs of its LayerParameter ``lp``."""
        if len(lp.param) > len(layer.blobs):
            raise NetError(f"Layer '{lp.name}': {len(lp.param)} param specs for "
                           f"{len(layer.blobs)} parameter blobs")
        for j in range(len(layer.blobs)):
            spec = lp.param[j] if j < len(lp.param) else pb.ParamSpec()
            if spec.name and spec.name in self._shared:
                self._share(layer, j, spec)
                continue
            blob = layer.blobs[j]
            capable = blob.requires_grad            # BatchNorm's statistics are never learned
            if spec.name:
                self._shared[spec.name] = (layer, j, len(self.tensors))
            self.tensors.append(blob)
            self.lr_mults.append(spec.lr_mult if capable else 0.0)
            self.decay_mults.append(spec.decay_mult)
            self.names.append(spec.name or f"{layer.name}.{j}")
            self.owners.append((layer.name, j))
            self._lr_given.append(spec.HasField("lr_mult") or not capable)
            self._decay_given.append(spec.HasField("decay_mult"))
            self._capable.append(capable)
            if capable and spec.lr_mult == 0:
                blob.requires_grad_(False)

    def _share(self, layer, j: int, spec) -> None:
        owner, k, idx = self._shared[spec.name]
        src, dst = owner.blobs[k], layer.blobs[j]
        strict = spec.share_mode == pb.ParamSpec.STRICT
        if (tuple(src.shape) != tuple(dst.shape)) if strict else (src.numel() != dst.numel()):
            raise NetError(f"Layer '{layer.name}': cannot share param '{spec.name}' of shape "
                           f"{tuple(src.shape)} (layer '{owner.name}') with shape {tuple(dst.shape)}")
        layer.blobs[j] = src if tuple(src.shape) == tuple(dst.shape) else src.view(dst.shape)
        for field, values, given in (("lr_mult", self.lr_mults, self._lr_given),
                                     ("decay_mult", self.decay_mults, self._decay_given)):
            if spec.HasField(field):
                if given[idx] and values[idx] != getattr(spec, field):
                    raise NetError(f"Layer '{layer.name}': shared param '{spec.name}' has "
                                   f"mismatched {field} ({getattr(spec, field)} vs {values[idx]})")
                given[idx], values[idx] = True, getattr(spec, field)
        if self._capable[idx]:
            src.requires_grad_(self.lr_mults[idx] != 0)

    def remap(self, moved: dict[int, torch.Tensor]) -> None:
        """After ``Net.to``: point at the moved tensors (``moved``: id(old) -> new)."""
        self.tensors[:] = [moved.get(id(t), t) for t in self.tensors]
