"""owl's tool classes (``owl.net.trainer``), as owl's users call them, on brewnet's core.

Each takes Minerva's arguments, has ``build_net()`` (read the solver and its net, build the nets,
load owl's snapshot *index*: ``net_helper``; ``run`` calls it when it has not run) and
``run(...)``, and prints owl's lines on stdout (brewnet's own log stays on stderr). The work is
the core's: ``NetTrainer`` is a brewnet Solver, its devices (``num_gpu``) ``brewnet.parallel``'s
workers, ``batch_rule="split"`` (owl's, the default: N devices share the prototxt's batch) or
``"full"`` (Caffe 1.0's: each device the whole batch); ``NetTester``/``MultiviewTester`` are
``brewnet test`` (``--views 10``); ``FeatureExtractor`` writes ``brewnet.analysis.features``'
batches as owl's text matrix; ``HeatmapVisualizer`` is ``brewnet.analysis.heatmap`` and
``FilterVisualizer`` ``brewnet.analysis.filters``' 9 strongest patches per channel.
Each tool in detail, and where it differs from owl: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from ... import owl
from .net import AccuracyUnit, Net, SoftmaxUnit
from .net_helper import CaffeNetBuilder, batch_layers

log = logging.getLogger("brewnet")
BATCH_RULES = ("split", "full")
MAX_FILTER_IMAGES = 10000


def say(line: str) -> None:
    """owl's output: a line on stdout, flushed."""
    print(line, flush=True)


class _Tool:
    """What the test-time tools share: the device, ``build_net`` on the TEST net, lookups."""

    phase = "TEST"
    solver_file = snapshot = None

    def _use_device(self, gpu_idx: int) -> None:
        self.gpu = owl.create_gpu_device(gpu_idx)
        owl.set_device(self.gpu)

    def build_net(self) -> None:
        self.owl_net = Net()
        self.builder = CaffeNetBuilder(self.solver_file)
        self.snapshot_dir = self.builder.snapshot_dir
        self.builder.build_net(self.owl_net)
        self.owl_net.compute_size(self.phase)
        self.builder.init_net_from_file(self.owl_net, self.snapshot_dir, self.snapshot)

    def _built(self) -> Net:
        """The owl Net, built now when ``run`` comes before ``build_net``."""
        if getattr(self, "owl_net", None) is None:
            self.build_net()
        return self.owl_net

    def _unit(self, name: str, kind=None):
        net = self._built()
        units = [u for u in net.get_units_by_name(name) if u in net.units_of("TEST")]
        if not units:
            raise ValueError(f"layer '{name}' is not in the TEST net")
        if kind is not None and not isinstance(units[0], kind):
            raise ValueError(f"layer '{name}' is a {units[0].params.type} layer, not {kind.__name__[:-4]}")
        return units[0]

    def _output(self, layer: str) -> str:
        """The blob holding ``layer``'s own output in the TEST net."""
        unit = self._unit(layer)
        if not unit.top_names:
            raise ValueError(f"layer '{layer}' ({unit.params.type}) has no output")
        return unit.top_names[0]

    def _test_iter(self) -> int:
        if not self._built().solver.test_iter:
            raise ValueError(f"{self.solver_file}: no test_iter: owl's tools run test_iter[0] batches")
        return self.owl_net.solver.test_iter[0]

    def _views(self, iterations: int, softmax_layer: str):
        """(softmax summed over the 10 views / 10, labels) per batch (brewnet test --views 10)."""
        from ...analysis.multiview import data_layer_scores

        self._unit(softmax_layer)
        net = self.owl_net
        return data_layer_scores(net.param, net.core("TEST"), 10, iterations, softmax_layer,
                                 device=owl.current_device())


class NetTester(_Tool):
    """``NetTester(solver_file, softmax_layer_name, accuracy_layer_name, snapshot, gpu_idx=0)``;
    ``run(multiview)`` prints owl's per-batch and final lines and returns the accuracy."""

    def __init__(self, solver_file, softmax_layer_name, accuracy_layer_name, snapshot, gpu_idx=0):
        self.solver_file, self.snapshot = solver_file, snapshot
        self.softmax_layer_name, self.accuracy_layer_name = softmax_layer_name, accuracy_layer_name
        self._use_device(gpu_idx)

    def run(self, multiview=False) -> float:
        """Test ``test_iter[0]`` batches (``multiview``: the 10 views' summed softmax, top-k);
        prints owl's lines and returns the mean accuracy."""
        from ...analysis.multiview import topk_hits

        acc_unit = self._unit(self.accuracy_layer_name, AccuracyUnit)
        iterations = self._test_iter()
        views = self._views(iterations, self.softmax_layer_name) if multiview else None
        hits = seen = 0
        for i in range(iterations):
            if views is not None:
                scores, labels = next(views)
                batch = len(labels)
                correct = topk_hits(scores, labels, [acc_unit.top_k])[acc_unit.top_k]
            else:
                self.owl_net.forward("TEST")
                batch = acc_unit.batch_size
                correct = batch * acc_unit.acc
            hits, seen = hits + correct, seen + batch
            say("Accuracy of the %d mb: %f, batch_size: %d, current mean accuracy: %f"
                % (i, correct / batch, batch, hits / seen))
        say("Testing Accuracy: %f" % (hits / seen))
        return hits / seen


