"""owl's ``Net`` (``owl.net.net``): a graph of units, one per Caffe layer, over brewnet's core nets.

owl built its own layers; here every unit is a view of a layer of a core ``brewnet.net.Net``,
one net per phase (``compute_size(phase)`` builds it: ``'TRAIN'``, ``'TEST'``, or
``'MULTI_VIEW'``, the TEST net fed the 10 oversampled views of each batch in turn, owl's
multi-view data). What owl code reaches for: ``units``, ``name_to_uid`` (layer name -> [uid],
one per phase variant), ``data_layers``, ``loss_uids``/``accuracy_uids`` and their getters,
``get_weighted_unit_ids()``, ``forward(phase)``/``backward(phase)``, ``batch_size`` and the
solver's numbers (``solver``, ``base_lr``, ``current_lr``, ``momentum``, ``base_weight_decay``).

A unit's ``out`` is its own output (owl gave stacked in-place layers a top of their own; the
builder renames such tops for the TEST nets, so ``out`` of ``conv5`` is before ``relu5``).
Arrays are ``NArray``: owl's column-major shapes (``[W, H, C, N]``), ``to_numpy()`` in
Caffe's (N, C, H, W) order.
"""
from __future__ import annotations

import numpy as np
import torch

PHASES = ("TRAIN", "TEST", "MULTI_VIEW")
DATA_TYPES = ("Data", "ImageData", "WindowData", "HDF5Data", "MemoryData", "DummyData")


class NArray:
    """owl's NArray over a torch tensor: ``shape`` in owl's (reversed) order, ``to_numpy()``,
    elementwise ``+ - *``, ``max_index(dim)``/``argmax(dim)`` and ``count_zero()``."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()

    @property
    def shape(self) -> list[int]:
        """The tensor's shape in owl's order (reversed: ``[W, H, C, N]``)."""
        return list(reversed(self.tensor.shape))

    def to_numpy(self) -> np.ndarray:
        """A float32 numpy copy in Caffe's (N, C, H, W) order."""
        return self.tensor.float().cpu().numpy().copy()

    def reshape(self, shape) -> "NArray":
        """The same values in ``shape``, given in owl's (reversed) order."""
        return NArray(self.tensor.reshape(tuple(reversed(list(shape)))))

    def _other(self, x):
        return x.tensor if isinstance(x, NArray) else x

    def __add__(self, x):
        return NArray(self.tensor + self._other(x))

    __radd__ = __add__

    def __sub__(self, x):
        return NArray(self.tensor - self._other(x))

    def __mul__(self, x):
        return NArray(self.tensor * self._other(x))

    __rmul__ = __mul__

    def max_index(self, dim: int) -> "NArray":
        """Index of the largest element along owl's axis ``dim`` (numpy's ``ndim - 1 - dim``)."""
        return NArray(self.tensor.argmax(self.tensor.dim() - 1 - dim).float())

    argmax = max_index

    def count_zero(self) -> int:
        """The number of elements equal to 0."""
        return int((self.tensor == 0).sum())

    def __repr__(self) -> str:
        return f"NArray(shape={self.shape})"


def from_numpy(arr) -> NArray:
    """owl's ``owl.from_numpy``: an NArray of a numpy array in Caffe's order."""
    return NArray(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))


class ComputeUnit:
    """One layer of the net (owl's ComputeUnit): ``name``, ``params`` (its LayerParameter),
    ``top_names``/``btm_names``, ``out`` after a forward, ``out_shape`` and the receptive field
    on the input (``rec_on_ori``, ``stride_on_ori``, ``start_on_ori``) after ``compute_size``."""

    def __init__(self, owl_net: "Net", params):
        self.owl_net, self.params, self.name = owl_net, params, params.name
        self.top_names, self.btm_names = list(params.top), list(params.bottom)
        self.out_shape = None
        self.rec_on_ori = self.stride_on_ori = self.start_on_ori = None

    def _phases(self):
        return [p for p in self.owl_net.phases_built if self in self.owl_net.units_of(p)]

    def _core(self):
        phases = self._phases()
        if not phases:
            raise RuntimeError(f"unit '{self.name}': no net of its phase is built; call "
                               "compute_size(phase) first")
        last = self.owl_net.last_phase
        return self.owl_net.core(last if last in phases else phases[0])

    def _blob(self, name: str) -> torch.Tensor:
        return self._core().blobs[name].tensor.detach()

    @property
    def out(self) -> NArray | None:
        """The unit's own output (its first top) after the last forward; None without tops."""
        return NArray(self._blob(self.top_names[0])) if self.top_names else None

    def __str__(self) -> str:
        return self.params.type


