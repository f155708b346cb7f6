"""Lean inference: a TEST net's repeated whole forward as one recording of plain torch ops.

After ``AFTER`` whole ``net.forward()`` calls with the same input shapes, the net is recorded once
per input shape as ``to_torch``'s folded graph, on NHWC inputs as the plain CPU path runs, and
later whole forwards replay it. Pycaffe's semantics hold by a transparent fallback: intermediate
blobs are marked stale and re-made by the plain path when first read; a ``backward()`` after a
replay runs the plain forward again under autograd first (a net that may need one, force_backward
or a loss, replays only after ``AFTER`` forwards without one); ``start``/``end``/``blobs=``, a live
numpy view of an intermediate blob, other shapes or a refused trace take the plain path; a net
with layers no graph holds is cut before them (``cut.py``); the layers' own tensors are read, so
net surgery is seen. Kernels are re-chosen by size, never by timing (``choose_kernels``): outputs
equal the plain path's bit for bit where none is re-chosen, else within ``1e-5`` of their scale.
On CUDA: also a CUDA graph (``cuda_graph.py``), kept if its first replay gives the same bits.
``BREWNET_LEAN=0`` off, ``=1`` on CUDA too. Why, and the measurements: docs/internals.md.
"""
from __future__ import annotations

import logging
import operator
import os
import time

import numpy as np
import torch

from ..blob import host_copy, look_at_param_views, nhwc
from . import cut as _cut
from . import engines
from .cuda_graph import device_refusal
from .engines import due, pick, rebuild
from .fast_path import FAILED, FastPath
from .postops import fuse_postops
from .process import env_switch
from .recording import recorded_nchw, unbox

log = logging.getLogger("brewnet")
AFTER = 10      # whole forwards with the same input shapes before the net is traced
SHAPES = 8      # input shapes whose graph and engine are kept when the shapes change (a face
                # detector's image pyramid, FCN on a few image sizes: each traced once)
# what is kept per input shape, and its value before any call on that shape
_PER_SHAPE = {"calls": 0, "gm": None, "steps": list, "spent": 0.0, "engine": None, "_picked": False,
              "cached": None, "confirm": None, "captured": None, "_addresses": None, "_nhwc_w": dict,
              "cut": None}
SMALL_CONV_FLOPS = 4e6     # convolutions below this (whole batch): torch's own im2col + GEMM
# ... on inputs of at most this many elements in an NHWC graph: it takes NCHW, and the copy costs
# more than oneDNN's convolution on a large input (MTCNN P-Net's 2-output 1x1 on 32x115x155:
# an NCHW copy of 742 us and 272 us of GEMM, against 115 us in oneDNN)
SMALL_CONV_MAX_INPUT = 1 << 16
# inner products with this many weights or more: oneDNN's (the plain path's threshold,
# functional.DNN_MIN_WEIGHT, is 2^18: it also counts the backward; at inference LeNet's ip1,
# 400k weights, takes ~130 us on BLAS and ~215 on oneDNN at batch 1)
GRAPH_DNN_MIN_WEIGHT = 1 << 22
aten = torch.ops.aten
_MKLDNN_LINEAR = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_MKLDNN_LINEAR = getattr(_MKLDNN_LINEAR, "default", None)


def _nchw(x: torch.Tensor) -> torch.Tensor:
    """``x`` in NCHW memory (undoing ``_nhwc``'s one-channel strides too)."""
    x = x.contiguous()
    if x.dim() == 4 and x.shape[1] == 1 and x.stride(1) != x.stride(0):
        h, w = x.shape[2:]
        x = x.as_strided(x.shape, (h * w, h * w, w, 1))
    return x


def small_conv(x, weight, bias, stride, pad, channels_last: bool):
    """A small convolution as torch's native kernel (im2col + one GEMM, NCHW), the result in
    the net's layout: oneDNN's primitives cost several times more for these (LeNet at batch
    1: conv1 ~116 us vs ~28, conv2 ~210 vs ~85, one thread)."""
    y = aten._slow_conv2d_forward(_nchw(x), weight, list(weight.shape[2:]), bias, stride, pad)
    return nhwc(y) if channels_last else y


def dnn_linear(x, weight, bias):
    from ..layers.functional import _dnn_linear

    return _dnn_linear()(x, weight, bias)