class MultiviewTester(_Tool):
    """``MultiviewTester(solver_file, softmax_layer_name, snapshot, gpu_idx=0)``: top-1 of the
    softmax summed over the 10 views; ``run()`` returns the accuracy."""

    phase = "MULTI_VIEW"

    def __init__(self, solver_file, softmax_layer_name, snapshot, gpu_idx=0):
        self.solver_file, self.snapshot = solver_file, snapshot
        self.softmax_layer_name = softmax_layer_name
        self._use_device(gpu_idx)

    def run(self) -> float:
        """Test ``test_iter[0]`` batches, top-1 of the softmax summed over 10 views; prints owl's
        lines and returns the accuracy."""
        from ...analysis.multiview import topk_hits

        hits = seen = 0
        iterations = self._test_iter()
        for i, (scores, labels) in enumerate(self._views(iterations, self.softmax_layer_name)):
            correct = topk_hits(scores, labels, [1])[1]
            hits, seen = hits + correct, seen + len(labels)
            say("Accuracy the %d mb: %f, batch_size: %d" % (i, correct, len(labels)))
        say("Testing Accuracy: %f" % (hits / seen))
        return hits / seen


class FeatureExtractor(_Tool):
    """``FeatureExtractor(solver_file, snapshot, gpu_idx=0)``; ``run(layer_name, feature_path)``
    writes owl's text matrix: a line per image of test_iter[0] batches."""

    def __init__(self, solver_file, snapshot, gpu_idx=0):
        self.solver_file, self.snapshot = solver_file, snapshot
        self._use_device(gpu_idx)

    def run(self, layer_name, feature_path) -> int:
        """Returns the number of lines (images) written."""
        from ...analysis.features import batches

        blob = self._output(layer_name)
        rows = 0
        with open(feature_path, "w") as f:
            for i, (feats, _) in enumerate(batches(self.owl_net.core("TEST"), [blob],
                                                   self._test_iter(), label_blob=None)):
                x = feats[blob]
                np.savetxt(f, x.reshape(len(x), -1), fmt="%f", delimiter=" ", newline=" \n")
                rows += len(x)
                say("Finish One Batch %d" % i)
        return rows


class HeatmapVisualizer(_Tool):
    """``HeatmapVisualizer(solver_file, snapshot, gpu_idx=0)``; ``run(layer_name, result_path)``
    writes ``<result_path>/<i>.jpg`` for each image of test_iter[0] batches."""

    def __init__(self, solver_file, snapshot, gpu_idx=0):
        self.solver_file, self.snapshot = solver_file, snapshot
        self._use_device(gpu_idx)

    def run(self, layer_name, result_path) -> list[Path]:
        """Write a heatmap ``<i>.jpg`` of ``layer_name``'s output per test image; returns the paths."""
        from ...analysis.heatmap import from_net, save_pictures

        blob = self._output(layer_name)
        core = self.owl_net.core("TEST")
        if len(core.shapes[blob]) != 4:
            raise ValueError(f"layer '{layer_name}' gives {core.shapes[blob]}; a heatmap needs an "
                             "N x C x H x W output (a convolution or pooling layer)")
        written = save_pictures(from_net(core, blob, self._test_iter()), Path(result_path),
                                layer_name, name="{}.jpg", sheet=False)
        for p in written:
            say(str(p))
        return written


class FilterVisualizer(_Tool):
    """``FilterVisualizer(solver_file, snapshot, layer_name, result_path, gpu_idx=0)``;
    ``run()`` writes ``<result_path>/<channel>.jpg``: the channel's 9 strongest patches, 3 x 3."""

    def __init__(self, solver_file, snapshot, layer_name, result_path, gpu_idx=0):
        self.solver_file, self.snapshot = solver_file, snapshot
        self.layer_name, self.result_path = layer_name, result_path
        self._use_device(gpu_idx)

    def run(self) -> list[Path]:
        """Write each channel's 9 strongest patches as ``<channel>.jpg``; returns the paths."""
        from PIL import Image

        from ...analysis.filters import scan

        blob = self._output(self.layer_name)
        core = self.owl_net.core("TEST")
        images = min(self._test_iter() * core.shapes[blob][0], MAX_FILTER_IMAGES)
        say("Begin Generating Activations from Testing Set")
        top = scan(core, blob, images)
        say("Begin Selecting Patches")
        out = Path(self.result_path)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for c in range(len(top.heaps)):
            path = out / f"{c}.jpg"
            Image.fromarray(mosaic([p for _, _, p in top.best(c)])).save(path, format="JPEG")
            say(str(path))
            written.append(path)
        return written


