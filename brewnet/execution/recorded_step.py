"""The recorded step: a training net's forward and backward replayed as one recording of aten ops.

``recording.py`` writes down the aten ops of one real forward and backward; later iterations
replay that list, without per-layer Python. Invariant: the same bits as the eager step (loss,
tops, gradients), compared at the capture iteration; a difference keeps the eager step, logged.
Eager each iteration: layers without bottoms (data layers: their tops are the inputs), the label
checks (``check_labels``, before each replay) and on the CPU the update; a TRAIN top nothing needs
(Accuracy) is computed when read. Refused (debug log), e.g.: a layer outside ``PURE``, a plugin,
iter_size > 1, force_backward. Keyed on the input shapes and each layer tensor (reshapes and
surgery re-trace). ``BREWNET_STEP_GRAPH=0`` off, ``=1`` from the first iteration; else at
``MIN_ITERS`` left and an eager step under ``MAX_EAGER_S``. On CUDA ``StepGraph(net)`` is a
``CudaStepGraph`` (``cuda_graph.py``). Why, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from .. import backprop
from .fast_path import FAILED, FastPath
from .passes import split_side_tops
from .process import env_switch
from .recording import RecordError, same_bits, unbox

log = logging.getLogger("brewnet")
MIN_ITERS = 500    # a capture costs ~3 steps and 5-40 ms of recording (recording.py); it
                   # saves 0.3-0.5 ms a step on tiny nets: it pays well within 500 iterations
MAX_EAGER_S = 0.05  # nets slower than this a step are kernel-bound: the graph saves ~1% (LeNet)
# Layer types whose forward is a fixed sequence of torch ops on their bottoms and params.
PURE = frozenset("""AbsVal Accuracy BNLL Bias Concat Convolution Deconvolution Eltwise ELU
EuclideanLoss Exp Flatten HingeLoss InnerProduct Log LRN Pooling Power PReLU ReLU Reshape Scale
Sigmoid SigmoidCrossEntropyLoss Slice Softmax SoftmaxWithLoss Split TanH""".split())


def mode() -> str:
    return env_switch("BREWNET_STEP_GRAPH", "auto", ("auto", "0", "1"))


def refusal(solver) -> str | None:
    """Why this solver's train net cannot be replayed as a graph (None: it can)."""
    net = solver.net
    if mode() == "0":
        return "BREWNET_STEP_GRAPH=0"
    if solver.param.iter_size != 1:
        return "iter_size > 1"
    if net.param.force_backward:
        return "force_backward"
    why = device_refusal(net.device, asked=mode() == "1")
    if why:
        return why
    if not net._needs_backward:
        return "no loss to backpropagate"
    if net.hooked():
        return "layer hooks (Net.add_hook): they time or watch each layer"
    for layer, bottoms in zip(net.layer_list, net.bottom_lists):
        if not bottoms:
            continue
        if layer.type not in PURE or not type(layer).__module__.startswith("brewnet.layers"):
            return f"layer '{layer.name}' of type {layer.type}"
    return None


# A device's graphs: {device type: (StepGraph subclass, its refusal(device, asked))}, registered
# by the module that captures them (cuda_graph.py, imported with brewnet.solvers).
DEVICE_GRAPHS: dict[str, tuple] = {}


def device_refusal(device: torch.device, asked: bool = True) -> str | None:
    """Why a graph cannot be recorded for a net on ``device`` (None: it can)."""
    if device.type == "cpu":
        return None
    kind = DEVICE_GRAPHS.get(device.type)
    return kind[1](device, asked) if kind else f"device {device}: no CUDA graphs there"