def _conv_input_numel(out, weight, stride, pad) -> int:
    """The elements of a convolution's input (the part its windows read) from its output."""
    n, _, oh, ow = out.shape
    kh, kw = weight.shape[2:]
    return n * weight.shape[1] * max(1, (oh - 1) * stride[0] + kh - 2 * pad[0]) * \
        max(1, (ow - 1) * stride[1] + kw - 2 * pad[1])


def choose_kernels(gm: torch.fx.GraphModule, channels_last: bool) -> int:
    """Fixed, size-based kernel choices in the graph (never timed, so the numbers never depend
    on the run): small 2-D convolutions go to ``small_conv``; inner products with
    ``GRAPH_DNN_MIN_WEIGHT`` weights or more to oneDNN's (the trace records BLAS ``addmm``;
    oneDNN pays for CaffeNet's fc6/fc7 at batch 16, ~70 vs ~98 ms for fc6, and loses below).
    Returns how many nodes changed."""
    from ..layers.functional import _dnn_linear

    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in (aten.conv2d.default, aten.convolution.default):
            if n.target is aten.conv2d.default:     # exported; recorded graphs hold convolution
                defaults = [None, [1, 1], [0, 0], [1, 1], 1]   # bias, stride, pad, dilation, groups
                x, w, b, stride, pad, dil, groups = list(n.args) + defaults[len(n.args) - 2:]
                plain = True
            else:
                x, w, b, stride, pad, dil, transposed, out_pad, groups = n.args
                plain = not transposed and not any(out_pad) and len(stride) == 2
            out = n.meta.get("val")
            if (n.kwargs or not plain or w.op != "get_attr" or out is None or groups != 1
                    or list(dil) != [1, 1]):
                continue
            weight = operator.attrgetter(w.target)(gm)
            if weight.dtype != torch.float32 or weight.dim() != 4:
                continue
            if 2 * out.numel() * weight[0].numel() >= SMALL_CONV_FLOPS:
                continue
            if channels_last and _conv_input_numel(out, weight, stride, pad) > SMALL_CONV_MAX_INPUT:
                continue
            # the layout the recorded convolution gave (an NCHW input gives NCHW)
            new = (small_conv, (x, w, b, list(stride), list(pad), channels_last and not recorded_nchw(n)))
        elif n.target is _MKLDNN_LINEAR and n.args[3:4] == ("none",) and n.args[1].op == "get_attr":
            # the plain path's oneDNN inner product (2^18 weights or more, recorded): BLAS below
            # GRAPH_DNN_MIN_WEIGHT, as the exported graph had it
            x, w, b = n.args[:3]
            weight = operator.attrgetter(w.target)(gm)
            out = n.meta.get("val")
            if (weight.numel() >= GRAPH_DNN_MIN_WEIGHT or weight.dim() != 2 or out is None
                    or out.dim() != 2):
                continue
            with gm.graph.inserting_before(n):
                t = gm.graph.call_function(aten.t.default, (w,))
            new = (aten.addmm.default, (b, x, t)) if b is not None else (aten.mm.default, (x, t))
        elif n.target is aten.addmm.default and _dnn_linear() is not None:
            b, x, t = n.args[:3]
            if (len(n.args) > 3 or n.kwargs or t.op != "call_function"
                    or t.target is not aten.t.default or t.args[0].op != "get_attr"):
                continue
            weight = operator.attrgetter(t.args[0].target)(gm)
            if weight.dtype != torch.float32 or weight.numel() < GRAPH_DNN_MIN_WEIGHT:
                continue
            new = (dnn_linear, (x, t.args[0], b))
        else:
            continue
        with gm.graph.inserting_before(n):
            m = gm.graph.call_function(*new)
        m.meta = dict(n.meta)
        n.replace_all_uses_with(m)
        gm.graph.erase_node(n)
        changed += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return changed


_CONVS = (aten.conv2d.default, aten.convolution.default, torch.convolution)   # (after unbox)


def conv_weights(gm: torch.fx.GraphModule) -> set[str]:
    """The attributes the graph's oneDNN convolutions read as weights (NHWC copies: not for a
    convolution recorded on an NCHW input, whose output would then be NHWC)."""
    return {n.args[1].target for n in gm.graph.nodes
            if n.op == "call_function" and n.args and n.target in _CONVS
            and n.args[1].op == "get_attr" and not recorded_nchw(n)}


