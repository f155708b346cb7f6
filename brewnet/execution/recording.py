"""Record the aten ops of one real run of a function as a torch.fx graph, and replay them fast.

Used by the recorded step (``recorded_step.py``), the recorded update, the recorded fused step
and lean inference (``execution/lean.py``). A ``TorchDispatchMode`` around a real run on the real tensors
(not ``make_fx``): every op that reaches the kernels, forward and autograd backward alike,
becomes a node; a tensor no recorded op made and that is not an input is a constant held by
reference (the params: a replay reads their current values). It refuses (``RecordError``) what a
straight-line replay cannot honour: an op whose result is not a tensor (the run branched on a
value); a tensor's values read into Python (``.numpy()``, ``.tolist()``: seen by a
``TorchFunctionMode``); a tensor sharing memory with a recorded one yet made outside dispatch
(``.data``, numpy); an op writing into a constant (a param or buffer changed during the run).
Why not ``make_fx``, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import operator
import threading

import torch
from torch.fx import Graph, GraphModule
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_LOCK = threading.Lock()   # the mode stack is per thread, but torch keeps module-level flags of it


class RecordError(RuntimeError):
    pass


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


def nchw_only(t: torch.Tensor) -> bool:
    """Contiguous in NCHW memory and not in NHWC (where both hold, the layouts agree)."""
    return (t.dim() == 4 and t.is_contiguous()
            and not t.is_contiguous(memory_format=torch.channels_last))


def recorded_nchw(node) -> bool:
    """Whether ``node``'s value was NCHW-only when recorded (an NHWC net's convolution on an
    NCHW input: an NHWC weight would make its output NHWC, and a view after it may need NCHW);
    export's fake values keep their strides."""
    if "nchw" in node.meta:
        return node.meta["nchw"]
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and nchw_only(val)


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's disable, importing torch._dynamo
        # at the first op (~2 s here); nothing under this mode is ever compiled
        return False

    def __init__(self, inputs, attrs=None, root=None):
        super().__init__()
        self.graph = Graph()
        self.root = root if root is not None else torch.nn.Module()
        self.attrs = attrs or {}                 # id(tensor) -> its attribute path on root
        self.node: dict[int, torch.fx.Node] = {}
        self.seen: list[torch.Tensor] = []       # alive while recording: ids stay unique
        self.made: dict[int, list] = {}          # storage -> [(layout, node)] of recorded tensors
        self.spans: list[tuple] = []            # (address, bytes) of their storages
        self.consts = 0                          # constants the graph holds itself
        self.error: str | None = None
        for i, x in enumerate(inputs):
            self._bind(x, self.graph.placeholder(f"x{i}"))

    def _bind(self, t: torch.Tensor, node) -> None:
        self.node[id(t)] = node
        self.seen.append(t)
        if _storage(t):
            self.made.setdefault(_storage(t), []).append((_layout(t), node))
            self.spans.append((_storage(t), t.untyped_storage().nbytes()))

    def _same_view(self, t: torch.Tensor):
        for layout, node in reversed(self.made.get(_storage(t), ())):
            if layout == _layout(t):
                return node
        return None

    def _tensor(self, t: torch.Tensor):
        node = self.node.get(id(t))
        if node is not None:
            return node
        # an alias made outside dispatch (autograd's saved outputs, .data): the latest
        # recorded tensor of that memory and layout (after any in-place op on it)
        made = self._same_view(t)
        if made is not None:
            self.node[id(t)] = made
            self.seen.append(t)
            return made
        if t.numel() and any(a <= t.data_ptr() < a + n for a, n in self.spans):
            self.error = self.error or "a tensor shares memory with the run's own; no op made it"
        name = self.attrs.get(id(t))
        if name is None:
            name = f"_c{self.consts}"
            setattr(self.root, name, t)
            self.consts += 1
        node = self.graph.get_attr(name)
        self.node[id(t)] = node
        self.seen.append(t)
        return node

    def arg(self, a):
        if isinstance(a, torch.Tensor):
            return self._tensor(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fargs, fkwargs = self.arg(args), self.arg(kwargs)
        schema = func._schema
        for a, spec in zip(fargs, schema.arguments):
            if (spec.alias_info is not None and spec.alias_info.is_write
                    and isinstance(a, torch.fx.Node) and a.op == "get_attr"):
                self.error = self.error or f"{func} writes into a tensor made before the step"
        out = func(*args, **kwargs)
        ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        if isinstance(out, torch.Tensor) and ret is not None and not ret.is_write:
            same = self._same_view(out)       # a view as the memory already was (view to its
            if same is not None:              # own shape, t of a t, detach): not an op to replay
                self.node[id(out)] = same
                self.seen.append(out)
                return out
        node = self.graph.call_function(func, fargs, fkwargs)
        if isinstance(out, torch.Tensor):
            node.meta["val"] = torch.empty(out.shape, dtype=out.dtype, device="meta")
            node.meta["nchw"] = nchw_only(out)     # (lean.choose_kernels keeps the layout)
            self._bind(out, node)
        elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None
                                                   for o in out):
            for i, o in enumerate(out):
                if o is not None:
                    self._bind(o, self.graph.call_function(operator.getitem, (node, i)))
        elif out is not None:
            self.error = self.error or (f"{func} returned {type(out).__name__} "
                                        "(the run branched on a value)")
        return out