def for_solver(solver, iters_left: int):
    """The solver's train net's recorded forward-backward once this run is long enough to pay
    for the trace; None: the eager step."""
    g = getattr(solver, "_graph", None)
    if g is not None and g.net is solver.net:
        return g
    solver._graph_iters = getattr(solver, "_graph_iters", 0) + 1
    if mode() != "1" and iters_left < MIN_ITERS and solver._graph_iters < MIN_ITERS:
        return None     # a loop of short step() calls waits for MIN_ITERS of them
    refused = getattr(solver, "_graph_refused", None)
    if refused is None or refused[0] is not solver.net:
        solver._graph_refused = refused = (solver.net, refusal(solver))
        if refused[1]:
            log.debug("step graph: %s", refused[1])
    if refused[1]:
        return None
    g = solver._graph = StepGraph(solver.net)
    return g


@contextmanager
def _deferred_label_checks(record: list):
    from ..layers import loss
    loss.DEFERRED.record = record      # per thread: train-together traces on worker threads
    try:
        yield
    finally:
        loss.DEFERRED.record = None


def _fold(gm, consts: list) -> None:
    """Compute once the nodes that read only ``consts`` (seed diffs whose memory nobody else
    can write: a blob hands out a view only of memory of its own, Blob._own) and literals, e.g.
    the loss seed over the batch size: a replay would get the same bits every step. Not the
    params (updated in place) nor views of them; not a value the graph returns or writes into."""
    from torch._ops import OpOverload

    ids = {id(c) for c in consts}
    vals = {n: getattr(gm, n.target) for n in gm.graph.nodes
            if n.op == "get_attr" and id(getattr(gm, n.target)) in ids}
    for node in list(gm.graph.nodes):
        op = node.target
        if (node.op != "call_function" or not isinstance(op, OpOverload)
                or torch.Tag.nondeterministic_seeded in op.tags
                or _written(op)
                or not node.all_input_nodes or not all(n in vals for n in node.all_input_nodes)
                or any(u.op == "output" or _writes(u, node) for u in node.users)):
            continue
        with torch.no_grad():
            value = op(*torch.fx.node.map_arg(node.args, vals.get),
                       **torch.fx.node.map_arg(node.kwargs, vals.get))
        name = f"_folded{len(vals)}"
        gm.register_buffer(name, value, persistent=False)
        with gm.graph.inserting_before(node):
            const = gm.graph.get_attr(name)
        node.replace_all_uses_with(const)
        gm.graph.erase_node(node)
        vals[const] = value
    gm.graph.eliminate_dead_code()


def as_param_grad(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``g`` in the layout autograd gives a param's ``.grad`` (the param's strides): a
    reduction over it (the clipping norm) then sums in the eager step's order."""
    if g.stride() == p.stride():
        return g
    return torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)