class LeanForward:
    def __init__(self, net):
        self.net = net
        self.calls, self._key = 0, None
        self.gm, self.steps = None, []
        self.guard = FastPath("lean inference (repeated forwards as one graph)", lambda: net.name)
        self._nhwc_w: dict = {}                    # id(weight) -> (key, weight, NHWC copy)
        self.traces = 0                            # traces attempted (each a one-off cost)
        self.picks = 0                             # engine picks made (each a one-off cost)
        self._cl = net._channels_last              # the plain path's NHWC activations
        self._saved: list[torch.Tensor] = []       # the inputs the graph last ran on
        self.captured, self._addresses = None, None  # CUDA: the graph captured, what it reads
        self._stale: list = []                     # intermediate blobs not written by the graph
        self.engine = None                         # the runner engine picked, when not eager
        self.cut = None                            # where a net with no-graph layers is cut
        self._picked = False                       # engine picked for the current graph
        self.cached = None                         # the engine cache's entry for it (auto)
        self.confirm = None                        # (key, entry) of a cached choice to measure again
        self.spent = 0.0                           # seconds of whole forwards on these shapes
        self.running = False                       # inside run (its reshapes are not the user's)
        self._shapes: dict = {}                    # other input shapes: their _PER_SHAPE state
        self.quiet = 0                             # whole forwards since the last backward()
        self.replayed = False                      # the last whole forward was the graph's
        self._direct = None                        # what direct() reads, bound by _run
        io = set(net.inputs) | set(net.outputs)
        self._middle = [b for n, b in net.blobs.items() if n not in io]

    def eligible(self) -> bool:
        net = self.net
        return (self.guard.off is None and env_switch("BREWNET_LEAN", "1", ("0", "1")) == "1" and net.inputs
                and device_refusal(net.device, asked=os.environ.get("BREWNET_LEAN", "").strip() == "1") is None
                and not any(b._viewed("data") for b in self._middle))

    def run(self) -> bool:
        """One whole forward through the graph when it is ready (else count towards it); False:
        the caller runs the plain path."""
        if not self.eligible():
            return False
        look_at_param_views()          # (a cached engine's or graph's weights: still these?)
        self.running = True
        try:
            return self._run()
        finally:
            self.running = False

    def _run(self) -> bool:
        net = self.net
        key = self._input_key()
        if key != self._key:
            self._switch(key)
        self.calls += 1
        self.quiet += 1
        if net._needs_backward and self.quiet <= AFTER:
            return False                     # a loop calling backward() keeps autograd's forward
        if self.gm is None and self.engine is None:
            if self.calls <= AFTER and getattr(net, "precision", "fp32") == "fp32":
                return False                 # (bf16: the user's opt-in holds from call 1)
            if net._current_input_shapes() != net._input_shapes:
                net.reshape()
            if self.guard.attempt(self._build) is FAILED:
                self.gm = None
                return False
        self.drop()                        # re-marked below, against this call's inputs
        if net._current_input_shapes() != net._input_shapes:
            net.reshape()                  # the user's shapes: an error here is the user's
        xs = [net.blobs[n].tensor.detach() for n in net.inputs]
        if not self._picked and self.guard.attempt(due, self, xs) is True:
            self._picked = True
            self.picks += 1                # a one-off cost too: no sample for the thread timing
            self.engine = self.guard.attempt(pick, self, xs)
            self.engine = None if self.engine is FAILED else self.engine
        elif self.confirm is not None and self.spent >= engines.AUTO_AFTER_S:
            self._confirm(xs)
        outs = self.guard.attempt(self._outputs, xs)
        if outs is FAILED:
            self.gm = self.captured = self.engine = None
            return False
        fresh = getattr(self.engine, "fresh", False)     # its outputs: memory nobody else holds
        for name, t in zip(net.outputs, outs):
            net.blobs[name].write(t, fresh)
        if [s.shape for s in self._saved] == [x.shape for x in xs]:
            for s, x in zip(self._saved, xs):      # into last call's copies: no allocation
                host_copy(s, x)
        else:
            self._saved = [x.clone() for x in xs]
        self._mark_replayed()
        self._bind_direct()
        return True

    def _confirm(self, xs) -> None:
        """Measure the cached choice again (``engines.CONFIRMS``) and run on what the mean of
        the measurements picks; the engine stays as it is if anything fails."""
        prior, engine, self.confirm = self.confirm, self.engine, None
        self.picks += 1
        if self.gm is None and self.guard.attempt(self._build) is FAILED:    # (ready at the start)
            self.gm, self.engine, self._picked = None, engine, True
            return
        got = self.guard.attempt(pick, self, xs, prior)
        self.engine, self._picked, self.cached = engine if got is FAILED else got, True, None

    def _mark_replayed(self) -> None:
        """After a whole forward not run by the layers: every intermediate blob is stale (brought
        up to date when read: ``settle``), the last plain forward's autograd graph is freed."""
        if not self._stale:                  # (else still every middle blob, marked)
            self._stale = list(self._middle)
            for b in self._stale:
                b._pending = self.settle
        if not self.replayed or self.net._ran:
            self.replayed, self.net._ran = True, {}

    def _bind_direct(self) -> None:
        """What ``direct`` needs, taken after a whole forward on an engine with numpy I/O."""
        net, engine = self.net, self.engine
        self._direct = None
        if (engine is None or self.cut is not None or not hasattr(engine, "arrays")
                or net.device.type != "cpu"):
            return
        ins = [net.blobs[n] for n in net.inputs]
        arrays = [b._t.detach().numpy() for b in ins]
        if all(a.flags.c_contiguous for a in arrays):
            self._direct = (engine, ins, [b._t for b in ins], arrays,
                            [s.numpy() for s in self._saved], [net.blobs[n] for n in net.outputs])

    def direct(self, inputs: dict) -> dict | None:
        """A whole forward on the engine picked, in the steady case, in few steps: ``inputs``
        (numpy arrays by name, or none: the blobs' values) copied into the input blobs, whose
        memory the engine reads, its new output arrays taken by the output blobs. None where
        anything differs from the forward that bound it: the general path then runs."""
        t0 = time.perf_counter() if self.confirm is not None else 0.0   # (timed only then)
        look_at_param_views()
        bound, net = self._direct, self.net
        if bound is None or self.guard.off is not None or net.hooked():
            return None
        engine, ins, tensors, arrays, saved, outs = bound
        if (engine is not self.engine or os.environ.get("BREWNET_LEAN", "1") != "1"
                or any(b._views["data"] and b._viewed("data") for b in self._middle)
                or (net._needs_backward and self.quiet < AFTER)
                or any(b._t is not t or b._pending is not None for b, t in zip(ins, tensors))
                or not engine.state.holds()):
            return None
        if inputs:
            if len(inputs) != len(ins):
                return None
            values = [inputs.get(n) for n in net.inputs]
            if not all(type(v) is np.ndarray and v.shape == a.shape and v.dtype == a.dtype
                       for v, a in zip(values, arrays)):
                return None
            for a, v in zip(arrays, values):
                np.copyto(a, v)
        try:
            got = engine.arrays(arrays)
        except Exception:   # noqa: BLE001 - the general path's guard reports it and goes plain
            return None
        owned = engine.owned           # (OpenCV's: its dnn's own buffers, copied by take)
        for s, a in zip(saved, arrays):
            np.copyto(s, a)
        self.calls += 1
        self.quiet += 1
        result = {n: b.take(a, owned) for n, b, a in zip(net.outputs, outs, got)}
        self._mark_replayed()
        if self.confirm is not None:          # its forwards count towards measuring again
            self.spent += time.perf_counter() - t0
            if self.spent >= engines.AUTO_AFTER_S:
                self._direct = None           # the next call takes the general path: _confirm
        return result

    def _input_key(self) -> tuple:
        return tuple(tuple(self.net.blobs[n].shape) for n in self.net.inputs)

    def _switch(self, key) -> None:
        """Make ``key``'s input shapes the current ones: the state of the shapes left is kept
        (the ``SHAPES`` most recent), that of ``key`` taken back, or started afresh."""
        if self._key is not None:
            self._shapes[self._key] = {a: getattr(self, a) for a in _PER_SHAPE}
            while len(self._shapes) > SHAPES:
                del self._shapes[next(iter(self._shapes))]
        state = self._shapes.pop(key, None)
        for a, v in _PER_SHAPE.items():
            setattr(self, a, state[a] if state is not None else v() if callable(v) else v)
        self._key = key

    def _outputs(self, xs) -> tuple:
        """The net's outputs: the engine's, and a cut net's tail on them (execution/cut.py)."""
        outs = self._engine_call(xs)
        return outs if self.cut is None else self.cut.finish(self.net, outs, xs, self._cl)

    def _engine_call(self, xs) -> tuple:
        """The outputs from the engine picked (rebuilt when a weight changed), else the graph's."""
        if self.engine is not None and not self.engine.state.holds():
            engine = self.engine
            if self.gm is None:              # an engine ready from the start: the graph checks it
                self._build()
                self._picked, self.cached = True, None
            self.engine = rebuild(self, engine, xs)
        return self.engine(xs) if self.engine is not None else self._bound_call(xs)

    def _bound_call(self, xs) -> tuple:
        """The graph's outputs on the input tensors ``xs``, bound to the current params."""
        self._bind()
        with torch.no_grad():
            return self._call([nhwc(x) if self._cl and x.dim() == 4 else x for x in xs])

    def _call(self, xs) -> tuple:
        """The graph's outputs on ``xs``: on the CPU by calling it; on CUDA by replaying its
        capture (made, and checked bit for bit against a call, when what it reads moved).
        A capture that differs from its graph raises: the guard keeps the net plain."""
        if self.net.device.type != "cuda":
            out = self.gm(*xs)
            return out if isinstance(out, tuple) else (out,)
        from .cuda_graph import CapturedGraph
        from .recording import same_bits

        addresses = tuple(t.data_ptr() for t in (*self.gm.parameters(), *self.gm.buffers()))
        if self.captured is None or addresses != self._addresses:
            self.captured = CapturedGraph(self.gm, xs)
            out = self.gm(*xs)
            want = out if isinstance(out, tuple) else (out,)
            if not all(same_bits(a, b) for a, b in zip(self.captured(xs), want)):
                raise RuntimeError("the CUDA graph of repeated inference differs from its graph")
            self._addresses = addresses
        return self.captured(xs)

    def settle(self) -> None:
        """Bring the stale intermediate blobs up to date: the plain forward on the saved inputs
        (the inputs and outputs the user sees are left as the graph's run left them)."""
        if self._stale:
            self._plain(grad=False)

    def before_backward(self) -> None:
        """pycaffe's ``backward()`` after a forward the graph ran: the plain forward again on its
        inputs, under autograd, so the backward gives the eager gradients; the next ``AFTER``
        whole forwards stay plain (a forward-backward loop pays one extra forward in ``AFTER``)."""
        self.quiet = 0
        if self.replayed:
            self._plain(grad=True)

    def _plain(self, grad: bool) -> None:
        for b in self._stale:
            b._pending = None
        self._stale, self.replayed = [], self.replayed and not grad
        net = self.net
        blobs = [net.blobs[n] for n in net.inputs]
        now = [b._t for b in blobs]
        outs = [net.blobs[n].tensor.detach().clone() for n in net.outputs]
        try:
            for b, x in zip(blobs, self._saved):
                b._t = x
            with torch.set_grad_enabled(grad):
                net.forward_tensors()
        finally:
            for b, t in zip(blobs, now):
                b._t = t
            for name, t in zip(net.outputs, outs):
                net.blobs[name].write(t)

    def prepare(self) -> None:
        """At the net's construction: the engine the cache chose for the declared input shapes,
        built now, so that a fresh process's first forward runs at the steady speed (no trace,
        no pick at the ``AFTER``-th call). Anything amiss leaves the usual path to it."""
        net = self.net
        try:                        # (a bad switch is the user's error at the forward, as ever)
            if (not self.eligible() or (self.engine is not None and self._key == self._input_key())
                    or _cut.plan(net) is not None):
                return                      # (a cut net's engine runs its trunk: the usual path)
            ready = engines.ready(self)
        except Exception as e:      # noqa: BLE001 - an optimisation: the usual path still runs
            log.debug("Net '%s': no engine ready at construction: %s: %s", self.net.name,
                      type(e).__name__, str(e)[:300])
            return
        if ready is not None:
            self._switch(self._input_key())
            self.engine, self.cached = ready
            self._picked, self.confirm = True, engines.unconfirmed(*self.cached)
            self._saved = [net.blobs[n].tensor.detach().clone() for n in net.inputs]
            self._bind_direct()            # the first forward can take the steady call

    def plain(self, xs) -> tuple:
        """The plain path's outputs on inputs ``xs``, every blob left as it was."""
        net = self.net
        before = {b: (b._t, b._owned["data"]) for b in net.blobs.values()}
        try:
            for name, x in zip(net.inputs, xs):
                net.blobs[name]._t = x
            with torch.no_grad():
                net.forward_tensors()
            return tuple(net.blobs[n].tensor.detach().clone() for n in net.outputs)
        finally:
            for b, (t, owned) in before.items():
                b._t, b._owned["data"] = t, owned

    def drop(self) -> None:
        """Forget the stale marks (a plain whole forward is about to rewrite every blob)."""
        for b in self._stale:
            b._pending = None
        self._stale, self.replayed = [], False

    def _build(self) -> None:
        net = self.net
        self.traces += 1
        self.captured, self.engine, self._picked, self.cached = None, None, False, None
        t0 = time.perf_counter()
        self.cut = _cut.plan(net)
        if self.cut is not None:
            self.cut.constants(net, self._cl)
        self.gm, tracee = self._record()
        if net.device.type == "cpu":        # CPU kernel choices (oneDNN vs im2col)
            choose_kernels(self.gm, self._cl)
            fuse_postops(self.gm, self._cl)    # conv + activation / add as oneDNN post-ops
        nhwc = conv_weights(self.gm) if self._cl else set()
        self.steps = [(i, end, getattr(self.gm, attr), names,
                       [f"{attr}.{n}" in nhwc for n in names])
                      for i, end, attr, names in tracee.steps if attr is not None]
        unbox(self.gm)
        self._nhwc_w = {}
        where = ""
        if self.cut is not None:
            first = net.layer_list[self.cut.tail[0]]
            where = (f", cut before layer '{first.name}' (type {first.type}): its {len(self.cut.tail)} "
                     "last layers run eagerly")
        log.info("Net '%s': repeated inference runs as one graph of torch ops (traced in %.2g s)%s",
                 net.name, time.perf_counter() - t0, where)

    def _record(self):
        """(graph, tracee): ``to_torch``'s folded module run once on this call's input shapes
        and its aten ops recorded (brewnet/execution/recording.py: milliseconds, where torch.export took
        seconds on its first call in a process). A run that branched on a value goes through
        torch.export instead."""
        from ..deploy.fx_export import _graph_module, _Tracee, traced_program
        from .recording import RecordError, record

        net = self.net
        with torch.no_grad():
            tracee = _Tracee(net, fold=True, cut=self.cut)
            attrs = {id(t): name for name, t in [*tracee.named_parameters(remove_duplicate=False),
                                                 *tracee.named_buffers(remove_duplicate=False)]}
            xs = [torch.randn(net.shapes[n], device=net.device) for n in net.inputs]
            xs = [nhwc(x) if self._cl and x.dim() == 4 else x for x in xs]
            try:
                gm = record(tracee, xs, attrs, root=tracee)
            except RecordError as e:
                log.debug("Net '%s': lean graph through torch.export (%s)", net.name, e)
                ep, tracee, _ = traced_program(net, fold=True, dynamic_batch=False,
                                               channels_last=self._cl, cut=self.cut)
                return _graph_module(ep, tracee), tracee
        for attr in tracee.layer_names:      # the layers' own modules: _bind rebinds their params
            setattr(gm, attr, getattr(tracee, attr))
        return gm, tracee

    def _bind(self) -> None:
        """Point the graph at the layers' current parameters (folded ones from the cache)."""
        net = self.net
        for i, end, sub, names, layouts in self.steps:
            blobs = net._folder.weights(i) if end != i else net.layer_list[i].blobs
            for name, t, cl in zip(names, blobs, layouts):
                if cl:
                    t = self._nhwc_weight(t)
                (sub._buffers if name in sub._buffers else sub._parameters)[name] = t

    def _nhwc_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A convolution weight in NHWC memory, cached as ``Folder`` caches (against the tensor's
        version and the numpy views handed out): oneDNN converts an NCHW weight to its input's
        layout on every call (CaffeNet at batch 1: ~10 ms of its ~170 on one thread). Same
        values, same kernel: the same numbers."""
        from .. import blob as _blob

        key = (_blob.param_views(), w._version)
        hit = self._nhwc_w.get(id(w))
        if hit is not None and hit[0] == key and hit[1] is w:
            return hit[2]
        cl = w.detach().contiguous(memory_format=torch.channels_last)
        self._nhwc_w[id(w)] = (key, w, cl)
        return cl
