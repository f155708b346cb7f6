"""owl's ``CaffeNetBuilder`` (``owl.net.net_helper``): a Caffe solver and its net into an owl ``Net``.

Snapshots are brewnet's (Caffe's files); owl's snapshot *index* picks one: index k is
``<snapshot_prefix>_iter_<k x snapshot>.caffemodel`` (``.caffemodel.h5`` with
``snapshot_format: HDF5``) and its ``.solverstate``, so index 0 is the start and training
resumes at iteration k x snapshot, as owl's ``NetTrainer`` does. A missing snapshot leaves the
filler values, with owl's "Weight Need Reinit <layer>" line per layer; so does a layer whose
shape differs from the snapshot's (owl's finetuning: rename nothing, change num_output). Where
there is no such file, owl's own folder ``<snapshot_prefix>/snapshot<k>/`` is read (``snapshots``).

owl's stacked layers: an in-place layer (bottom == top, e.g. ``relu1`` on ``ip1``) got a top of
its own named after the layer; ``owl_param`` does the same to the definition (the numbers are
Caffe's; each unit's ``out`` is its own output).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ...proto import caffe_pb2 as pb
from .net import DATA_TYPES, Net, make_unit
from .snapshots import load_owl_folder

log = logging.getLogger("brewnet")
BATCH_FIELDS = ("data_param", "image_data_param", "window_data_param", "hdf5_data_param",
                "memory_data_param")


def owl_param(param: "pb.NetParameter") -> "pb.NetParameter":
    """A copy of ``param`` in which each in-place layer writes a top named after itself (a
    name no other blob has), and the layers after it read that top."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    taken = {b for l in out.layer for b in list(l.top) + list(l.bottom)}
    current: dict[str, str] = {}        # blob name in the definition -> its latest top
    for k, l in enumerate(out.layer):
        for i, b in enumerate(l.bottom):
            l.bottom[i] = current.get(b, b)
        original = param.layer[k]
        if len(l.top) == 1 and len(l.bottom) == 1 and original.bottom[0] == original.top[0]:
            name = l.name
            while name in taken:
                name += "_owl"
            taken.add(name)
            current[l.top[0]] = name
            l.top[0] = name
        else:
            for t in l.top:
                current.pop(t, None)
    return out


def batch_layers(param: "pb.NetParameter", phase: int):
    """(layer, its batch-size message) for the data layers of ``param`` in ``phase``."""
    from ...proto.filter import layer_included, make_state

    state = make_state(phase)
    for l in param.layer:
        if l.type in DATA_TYPES and layer_included(state, l):
            for f in BATCH_FIELDS:
                if l.HasField(f):
                    yield l, getattr(l, f)


