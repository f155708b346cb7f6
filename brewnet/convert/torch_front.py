"""torch.export's ATen graph as a ``Graph``: each call's arguments bound by name, parameters and
buffers as constants, ``getitem`` of a multi-output op as that op's outputs, the module path
and the model's source line kept for layer names and error messages."""
from __future__ import annotations

import operator

import numpy as np
import torch

from .graph import Graph, Node, _flat, source_line

# ops that pass their input through at inference (dropout in eval, layout and alias ops)
IDENTITY = {"dropout", "feature_dropout", "alpha_dropout", "contiguous", "clone", "alias", "detach",
            "lift_fresh_copy", "_assert_tensor_metadata", "to", "_to_copy", "type_as"}
RENAME = {"_native_batch_norm_legit_no_training": "batch_norm", "view": "reshape",
          "_unsafe_view": "reshape", "expand_as": "expand", "relu_": "relu", "hardtanh_": "hardtanh",
          "add_": "add", "mul_": "mul", "silu_": "silu", "hardswish_": "hardswish",
          "hardsigmoid_": "hardsigmoid", "convolution": "conv2d", "_softmax": "softmax",
          "addmm": "addmm", "max_pool2d_with_indices": "max_pool2d", "mean": "mean",
          "upsample_nearest2d": "upsample_nearest2d", "upsample_bilinear2d": "upsample_bilinear2d",
          "conv_transpose2d": "conv_transpose2d", "rsub": "rsub", "true_divide": "div",
          "leaky_relu_": "leaky_relu", "clamp_min": "clamp", "clamp_max": "clamp"}


def export(module: torch.nn.Module, example_inputs: tuple):
    module = module.eval()
    with torch.no_grad():
        return torch.export.export(module, tuple(example_inputs), strict=False)


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))          # "conv2d.default"
    base = name.split(".")[0]
    if base.endswith("_") and not base.startswith("_"):      # in-place variants (relu_, dropout_)
        base = base[:-1]
    return RENAME.get(base, base)


def _bind(node) -> dict:
    """The call's arguments by schema name (defaults filled in)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {f"arg{i}": a for i, a in enumerate(node.args)}
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def _value(a):
    """An fx argument as a value name (str), a list of them, or a python constant."""
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return [_value(x) for x in a]
    if isinstance(a, torch.dtype | torch.device | torch.memory_format | torch.layout):
        return str(a)
    return a


def _path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # "L['self'].layer1.0" or "layer1.0" depending on torch's version
    return path.split("L['self'].")[-1].replace("._modules['", ".").replace("']", "")


def to_graph(ep) -> Graph:
    """A ``Graph`` of ``ep`` (an ExportedProgram)."""
    sig = ep.graph_signature
    state = {**ep.state_dict, **ep.constants}
    consts, inputs, shapes = {}, [], {}
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.target is not None and spec.target in state:
            t = state[spec.target]
            consts[name] = t.detach().cpu().float().numpy() if t.is_floating_point() \
                else t.detach().cpu().numpy()
        elif spec.kind.name == "USER_INPUT":
            inputs.append(name)
    nodes, alias = [], {}
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            shapes[n.name] = tuple(int(d) for d in val.shape)
        if n.op == "placeholder" or n.op == "output":
            continue
        if n.op == "get_attr":
            consts[n.name] = getattr(ep.graph_module, n.target).detach().float().numpy()
            continue
        if n.target is operator.getitem:
            src, i = n.args
            alias[n.name] = f"{alias.get(src.name, src.name)}#{i}"
            shapes[alias[n.name]] = shapes.get(n.name)
            continue
        tensor_args = [a for a in n.all_input_nodes]
        if all(a.name in consts for a in tensor_args) and n.target is not operator.getitem \
                and isinstance(val, torch.Tensor):      # made from constants only: fold it
            env = {a.name: torch.as_tensor(consts[a.name]) for a in tensor_args}
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a.name])
            consts[n.name] = n.target(*args, **kwargs).detach().float().numpy()
            continue
        op = _op_name(n.target)
        args = {k: _value(v) for k, v in _bind(n).items()}
        if isinstance(val, (list, tuple)):
            outs = [f"{n.name}#{i}" for i in range(len(val))]
            for o, v in zip(outs, val):
                if isinstance(v, torch.Tensor):
                    shapes[o] = tuple(int(d) for d in v.shape)
            if op in ("batch_norm", "max_pool2d"):      # one real output
                outs = [n.name] + outs[1:]
                shapes[n.name] = shapes.get(f"{n.name}#0")
                alias[f"{n.name}#0"] = n.name
        else:
            outs = [n.name]
        nodes.append(Node(op="identity" if op in IDENTITY else op, ins=[], attrs=args, outs=outs,
                          path=_path(n), source=source_line(n.meta.get("stack_trace")),
                          target=str(n.target)))
    # value arguments by alias (getitem -> "node#i"); tensor arguments listed in ``ins``
    for node in nodes:
        for k, v in node.attrs.items():
            node.attrs[k] = _resolve(v, alias)
        node.ins = [v for v in _flat(list(node.attrs.values())) if isinstance(v, str) and v in shapes]
        if node.op == "transpose":
            rank = len(shapes[node.ins[0]])
            dims = list(range(rank))
            a, b = node.attrs["dim0"] % rank, node.attrs["dim1"] % rank
            dims[a], dims[b] = dims[b], dims[a]
            node.op, node.attrs = "permute", {"self": node.attrs["self"], "dims": dims}
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs = [_resolve(_value(a), alias) for a in out_node.args[0]]
    for v in list(consts):
        shapes[v] = tuple(consts[v].shape)
    return Graph(inputs=inputs, outputs=outputs, nodes=nodes, shapes=shapes, consts=consts)


def _resolve(v, alias):
    if isinstance(v, str):
        while v in alias:
            v = alias[v]
        return v
    if isinstance(v, list):
        return [_resolve(x, alias) for x in v]
    return v


def reference(ep, example_inputs) -> dict:
    """Every node's value on the example inputs (the PyTorch side of the proof)."""
    gm = ep.module()
    values = {}

    class _Rec(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                values[n.name] = out.detach().float().numpy()
            elif isinstance(out, (list, tuple)):
                for i, t in enumerate(out):
                    if isinstance(t, torch.Tensor):
                        values[f"{n.name}#{i}"] = t.detach().float().numpy()
            return out

    with torch.no_grad():
        _Rec(gm).run(*example_inputs)
    return {k: np.asarray(v) for k, v in values.items()}
