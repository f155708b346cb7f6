"""Passes over the scripted K-iteration loop of steps_per_call.py: fewer interpreter
instructions and ops an iteration, every aten kernel an iteration runs unchanged.

``hoist`` inlines the traced body into the loop, takes each staged input's batch with one
select, moves the loop-invariant nodes (constants, the argument lists' unpacking, int lists,
views of the params) before the loop, and runs the dtype casts and reshapes of a batch once on
all K batches (each iteration selecting its own). Nothing that reads a list or a batch written
inside the loop moves. The loop's first call is still checked bit for bit against single steps.
"""
from __future__ import annotations

import torch

# Loop-invariant nodes that yield the same value at every iteration however the params change in
# place: constants, module attributes, unpacking the argument lists, int lists, views of tensors.
_INVARIANT = {"prim::Constant", "prim::GetAttr", "prim::ListUnpack", "aten::t", "aten::view",
              "aten::transpose", "aten::permute", "aten::unsqueeze", "aten::squeeze",
              "aten::expand", "aten::select", "aten::slice", "aten::detach", "aten::alias"}
_LIST_WRITES = ("aten::append", "aten::insert", "aten::_set_item", "aten::extend", "aten::clear",
                "aten::pop", "aten::remove")


def hoist(graph) -> int:
    """Inline the body into ``graph``'s loop, select each input's batch directly, and move the
    loop's invariant nodes before it (the interpreter then runs fewer instructions per
    iteration; every aten kernel the iterations run is unchanged): how many moved."""
    torch._C._jit_pass_inline(graph)
    loop = next((n for n in graph.nodes() if n.kind() == "prim::Loop"), None)
    if loop is None:
        return 0
    block = list(loop.blocks())[0]
    selects = _direct_selects(graph, loop, block)
    inside = {v.unique() for v in block.inputs()}
    inside |= {v.unique() for n in block.nodes() for v in n.outputs()}
    moved = 0
    for n in list(block.nodes()):
        kind = n.kind()
        lists = [v for v in [*n.inputs(), *n.outputs()] if v.type().kind() == "ListType"]
        ok = ((kind in _INVARIANT or (kind == "prim::ListConstruct" and _scalar_list(n.output())))
              and not any(u.user.kind() in _LIST_WRITES for v in lists for u in v.uses()))
        if ok and not list(n.blocks()) and not any(v.unique() in inside for v in n.inputs()):
            n.moveBefore(loop)
            inside -= {v.unique() for v in n.outputs()}
            moved += 1
    return moved + _batch_data_ops(graph, loop, block, selects)


def _scalar_list(v) -> bool:
    t = v.type()
    return t.kind() == "ListType" and str(t.getElementType()) in ("int", "float", "bool")


def _direct_selects(graph, loop, block) -> list:
    """_Loop's ``[x[k] for x in xs]`` (an inner loop appending x.select(0, k) to a fresh list
    that the body unpacks) as xs unpacked once before the loop and one select per x: those
    selects."""
    made = [n for n in block.nodes() if n.kind() == "prim::ListConstruct" and n.inputsSize() == 0]
    for lst in made:
        users = [u.user for u in lst.output().uses()]
        unpack = next((u for u in users if u.kind() == "prim::ListUnpack"), None)
        append = next((u for u in users if u.kind() == "aten::append"), None)
        if len(users) != 2 or unpack is None or append is None:
            continue
        inner, sel = append.owningBlock().owningNode(), append.inputsAt(1).node()
        get = sel.inputsAt(0).node()
        if (inner.kind() != "prim::Loop" or sel.kind() != "aten::select"
                or get.kind() != "aten::__getitem__" or inner.owningBlock() != block):
            continue
        body = list(inner.blocks())[0]
        local = {v.unique() for v in body.inputs()}
        local |= {v.unique() for n in body.nodes() for v in n.outputs()}
        if any(sel.inputsAt(i).unique() in local for i in (1, 2)):   # dim and k from outside
            continue
        count = inner.inputsAt(0).node()                      # aten::len(xs)
        xs = graph.create("prim::ListUnpack", [get.inputsAt(0)], unpack.outputsSize())
        xs.insertBefore(loop)
        made = []
        for i, out in enumerate(unpack.outputs()):
            xs.outputsAt(i).setType(torch._C.TensorType.get())
            one = graph.create("aten::select", [xs.outputsAt(i), sel.inputsAt(1), sel.inputsAt(2)], 1)
            one.insertBefore(unpack)
            one.output().setType(out.type())
            out.replaceAllUsesWith(one.output())
            made.append(one)
        unpack.destroy()
        inner.destroy()
        lst.destroy()
        if not count.output().uses():
            count.destroy()
        return made
    return []


def _batch_data_ops(graph, loop, block, selects) -> int:
    """Dtype casts and reshapes of a staged input's batch (a chain from its select) run once
    on all K batches before the loop, each iteration selecting its batch of the result: the
    same values (a cast is elementwise, a reshape moves nothing), fewer ops an iteration (a
    label's view, cast to long, view). How many ops moved."""
    if not selects:
        return 0
    zero, k = selects[0].inputsAt(1), selects[0].inputsAt(2)
    whole = {s.output().unique(): s.inputsAt(0) for s in selects}   # an iteration's -> all K
    inside = {v.unique() for v in block.inputs()}
    inside |= {v.unique() for n in block.nodes() for v in n.outputs()}
    moved = 0
    for n in list(block.nodes()):
        if n.inputsSize() == 0 or n.inputsAt(0).unique() not in whole:
            continue
        rest = list(n.inputs())[1:]
        written = any(u.user.kind().endswith("_") and not u.user.kind().endswith("__")
                      for u in n.inputsAt(0).uses())      # then read after a write: stays
        if written or any(v.unique() in inside for v in rest):
            continue
        if n.kind() == "aten::to" and len(rest) == 4 and str(rest[0].type()) == "int":
            kind, args = "aten::to", rest                    # to(dtype, non_blocking, copy, format)
        elif n.kind() in ("aten::view", "aten::reshape") and _batched_size(graph, loop, rest[0]):
            kind, args = "aten::reshape", [_batched_size(graph, loop, rest[0])]
        else:
            continue
        b = graph.create(kind, [whole[n.inputsAt(0).unique()], *args], 1)
        b.insertBefore(loop)
        b.output().setType(torch._C.TensorType.get())
        one = graph.create("aten::select", [b.output(), zero, k], 1)
        one.insertBefore(n)
        one.output().setType(n.output().type())
        n.output().replaceAllUsesWith(one.output())
        whole[one.output().unique()] = b.output()
        n.destroy()
        moved += 1
    for n in reversed(list(block.nodes())):       # the selects nothing reads any more
        if n.kind() == "aten::select" and not n.output().uses():
            n.destroy()
    return moved


def _batched_size(graph, loop, size):
    """``size`` (a list of int constants without -1) with -1 in front, made before the loop;
    None where it is not such a list."""
    node = size.node()
    if node.kind() != "prim::ListConstruct" or not all(
            v.node().kind() == "prim::Constant" and v.node().i("value") != -1 for v in node.inputs()):
        return None
    first = graph.create("prim::Constant", [], 1)
    first.i_("value", -1)
    first.output().setType(torch._C.IntType.get())
    first.insertBefore(loop)
    out = graph.create("prim::ListConstruct", [first.output(), *node.inputs()], 1)
    out.output().setType(torch._C.ListType(torch._C.IntType.get()))
    out.insertBefore(loop)
    return out.output()
