"""FX pass over the step graph's recorded forward-backward (brewnet/execution/recorded_step.py):
splitting off the tops nothing in the step needs."""
from __future__ import annotations

import torch


def _base(node, memo):
    """The node whose memory ``node`` views (itself if it is not a view op)."""
    if node not in memo:
        schema = getattr(node.target, "_schema", None)
        ret = schema.returns[0].alias_info if schema is not None and schema.returns else None
        view = node.op == "call_function" and ret is not None and not ret.is_write
        memo[node] = _base(node.args[0], memo) if view else node
    return memo[node]


def _writes(node):
    """The argument nodes an op writes into (in-place and out= ops)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    return [a for a, arg in zip(node.args, schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.fx.Node)]


def split_side_tops(gm, n_tops: int):
    """(core graph, side graph, side top names) when some tops feed neither the loss nor a
    gradient and can be computed later from values the core outputs; None otherwise (a side
    value that reads a param, or memory some op writes, must be computed in the step)."""
    from torch.fx import Graph, GraphModule

    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    loss, tops, grads = outs[0], outs[1:1 + n_tops], outs[1 + n_tops:]

    def ancestors(roots):
        seen, todo = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += n.all_input_nodes
        return seen

    core = ancestors([loss, *grads])
    side_idx = [i for i, t in enumerate(tops) if t not in core]
    if not side_idx:
        return None
    core |= ancestors([t for i, t in enumerate(tops) if i not in side_idx])
    side = ancestors([tops[i] for i in side_idx]) - core
    if any(n.op == "get_attr" for n in side):
        return None
    cut = [n for n in graph.nodes if n in core and any(u in side for u in n.users)]
    if any(n.op == "get_attr" for n in cut):
        return None
    memo: dict = {}
    cut_bases = {_base(n, memo) for n in cut}
    written = {_base(a, memo) for n in graph.nodes if n.op != "output" for a in _writes(n)}
    if cut_bases & written:
        return None
    core_g, env = Graph(), {}
    for n in graph.nodes:
        if n in core:
            env[n] = core_g.node_copy(n, lambda a: env[a])
    keep = [t for i, t in enumerate(tops) if i not in side_idx]
    core_g.output(tuple(env[x] for x in [loss, *keep, *grads, *cut]))
    side_g, senv = Graph(), {}
    for n in cut:
        senv[n] = side_g.placeholder(n.name)
    for n in graph.nodes:
        if n in side:
            senv[n] = side_g.node_copy(n, lambda a: senv[a])
    side_g.output(tuple(senv[tops[i]] for i in side_idx))
    return (GraphModule(gm, core_g), GraphModule(gm, side_g), side_idx)