def mosaic(patches: list[np.ndarray]) -> np.ndarray:
    """Up to 9 uint8 patches (H x W [x 3]) in a 3 x 3 grid, row by row, black where none."""
    h = max(p.shape[0] for p in patches)
    w = max(p.shape[1] for p in patches)
    grid = np.zeros((3 * h, 3 * w) + patches[0].shape[2:], np.uint8)
    for k, p in enumerate(patches[:9]):
        r, c = divmod(k, 3)
        grid[r * h:r * h + p.shape[0], c * w:c * w + p.shape[1]] = p
    return grid


class NetTrainer:
    """``NetTrainer(solver_file, snapshot=0, num_gpu=1, sync_freq=1, batch_rule="split")``;
    ``build_net()``, ``run()``. See the module docstring for the several-device rules."""

    def __init__(self, solver_file, snapshot=0, num_gpu=1, sync_freq=1, batch_rule="split",
                 timeout=300.0):
        from ...parallel import World

        if batch_rule not in BATCH_RULES:
            raise ValueError(f"batch_rule '{batch_rule}': expected one of {', '.join(BATCH_RULES)}")
        if int(num_gpu) < 1 or int(sync_freq) < 1:
            raise ValueError(f"num_gpu ({num_gpu}) and sync_freq ({sync_freq}) must be at least 1")
        self.solver_file, self.snapshot = solver_file, int(snapshot)
        self.num_gpu, self.sync_freq, self.batch_rule = int(num_gpu), int(sync_freq), batch_rule
        self.timeout = timeout
        self.world = World.from_env()
        if owl.get_gpu_device_count() >= self.num_gpu:
            self.gpu = [owl.create_gpu_device(i) for i in range(self.num_gpu)]
        else:                              # one kind of device for all the workers
            if owl.has_cuda():
                log.warning("NetTrainer: %d devices asked, %d GPUs here: training on the CPU",
                            self.num_gpu, owl.get_gpu_device_count())
            self.gpu = [owl.create_cpu_device()] * self.num_gpu
        self.replicas = self.watch = None

    def _spawns(self) -> bool:
        return self.num_gpu > 1 and self.world is None

    def _device(self) -> torch.device:
        if self.world is None:
            return self.gpu[0]
        return self.gpu[self.world.local_rank] if self.world.local_rank < len(self.gpu) else self.gpu[0]

    def build_net(self) -> None:
        """Build the Solver on owl's definition (the batch split for several devices) and start
        it at snapshot index ``snapshot``; a launching process leaves that to its workers."""
        from ...parallel import Replicas, join
        from ...solvers import get_solver

        self.owl_net = Net()
        self.builder = CaffeNetBuilder(self.solver_file)
        self.snapshot_dir = self.builder.snapshot_dir
        self.builder.build_net(self.owl_net, self.num_gpu)
        if self._spawns():
            return
        device = self._device()
        owl.set_device(device)
        if self.world is not None:
            if self.world.rank:
                log.setLevel(logging.WARNING)        # rank 0 alone logs, as brewnet train
            self.watch = join(self.world, device, self.timeout)
        solver = get_solver(self.solver_param(), device=device)
        if self.world is not None:
            self.replicas = Replicas(solver, self.world.rank, self.world.size, self.watch,
                                     solver.param.layer_wise_reduce)
        self.owl_net.trainer_solver = solver
        self.owl_net.attach("TRAIN", solver.net)
        if solver.test_nets:
            self.owl_net.attach("TEST", solver.test_nets[0])
        self.owl_net.last_phase = "TRAIN"
        self.builder.init_net_from_file(self.owl_net, self.snapshot_dir, self.snapshot)
        if self.replicas is not None:
            self.replicas.sync_from_root()
            solver.add_callback(self.replicas.on_start, self.replicas.on_gradients)

    def solver_param(self):
        """The solver of owl's definition; several devices under owl's rule split the TRAIN
        data layers' batch. Tests only at test_interval multiples after the start and
        snapshots only at indices, as owl's loop."""
        from ...proto import caffe_pb2 as pb

        p = pb.SolverParameter()
        p.CopyFrom(self.builder.solverconfig)
        net = pb.NetParameter()
        net.CopyFrom(self.owl_net.param)
        n = self.world.size if self.world is not None else 1
        if n > 1 and self.batch_rule == "split":
            for layer, msg in batch_layers(net, pb.TRAIN):
                if msg.batch_size % n:
                    raise ValueError(f"layer '{layer.name}': batch_size {msg.batch_size} does not split "
                                     f"evenly over {n} devices (owl's rule); use a multiple of {n} "
                                     "or batch_rule 'full' (Caffe's: each device the whole batch)")
                msg.batch_size //= n
        p.ClearField("net")
        p.net_param.CopyFrom(net)
        p.test_initialization = False
        p.snapshot_after_train = False
        return p

    def run(self) -> None:
        """Train to max_iter from the snapshot's iteration, printing owl's lines."""
        if self._spawns():
            return self._launch()
        if getattr(self, "owl_net", None) is None:
            self.build_net()
        from ...parallel import leave

        s = self.owl_net.trainer_solver
        p, start = s.param, s.iter
        root = self.world is None or self.world.rank == 0
        last = [time.perf_counter()]
        loss_units = [u for u in self.owl_net.units_of("TRAIN") if isinstance(u, SoftmaxUnit)]
        if s.test_nets and p.test_interval and not any(
                isinstance(u, AccuracyUnit) for u in self.owl_net.units_of("TEST")):
            raise ValueError(f"{self.solver_file}: owl tests during training with the TEST net's "
                             "Accuracy layer, and it has none (drop test_iter/test_interval)")

        def on_gradients():
            i = s.iter
            if root and i % self.sync_freq == 0:
                owl.wait_for_all()
                took = time.perf_counter() - last[0]
                say("Finished training %d minibatch (time: %s; speed: %s img/s)"
                    % (i, took, self.owl_net.batch_size * self.sync_freq / (took or 1e-9)))
                last[0] = time.perf_counter()
            if root and p.display and (i + 1) % p.display == 0:
                for u in loss_units:
                    say("Training Loss %s: %f" % (u.name, u.getloss()))

        snapshot = s.snapshot

        def snapshot_by_index():
            path = snapshot()
            if path:
                say("Save to snapshot %d, current lr %f" % (s.iter // p.snapshot, self._lr(s)))
            return path

        s.snapshot = snapshot_by_index
        s.test_all = lambda: self._test(s) if root and s.iter != start else None
        s.add_callback(on_gradients=on_gradients)
        try:       # Ctrl-C stops and SIGHUP snapshots, as brewnet train (one process)
            s.solve(**({} if self.world else {"sigint_effect": "stop", "sighup_effect": "snapshot"}))
            if self.replicas is not None:
                self.replicas.finish()
        finally:
            leave(self.watch)

    @staticmethod
    def _lr(s) -> float:
        from ...solvers.lr_policy import policy

        return float(policy(s.param.lr_policy)(s.param, max(s.iter - 1, 0), s.current_step)[0])

    def _test(self, s) -> float:
        """owl's test during training: test_iter[0] batches of the TEST net, the last accuracy
        layer's value per batch and their mean over the images."""
        core = self.owl_net.core("TEST")
        s.share_weights(core)
        units = [u for u in self.owl_net.units_of("TEST") if isinstance(u, AccuracyUnit)]
        acc, hits, seen = units[-1], 0.0, 0
        for i in range(s.param.test_iter[0]):
            with torch.no_grad():
                core.forward_tensors()
            hits, seen = hits + acc.acc * acc.batch_size, seen + acc.batch_size
            say("Accuracy the %d mb: %f" % (i, acc.acc))
        say("Testing Accuracy: %f" % (hits / seen))
        return hits / seen

    def _launch(self) -> None:
        """Start ``num_gpu`` workers running this trainer (``brewnet owl net_trainer``)."""
        from ...parallel import spawn

        devices = "GPU" if self.gpu[-1].type == "cuda" else "CPU worker process"
        log.info("Training on %d %ss, batch rule '%s'", self.num_gpu, devices, self.batch_rule)
        argv = ["owl", "net_trainer", str(self.solver_file), str(self.snapshot), str(self.num_gpu),
                str(self.sync_freq), "--batch-rule", self.batch_rule, "--timeout", str(self.timeout)]
        code = spawn(argv, self.num_gpu, self.timeout)
        if code:
            raise RuntimeError(f"{self.num_gpu} training workers: a worker failed (see its lines above)")


__all__ = ["NetTrainer", "NetTester", "MultiviewTester", "FeatureExtractor", "HeatmapVisualizer",
           "FilterVisualizer", "mosaic"]