def _written(op) -> list[int]:
    """The positions of the arguments op overload ``op`` writes into."""
    return [i for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _writes(user, node) -> bool:
    """Whether op node ``user`` writes into its argument ``node`` (or its op is unknown)."""
    op = user.target
    if not hasattr(op, "_schema"):
        return True
    return any(i < len(user.args) and user.args[i] is node for i in _written(op))


class StepGraph:
    """One train net's forward-backward: replayed from the recorded graph where it fits,
    else run eagerly (and recorded, a few times at most). A net on CUDA gets the subclass
    ``cuda_graph.CudaStepGraph`` (the recorded graph captured as a CUDA graph)."""

    def __new__(cls, net):
        if cls is StepGraph and net.device.type in DEVICE_GRAPHS:
            cls = DEVICE_GRAPHS[net.device.type][0]
        return super().__new__(cls)

    def __init__(self, net):
        self.net = net
        self.sources = [i for i, b in enumerate(net.bottom_lists) if not b]
        self.gm, self.key = None, None
        self.captures = 0                   # traces tried: reshaping nets get a few, not one a step
        self.eager_calls = 0
        self.checks: list[tuple] = []       # (layer, graph input index, k, ignore)
        self.params: list[torch.Tensor] = []
        self.has_grad: list[bool] = []
        self.tops: list[str] = []           # blobs the graph's forward writes, in output order
        self.side, self.side_tops = None, []
        self._core_tops: list[str] = []
        self.seeds: list[tuple] = []        # (blob, its diff tensor) seeding the backward
        # the solver's recorded update (recorded_update.UpdateGraph; None: not asked yet, False:
        # refused); updated_at: the iteration whose update a replay did (update_out: its outputs)
        self.update = None
        self.updated_at, self.update_out = None, ()
        self.guard = FastPath("the recorded training step", getattr(net, "name", ""))
        self.staged: list[list] = []       # batches read ahead (steps_per_call.py), taken first
        self.staged_notes: list[list] = []  # their data layers' (layer, origin of the batch)

    def wants_update(self) -> bool:
        """Whether the solver's update should be recorded for this step graph (on the CPU the
        eager one is kept: recorded_update.ON_CPU)."""
        from . import recorded_update
        return recorded_update.ON_CPU

    def forward_backward(self) -> torch.Tensor:
        """The weighted loss; param ``.grad`` set as the eager backward sets them."""
        self.drop()
        xs = self._inputs()
        if self.gm is not None and self._key(xs) == self.key:
            self._check_labels(xs)            # the user's data: raised as the eager step would
            if self.update:                   # the replay updates params: no going back mid-way
                return self._replay(xs)
            loss = self.guard.attempt(self._replay, xs)
            if loss is not FAILED:
                return loss
        self.gm = None
        t0 = time.perf_counter()
        loss = self._eager(xs)
        self.eager_calls += 1
        if self.captures < 3 and self.guard.off is None and self._worth(time.perf_counter() - t0):
            self.captures += 1
            eager = (loss, self._written(), [p.grad for p in self._params()])
            if self.guard.attempt(self.capture, xs, eager) is FAILED:
                self.gm = None
        return loss

    def _worth(self, seconds: float) -> bool:
        """Whether to record now: at once under ``BREWNET_STEP_GRAPH=1``; else from the second
        eager step (the first pays one-off costs) when it took under ``MAX_EAGER_S``. A capture
        costs two more forward-backwards and holds three steps' tensors at once; it saves the
        per-layer Python, which only matters when the kernels are small."""
        return mode() == "1" or (self.eager_calls >= 2 and seconds < MAX_EAGER_S)

    # -- inputs ---------------------------------------------------------------------------
    def _inputs(self) -> list[torch.Tensor]:
        """Run the bottomless layers as the executor does; their tops feed the graph."""
        net, xs = self.net, []
        if self.staged:
            from ..layers.origins import note
            xs, it = self.staged.pop(0), 0
            notes = dict(self.staged_notes.pop(0))
            if isinstance(xs, BaseException):      # a read ahead failed here: as the read would
                raise xs
            for i in self.sources:
                names, layer = net.top_lists[i], net.layer_list[i]
                if layer in notes:
                    for name, t in zip(names, xs[it:it + len(names)]):
                        net.blobs[name].write(t)
                    note(layer, xs[it:it + len(names)], notes[layer](0))
                it += len(names)
            return xs
        for i in self.sources:
            layer = net.layer_list[i]
            if layer.type == "Input":
                xs += [net.blobs[n].tensor for n in net.top_lists[i]]
                continue
            for name, t in zip(net.top_lists[i], layer.forward([])):
                net.blobs[name].write(t)
                xs.append(t)
        return xs

    def _key(self, xs) -> tuple:
        # the seed diffs are held by the graph (folded, see _fold): a new diff tensor (a numpy
        # view handed out gives the blob one, Blob._own) or a torch write re-traces
        return (tuple((tuple(x.shape), x.dtype) for x in xs),
                tuple(id(t) for layer in self.net.layer_list for t in layer.blobs),
                tuple((id(b._d), b._d._version) for b, _ in self.seeds))

    @contextmanager
    def _fed(self, xs):
        """The bottomless layers hand out ``xs`` (already read) instead of reading anew."""
        net, it = self.net, iter(xs)
        forwards = {}
        for i in self.sources:
            layer = net.layer_list[i]
            ts = [next(it) for _ in net.top_lists[i]]
            if layer.type == "Input":
                for n, t in zip(net.top_lists[i], ts):
                    net.blobs[n]._t = t
            else:
                forwards[i] = layer.forward
                layer.forward = lambda bottoms, ts=ts: list(ts)
        try:
            yield
        finally:
            for i, f in forwards.items():
                net.layer_list[i].forward = f

    def _eager(self, xs) -> torch.Tensor:
        with self._fed(xs):
            loss = self.net.forward_tensors()
        self.net.backward_tensors(blob_diffs=False)
        return loss

    def _params(self) -> list[torch.Tensor]:
        net = self.net
        return [p for p in net._range_params(0, len(net.layer_list) - 1) if p.requires_grad]

    def _written(self) -> dict:
        """{blob: value} the last forward's non-source layers wrote (the last writer wins)."""
        net, out = self.net, {}
        for j in sorted(net._ran):
            if j not in self.sources:
                out.update(zip(net.top_lists[j], net._ran[j][1]))
        return out

    # -- capture --------------------------------------------------------------------------
    def capture(self, xs, eager) -> bool:
        """Trace on this iteration's inputs ``xs`` and compare with the eager results
        ``eager`` = (loss, {top: tensor}, [grad per param]); True when the graph is in use."""
        net = self.net
        if any(b._viewed("data") or b._viewed("diff") for b in net.blobs.values()):
            log.debug("step graph: a blob is viewed from numpy")
            return False
        from .recording import record as record_graph

        self.params, self.seeds = self._params(), []
        saved = {n: (b._t, b._d, b._owned.copy()) for n, b in net.blobs.items()}
        ran = net._ran
        record: list = []
        try:
            with _deferred_label_checks(record):
                gm = record_graph(self._traced, xs, made=True)
        except RecordError as e:     # data-dependent control flow: declined by design
            log.debug("step graph: trace declined: %s", e)
            return False
        finally:
            for n, (t, d, owned) in saved.items():
                b = net.blobs[n]
                b._t, b._d, b._owned = t, d, owned
            net._ran, net._fed = ran, {}
        self.checks = []
        for layer, label, k, ignore in record:
            # the label reaches the layer detached or reshaped: the same memory as an input
            idx = [j for j, x in enumerate(xs)
                   if x.data_ptr() == label.data_ptr() and x.numel() == label.numel()]
            if not idx:
                log.debug("step graph: layer '%s' checks labels computed inside the net", layer.name)
                return False
            if not any(c[1:] == (idx[0], k, ignore) for c in self.checks):
                self.checks.append((layer, idx[0], k, ignore))   # Accuracy and loss: one check
        for node in list(gm.graph.nodes):       # no autograd at replay: a param's detach is a no-op
            if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
        gm.graph.eliminate_dead_code()
        _fold(gm, [d for b, d in self.seeds if not b._owned["diff"]])
        gm.recompile()
        self.gm, self.key = gm, self._key(xs)
        self.side, self.side_tops = None, []
        split = split_side_tops(gm, len(self.tops))
        if split is not None:
            self.gm, self.side, idx = split
            self.side_tops = [self.tops[i] for i in idx]
            unbox(self.side)
        unbox(self.gm)
        self._core_tops = [t for t in self.tops if t not in self.side_tops]
        if not self._prepare(xs):
            self.gm, self.captures = None, 3
            return False
        loss, tops, grads = self._values(xs)
        e_loss, e_tops, e_grads = eager
        same = (same_bits(loss, e_loss) and tops.keys() == e_tops.keys()
                and all(same_bits(tops[n], e_tops[n]) for n in tops)
                and all((g is None) == (e is None) and (g is None or same_bits(g, e))
                        for g, e in zip(grads, e_grads)))
        if not same:
            self.gm, self.captures = None, 3
            self.guard.fail("the recorded step differs from the eager one")
            return False
        log.info("Net '%s': forward and backward replayed as one %s (%d ops)", net.name,
                 self.KIND, sum(n.op == "call_function" for n in self.gm.graph.nodes))
        return True

    KIND = "recorded graph"

    def _prepare(self, xs) -> bool:
        """Make the recorded graph ready to run on inputs like ``xs`` (here: nothing to do;
        the CUDA subclass captures it); False keeps the eager step."""
        return True

    def _run(self, xs) -> tuple:
        """The recorded graph's outputs on inputs ``xs`` (grad mode off)."""
        return self.gm.forward(*xs)       # not Module.__call__: no hooks to look for

    def _traced(self, *xs):
        net = self.net
        with self._fed(xs):
            loss = net.forward_tensors()
        written = self._written()
        self.tops = list(written)
        seeds, seed_grads = [], []
        for j, k in net._frontier(0, len(net.layer_list) - 1):
            t = net._ran[j][1][k]
            if t.requires_grad:
                seeds.append(t)
                blob = net.blobs[net.top_lists[j][k]]
                seed_grads.append(blob.diff_tensor.to(t.dtype))
                self.seeds.append((blob, blob.diff_tensor))
        grads = (backprop.grad(seeds, self.params, seed_grads)
                 if seeds else [None] * len(self.params))
        self.has_grad = [g is not None for g in grads]
        return (loss, *written.values(), *[g for g in grads if g is not None])

    # -- replay ---------------------------------------------------------------------------
    def _values(self, xs, lazy: bool = False):
        """(loss, {top: value}, grads) from the graph; with ``lazy``, the side tops (read by
        nothing the step needs, e.g. a TRAIN Accuracy) are left to ``self._settle``."""
        core = self._core_tops
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)     # not torch.set_grad_enabled: an object per call
        try:
            out = self._run(xs)
            n = len(core)
            tops = dict(zip(core, out[1:1 + n]))
            grads, i = [], 1 + n
            for h in self.has_grad:
                grads.append(out[i] if h else None)
                i += h
            if self.side is not None:
                if lazy:
                    self._mark_stale(out[i:])
                else:
                    tops.update(zip(self.side_tops, self.side.forward(*out[i:])))
        finally:
            torch._C._set_grad_enabled(grad_mode)
        return out[0], tops, grads

    def _mark_stale(self, cut) -> None:
        """Side tops computed when first read (Blob._pending), from the values saved now; a
        blob someone holds a numpy view of is written at once, since the view reads memory."""
        blobs = [self.net.blobs[n] for n in self.side_tops]
        if any(b._viewed("data") for b in blobs):
            with torch.no_grad():
                outs = self.side(*cut)
            for b, t in zip(blobs, outs):
                b.write(t)
            return
        marks = [(b, b._t) for b in blobs]

        def settle():
            live = [(b, t) for b, t in marks if b._pending is settle]
            for b, _ in live:
                b._pending = None
            if not live:
                return
            with torch.no_grad():
                outs = dict(zip(self.side_tops, self.side(*cut)))
            for (b, t), name in zip(marks, self.side_tops):
                if (b, t) in live and b._t is t:       # not rewritten since the step
                    b.write(outs[name])
        for b in blobs:
            b._pending = settle

    def drop(self) -> None:
        """Forget stale side tops (a step is about to rewrite them)."""
        if self.side is not None:
            for n in self.side_tops:
                self.net.blobs[n]._pending = None

    def _check_labels(self, xs) -> None:
        """The label range checks the recording deferred, on this step's inputs."""
        from ..layers.loss import check_labels
        for layer, j, k, ignore in self.checks:
            check_labels(layer, xs[j], k, ignore)

    def _replay(self, xs) -> torch.Tensor:
        net = self.net
        loss, tops, grads = self._values(xs, lazy=True)
        for name, t in tops.items():
            net.blobs[name].write(t)
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = as_param_grad(g, p)
        net._ran, net._fed = {}, {}
        return loss