class CaffeNetBuilder:
    """owl's builder: ``CaffeNetBuilder(solver_file)`` reads the solver and its net;
    ``build_net(owl_net)``, ``init_net_from_file(owl_net, snapshot_dir, index)``,
    ``save_net_to_file(owl_net, snapshot_dir, index)``, ``change_net(net_file)``."""

    def __init__(self, solver_file):
        from ...solvers.nets import load_solver_param

        log.info("Caffe solver file: %s", solver_file)
        self.solverconfig, self.solver_path = load_solver_param(solver_file)
        p = self.solverconfig
        if p.HasField("net_param"):
            self.net_file = None
            self.netconfig = p.net_param
        elif p.HasField("net"):
            self.change_net(p.net)
        else:
            raise ValueError(f"{solver_file}: owl's tools read the solver's 'net' (or net_param); "
                             "this solver gives train_net/test_net instead")
        self.snapshot_dir = p.snapshot_prefix
        self.owl_dir = self.snapshot_dir          # owl's prefix, a folder of snapshot<k>/
        if self.solver_path is not None:
            from ...proto.io import read_solver

            self.owl_dir = read_solver(self.solver_path).snapshot_prefix or self.snapshot_dir
        log.info("Snapshot Dir: %s", self.snapshot_dir)

    def change_net(self, net_file) -> None:
        """Use ``net_file`` instead of the solver's net."""
        from ...proto.io import read_net
        from ...solvers.nets import resolve

        self.net_file = str(resolve(str(net_file), self.solver_path, "net"))
        log.info("Caffe network file: %s", self.net_file)
        self.netconfig = read_net(self.net_file)

    def build_net(self, owl_net: Net, num_gpu: int = 1) -> None:
        """Fill ``owl_net``: the solver's numbers, a unit per layer (of every phase), their
        connections. ``num_gpu`` is kept for owl's signature: the batch split is the trainer's."""
        p = self.solverconfig
        owl_net.builder = self
        owl_net.solver = p
        owl_net.base_lr = owl_net.current_lr = p.base_lr
        owl_net.base_weight_decay, owl_net.momentum = p.weight_decay, p.momentum
        owl_net.lr_policy = p.lr_policy
        owl_net.param = owl_param(self.netconfig)
        producers: dict[str, list[int]] = {}
        for l in owl_net.param.layer:
            uid = owl_net.add_unit(make_unit(owl_net, l))
            if l.type in DATA_TYPES:
                owl_net.data_layers.append(l.name)
            elif l.type == "SoftmaxWithLoss":
                owl_net.loss_uids.append(uid)
            elif l.type == "Accuracy":
                owl_net.accuracy_uids.append(uid)
            for b in l.bottom:
                for src in producers.get(b, []):
                    owl_net.connect(src, uid)
            for t in l.top:
                producers.setdefault(t, []).append(uid)
        for _, msg in batch_layers(owl_net.param, pb.TRAIN):
            owl_net.batch_size = msg.batch_size

    def core_net(self, owl_net: Net, phase: str):
        """A core net of ``owl_net``'s definition for ``phase`` ('TRAIN' or 'TEST') on owl's
        current device, its fillers seeded by the solver's random_seed and its ``weights``
        loaded, as a Solver's are."""
        from ... import owl
        from ...execution import process
        from ...net import Net as CoreNet

        if self.solverconfig.random_seed >= 0:
            process.set_random_seed(self.solverconfig.random_seed)
        net = CoreNet(owl_net.param, pb.TRAIN if phase == "TRAIN" else pb.TEST, device=owl.current_device())
        for w in self.solverconfig.weights:      # the solver's own weights, as a Solver loads them
            for path in w.split(","):
                net.copy_from(path)
        return net

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_files(self, weightpath: str, index: int) -> tuple[int, str, str]:
        """(iteration, weights file, solver state file) of owl's snapshot ``index``."""
        interval = self.solverconfig.snapshot
        if index and interval <= 0:
            raise ValueError(f"snapshot index {index}: the solver has no 'snapshot' interval to "
                             "turn it into an iteration (snapshot: 0)")
        it = index * interval
        h5 = self.solverconfig.snapshot_format == pb.SolverParameter.HDF5
        ext = ".h5" if h5 else ""
        return it, f"{weightpath}_iter_{it}.caffemodel{ext}", f"{weightpath}_iter_{it}.solverstate{ext}"

    def init_net_from_file(self, owl_net: Net, weightpath: str, snapshotidx: int) -> int:
        """Load snapshot ``snapshotidx`` into the built nets (a solver attached with
        ``owl_net.trainer_solver`` restores its state too); returns its iteration."""
        from ...weights import load_weights

        it, model, state = self.snapshot_files(weightpath, snapshotidx)
        solver = getattr(owl_net, "trainer_solver", None)
        if solver is not None and os.path.exists(state) and os.path.exists(model):
            log.info("Restoring snapshot %d: %s", snapshotidx, state)
            try:
                solver.restore(state)
                return it
            except ValueError as e:       # another net's shapes: owl finetunes from what fits
                log.warning("%s; loading the weights that fit, with fresh history", e)
        cores = [owl_net._cores[k] for k in owl_net.phases_built]
        folder = Path(self.owl_dir if weightpath == self.snapshot_dir else weightpath) / f"snapshot{snapshotidx}"
        if os.path.exists(model):
            log.info("Loading snapshot %d: %s", snapshotidx, model)
            for core in cores:
                reinit = load_weights(core, model, require_match=True, reinit_mismatched=True)
        elif folder.is_dir():
            log.info("Loading owl's snapshot %d: %s", snapshotidx, folder)
            for core in cores:
                reinit = load_owl_folder(folder, core, solver if core is getattr(solver, "net", None) else None)
        else:
            if snapshotidx:
                log.warning("No snapshot %d (%s): the weights keep their filler values", snapshotidx, model)
            reinit = [] if self.solverconfig.weights else _layers_with_params(owl_net)
        for name in reinit:
            log.info("Weight Need Reinit %s", name)
        if solver is not None:
            start_at(solver, it)
        return it

    def save_net_to_file(self, owl_net: Net, weightpath: str, snapshotidx: int) -> str:
        """Write the weights (and, for a trainer's solver at that iteration, its state) as
        snapshot ``snapshotidx``; returns the weights file."""
        from ...weights import save_weights, save_weights_h5

        it, model, _ = self.snapshot_files(weightpath, snapshotidx)
        solver = getattr(owl_net, "trainer_solver", None)
        if solver is not None and solver.iter == it:
            solver.snapshot()
            return model
        core = owl_net._cores.get("TRAIN") or owl_net._cores.get("TEST")
        (save_weights_h5 if model.endswith(".h5") else save_weights)(core, model)
        return model


def _layers_with_params(owl_net: Net) -> list[str]:
    """Names of the layers with learnable blobs in the built nets, in order, once each."""
    out: list[str] = []
    for core in owl_net._cores.values():
        out += [l.name for l in core.layer_list if l.blobs and l.name not in out]
    return out


def start_at(solver, iteration: int) -> None:
    """Make ``solver`` continue at ``iteration`` with fresh history (owl's start from a snapshot
    index without a state file): the lr schedule's step is caught up."""
    from ...solvers.lr_policy import policy

    p = solver.param
    solver.iter, solver._train_count = iteration, iteration * p.iter_size
    while True:
        _, step = policy(p.lr_policy)(p, iteration, solver.current_step)
        if step == solver.current_step:
            break
        solver.current_step = step


__all__ = ["CaffeNetBuilder", "owl_param", "batch_layers", "start_at"]