class _ValueReads(TorchFunctionMode):
    """Flags a tensor's values leaving for Python during the run."""
    READS = frozenset({torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.tolist})

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.rec.error = self.rec.error or (f"Tensor.{func.__name__}() read values into "
                                                "Python (what follows from them would be fixed)")
        return func(*args, **(kwargs or {}))


def record(fn, inputs, attrs: dict | None = None, root=None, made: bool = False) -> GraphModule:
    """``fn(*inputs)`` run once for real; the graph of the aten ops it ran, returning what
    ``fn`` returns (a tuple of tensors). A tensor in ``attrs`` (id -> attribute path on
    ``root``) is read from there at each call; other constants are held by the graph.
    ``made``: every output must come from a recorded op (a training step's loss and gradients:
    one the recording missed, e.g. a backward it did not see, would be replayed as this run's
    value forever, and the check at capture, on this run's inputs, could not tell)."""
    rec = _Recorder(inputs, attrs, root)
    with _LOCK, _ValueReads(rec), rec:
        outs = fn(*inputs)
    if rec.error:
        raise RecordError(rec.error)
    nodes = tuple(rec.arg(o) for o in outs)
    if made and any(isinstance(n, torch.fx.Node) and n.op == "get_attr" for n in nodes):
        raise RecordError("an output was made by no recorded op")
    rec.graph.output(nodes)
    return GraphModule(rec.root, rec.graph)


_TO_KWARGS = frozenset({"dtype", "device", "non_blocking", "memory_format"})


def unbox(gm) -> None:
    """Call each recorded aten op through torch's Python binding of the same name (``torch.mm``,
    ``Tensor.view``): the binding dispatches straight to the kernel, where ``OpOverload``'s
    boxed call packs and unpacks an argument stack (measured: 1.6x faster on logreg's graph).
    The binding picks the overload from the same arguments; the capture's bitwise check
    covers the result. Ops without a binding keep the overload."""
    from torch._ops import OpOverload

    for node in gm.graph.nodes:
        op = node.target
        if op is torch.ops.aten._to_copy.default and set(node.kwargs) <= _TO_KWARGS:
            # no binding of its own: Tensor.to with copy=True is _to_copy (3 us less a call)
            node.target, node.kwargs = torch.Tensor.to, {**node.kwargs, "copy": True}
        elif node.op == "call_function" and isinstance(op, OpOverload) and op.namespace == "aten":
            name = op._schema.name.split("::")[1]
            fn = getattr(torch, name, None) or getattr(torch.Tensor, name, None)
            if fn is not None:
                node.target = fn
    gm.recompile()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (a diverging step is compared too): a replay's check."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
