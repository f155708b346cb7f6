"""A recorded step graph made traceable by ``torch.jit.trace`` (steps_per_call.py's loop body).

The tracer rejects an argument typed ``Optional[List[..]]`` or ``List[Optional[..]]``
("unsupported argument type"): ``convolution_backward``'s ``bias_sizes``, oneDNN's inner
product's ``scalars`` (Caffe's LeNet has both: conv2's input gradient, ip1). A scripted function
making that call, with the literal arguments written in, is kept by the trace as a call, which
``loop_passes.hoist`` inlines: the same op on the same arguments, so the same bits.
"""
from __future__ import annotations

import copy
import functools
import operator

import torch


def _untraceable(schema) -> bool:
    return any(a.type.annotation_str.startswith(("Optional[List[", "List[Optional["))
               for a in schema.arguments)


def _literal(v) -> str | None:
    """``v`` as TorchScript source, or None where it is not a plain literal."""
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else None
    if isinstance(v, (list, tuple)):
        items = [_literal(x) for x in v]
        return None if None in items else "[" + ", ".join(items) + "]"
    return None


@functools.cache
def _scripted_call(op, args: tuple, used: tuple | None):
    """A scripted function of the tensor arguments (``args``: "" for each, else its literal)
    calling ``op`` with the literals in place and returning its outputs ``used`` (None: its one
    output); None where TorchScript cannot compile it. (An output left undefined, as
    convolution_backward's masked ones, cannot leave a traced call: only those read leave.)"""
    schema = op._schema
    params, lines, names = [], [], []
    for i, (a, lit) in enumerate(zip(schema.arguments, args)):
        typ = a.type.annotation_str
        if lit == "":
            params.append(f"a{i}: {typ}")
        else:
            lines.append(f"    a{i}: {typ} = {lit}")
        names.append(f"a{i}")
    rets = [r.type.annotation_str for r in schema.returns]
    ns, name = schema.name.split("::")
    call_src = f"torch.ops.{ns}.{name}({', '.join(names)})"
    if used is None:
        ret, body = rets[0], [f"    return {call_src}"]
    else:
        ret = "Tuple[" + ", ".join(rets[k] for k in used) + "]"
        body = [f"    r = {call_src}", "    return (" + "".join(f"r[{k}], " for k in used) + ")"]
    src = "\n".join([f"def call({', '.join(params)}) -> {ret}:", *lines, *body, ""])
    try:
        scripted = torch.jit.CompilationUnit(src).call
    except RuntimeError:
        return None

    def call(*tensors):              # a Python function: FX's code names its callees
        return scripted(*tensors)

    call.__name__ = call.__qualname__ = f"scripted_{name}"
    return call


def with_scripted_calls(gm):
    """``gm`` (a recorded step graph), or a copy sharing its tensors in which each call of an op
    the tracer cannot record goes through a scripted function instead."""
    def wrapper(n):
        op = n.target
        if (n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or n.kwargs
                or not _untraceable(op._schema) or len(n.args) != len(op._schema.arguments)):
            return None
        used = None
        if len(op._schema.returns) != 1:
            if not all(u.op == "call_function" and u.target is operator.getitem for u in n.users):
                return None
            used = tuple(sorted({u.args[1] for u in n.users}))
        args = tuple("" if isinstance(a, torch.fx.Node) else _literal(a) for a in n.args)
        fn = None if None in args else _scripted_call(op, args, used)
        return None if fn is None else (fn, used)

    found = {n.name: w for n in gm.graph.nodes if (w := wrapper(n)) is not None}
    if not found:
        return gm
    graph = copy.deepcopy(gm.graph)
    for n in graph.nodes:
        if n.name in found:
            fn, used = found[n.name]
            n.target, n.args = fn, tuple(a for a in n.args if isinstance(a, torch.fx.Node))
            for u in list(n.users) if used is not None else ():
                u.args = (n, used.index(u.args[1]))
    return torch.fx.GraphModule(gm, graph)