class WeightedComputeUnit(ComputeUnit):
    """A layer with parameters: ``weight``/``bias`` (settable), ``weightgrad``/``biasgrad``
    (the param diffs of the last backward), ``wshape``/``bshape`` in owl's order."""

    def _param(self, i: int):
        blobs = self._core().layer_by_name[self.name].blobs
        return blobs[i] if i < len(blobs) else None

    def _set(self, i: int, value) -> None:
        t = self._param(i)
        v = value.tensor if isinstance(value, NArray) else torch.as_tensor(np.asarray(value))
        with torch.no_grad():
            t.copy_(v.reshape(t.shape).to(t.dtype))

    weight = property(lambda s: NArray(s._param(0)), lambda s, v: s._set(0, v))
    bias = property(lambda s: NArray(s._param(1)) if s._param(1) is not None else None,
                    lambda s, v: s._set(1, v))
    weightgrad = property(lambda s: _grad(s._param(0)))
    biasgrad = property(lambda s: _grad(s._param(1)))
    wshape = property(lambda s: s.weight.shape)
    bshape = property(lambda s: s.bias.shape if s.bias is not None else None)


def _grad(t) -> NArray | None:
    if t is None:
        return None
    return NArray(t.grad if t.grad is not None else torch.zeros_like(t))


class SoftmaxUnit(ComputeUnit):
    """SoftmaxWithLoss: ``ff_y`` (the probabilities, owl's [classes, N]), ``y`` (the labels
    one-hot, as owl kept them), ``getloss()``, ``loss_weight``."""

    @property
    def loss_weight(self):
        """The layer's ``loss_weight`` values, as a list."""
        return list(self.params.loss_weight)

    @property
    def ff_y(self) -> NArray:
        """Softmax of the layer's first bottom, one row of class probabilities per item."""
        x = self._blob(self.btm_names[0])
        return NArray(torch.softmax(x.reshape(x.shape[0], -1).double(), 1).float())

    @property
    def y(self) -> NArray:
        """The labels (second bottom) one-hot, a row per item (labels clamped to the classes)."""
        labels = self._blob(self.btm_names[1]).reshape(-1).long()
        classes = self.ff_y.tensor.shape[1]
        return NArray(torch.nn.functional.one_hot(labels.clamp(0, classes - 1), classes).float())

    def getloss(self) -> float:
        """The loss of the last forward (NaN when the layer has no top)."""
        return float(self._blob(self.top_names[0]).reshape(-1)[0]) if self.top_names else float("nan")


class AccuracyUnit(ComputeUnit):
    """Accuracy: ``acc`` (this batch's), ``batch_size`` and ``top_k``."""

    @property
    def top_k(self) -> int:
        """The layer's ``accuracy_param.top_k``."""
        return self.params.accuracy_param.top_k

    @property
    def acc(self) -> float:
        """This batch's accuracy (the layer's top)."""
        return float(self._blob(self.top_names[0]).reshape(-1)[0])

    @property
    def batch_size(self) -> int:
        """The number of labels in this batch (the layer's second bottom)."""
        return int(self._blob(self.btm_names[1]).numel())


class DataUnit(ComputeUnit):
    """A data layer: ``crop_size`` and owl's ``multiview`` switch (10 views per batch)."""

    multiview = False

    @property
    def crop_size(self) -> int:
        """The layer's ``transform_param.crop_size``."""
        return self.params.transform_param.crop_size


UNIT_TYPES = {"SoftmaxWithLoss": SoftmaxUnit, "Accuracy": AccuracyUnit,
              **{t: DataUnit for t in DATA_TYPES}}


def make_unit(owl_net: "Net", params) -> ComputeUnit:
    """The unit of a layer; a plain one becomes a WeightedComputeUnit once a built net shows
    the layer has parameters (``Net.compute_size``)."""
    return UNIT_TYPES.get(params.type, ComputeUnit)(owl_net, params)


class Net:
    """owl's Net; ``CaffeNetBuilder.build_net`` fills it (see the module docstring)."""

    def __init__(self):
        self.units: list[ComputeUnit] = []
        self.adjacent: list[list[int]] = []
        self.reverse_adjacent: list[list[int]] = []
        self.name_to_uid: dict[str, list[int]] = {}
        self.loss_uids: list[int] = []
        self.accuracy_uids: list[int] = []
        self.data_layers: list[str] = []
        self.base_lr = self.current_lr = self.base_weight_decay = self.momentum = 0
        self.batch_size = 0
        self.solver = None          # the SolverParameter
        self.builder = None
        self._cores: dict[str, object] = {}
        self._views: dict = {}
        self._units_cache: dict[int, tuple] = {}    # id(core net) -> (it, its units)
        self.last_phase = None

    # -- the graph (owl's API) ---------------------------------------------------------------
    def add_unit(self, unit: ComputeUnit) -> int:
        """Add ``unit`` to the graph, without edges; returns its uid."""
        uid = len(self.units)
        self.units.append(unit)
        self.adjacent.append([])
        self.reverse_adjacent.append([])
        self.name_to_uid.setdefault(unit.name, []).append(uid)
        return uid

    def connect(self, u1: int, u2: int) -> None:
        """Add the edge ``u1 -> u2`` (``u2`` reads an output of ``u1``)."""
        self.adjacent[u1].append(u2)
        self.reverse_adjacent[u2].append(u1)

    def get_units_by_name(self, name: str) -> list[ComputeUnit]:
        """The units of layer ``name``, one per phase variant; ValueError naming the layers when none."""
        if name not in self.name_to_uid:
            raise ValueError(f"no layer named '{name}' in the net; its layers are: "
                           f"{', '.join(self.name_to_uid)}")
        return [self.units[u] for u in self.name_to_uid[name]]

    def get_loss_units(self) -> list[ComputeUnit]:
        """The loss units of the last phase run (all of them before any)."""
        return self._in_phase([self.units[u] for u in self.loss_uids])

    def get_accuracy_units(self) -> list[ComputeUnit]:
        """The accuracy units of the last phase run (all of them before any)."""
        return self._in_phase([self.units[u] for u in self.accuracy_uids])

    def get_data_unit(self, phase: str = "TRAIN") -> ComputeUnit | None:
        """The first data unit of ``phase``'s net, or None."""
        return next((u for u in self.units_of(phase) if isinstance(u, DataUnit)), None)

    def get_weighted_unit_ids(self) -> list[int]:
        """The uids of the units with parameters (known once a net is built)."""
        return [i for i, u in enumerate(self.units) if isinstance(u, WeightedComputeUnit)]

    def _in_phase(self, units):
        phase = self.last_phase
        return [u for u in units if phase is None or u in self.units_of(phase)]

    # -- phases ------------------------------------------------------------------------------
    @property
    def phases_built(self) -> list[str]:
        """The phases whose core net exists (``'TRAIN'``, ``'TEST'``)."""
        return list(self._cores)

    def units_of(self, phase: str) -> list[ComputeUnit]:
        """The units of ``phase``'s net (a layer of another phase is left out)."""
        core = self._cores.get("TEST" if phase == "MULTI_VIEW" else phase)
        if core is None:
            return []
        held, units = self._units_cache.get(id(core), (None, None))
        if held is not core:
            kinds = {(l.name, l.type) for l in core.param.layer}
            units = [u for u in self.units
                     if (u.name, u.params.type) in kinds and _same_phase(u.params, core.phase)]
            self._units_cache[id(core)] = (core, units)
        return units

    def core(self, phase: str = "TRAIN"):
        """The core ``brewnet.net.Net`` behind ``phase``."""
        _check_phase(phase)
        key = "TEST" if phase == "MULTI_VIEW" else phase
        if key not in self._cores:
            raise RuntimeError(f"no {phase} net yet: call compute_size('{phase}') first")
        return self._cores[key]

    def attach(self, phase: str, core) -> None:
        """Use an existing core net for ``phase`` (a solver's train or test net)."""
        self._cores[phase] = core
        self._fill_sizes(phase)

    def compute_size(self, phase: str = "TRAIN") -> None:
        """Build ``phase``'s core net (once) and set every unit's ``out_shape`` and receptive
        field on the input."""
        _check_phase(phase)
        key = "TEST" if phase == "MULTI_VIEW" else phase
        if key not in self._cores:
            self._cores[key] = self.builder.core_net(self, key)
        self.last_phase = phase
        self._fill_sizes(key)
        if phase == "MULTI_VIEW":
            for u in self.units_of(key):
                if isinstance(u, DataUnit):
                    u.multiview = True

    def _fill_sizes(self, phase: str) -> None:
        from ...analysis.geometry import receptive_fields

        core = self._cores[phase]
        fields = receptive_fields(core)
        for u in self.units_of(phase):
            if type(u) is ComputeUnit and core.layer_by_name[u.name].blobs:
                u.__class__ = WeightedComputeUnit
            if u.top_names and u.top_names[0] in core.shapes:
                shape = core.shapes[u.top_names[0]]
                u.out_shape = list(reversed(shape[1:]))
                f = fields.get(u.top_names[0])
                if f is not None:
                    u.rec_on_ori, u.stride_on_ori, u.start_on_ori = (
                        int(f[0].size), int(f[0].stride), int(f[0].start))

    # -- passes ------------------------------------------------------------------------------
    def forward(self, phase: str = "TRAIN") -> None:
        """One forward pass of ``phase``'s net on its next batch (``MULTI_VIEW``: the next of the
        10 views of the current batch, a new batch after the tenth)."""
        _check_phase(phase)
        self.last_phase = phase
        core = self.core(phase)
        if phase == "MULTI_VIEW":
            return self._forward_view(core)
        with torch.set_grad_enabled(phase == "TRAIN"):
            core.forward_tensors()

    def backward(self, phase: str = "TRAIN") -> None:
        """Param diffs of the last ``forward(phase)`` (accumulated, as Caffe's; clear them with
        ``core(phase).clear_param_diffs()``)."""
        self.core(phase).backward_tensors()

    def _forward_view(self, core) -> None:
        """Feed the next oversampled view (brewnet.analysis.multiview's crops) to the TEST net."""
        from ...analysis import multiview

        v = self._views
        if not v:
            source_param, make_trunk = multiview.split_data_layer(core.param, 10, 0)
            from ...net import Net as CoreNet
            from ...proto import caffe_pb2 as pb

            source = CoreNet(source_param, pb.TEST, device=core.device)
            tops = source.top_lists[0]
            trunk_param, size = make_trunk([source.shapes[t] for t in tops])
            trunk = CoreNet(trunk_param, pb.TEST, device=core.device)
            trunk.share_with(core)
            v.update(source=source, tops=tops, trunk=trunk, size=size, queue=[])
            self._cores["TEST"] = trunk         # the units read the views' outputs
        if not v["queue"]:
            with torch.no_grad():
                v["source"].forward_tensors()
            x = v["source"].blobs[v["tops"][0]].tensor.cpu().numpy()
            others = [v["source"].blobs[t].tensor.clone() for t in v["tops"][1:]]
            v["queue"] = [(view, others) for view in multiview.take_views(x, v["size"], 10)]
        view, others = v["queue"].pop(0)
        trunk = v["trunk"]
        trunk.blobs[v["tops"][0]].data[...] = view
        for t, value in zip(v["tops"][1:], others):
            trunk.blobs[t].data[...] = value.cpu().numpy()
        with torch.no_grad():
            trunk.forward_tensors()

    def __str__(self) -> str:
        lines = [f'n{u} [label="{unit.name}"]' for u, unit in enumerate(self.units)]
        lines += [f"n{u} -> n{v}" for u, vs in enumerate(self.adjacent) for v in vs]
        return "digraph G {\n" + "\n".join(lines) + "\n}\n"


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"unknown phase '{phase}'; owl's phases are {', '.join(PHASES)}")


def _same_phase(layer, phase: int) -> bool:
    from ...proto.filter import layer_included, make_state

    return layer_included(make_state(phase), layer)


__all__ = ["Net", "NArray", "from_numpy", "ComputeUnit", "WeightedComputeUnit", "SoftmaxUnit",
           "AccuracyUnit", "DataUnit", "PHASES"]
