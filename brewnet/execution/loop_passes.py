"""Passes over the scripted K-iteration loop of steps_per_call.py: fewer interpreter
instructions and ops an iteration, every aten kernel an iteration runs unchanged.

``hoist`` inlines the traced body into the loop, takes each staged input's batch with one
select, moves the loop-invariant nodes (constants, the argument lists' unpacking, int lists,
views of the params) before the loop, and runs the ops that read only the batches once on all
K batches (each iteration selecting its own): casts, reshapes, comparisons, ``where``, a loss's
one-hot labels (``zeros_like`` + ``scatter_``), a mask's count and arithmetic on it, the rates'
selects. Also: a traced float64
scalar as float32 (its cast), ``[..][i]`` as the item, a staged top selected after the loop.
Nothing that reads a list or a batch written inside the loop moves; a node it cannot rewrite
stays. The loop's first call is checked bit for bit against single steps (a loop with these
batching passes that differs is rebuilt without them).
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


def hoist(graph, batch: bool = True) -> int:
    """Inline the body into ``graph``'s loop, select each input's batch directly, and move the
    loop's invariant nodes before it (the interpreter then runs fewer instructions per
    iteration; every aten kernel the iterations run is unchanged), and with ``batch`` the
    batches' own ops run on all K (_batch_data_ops): how many moved."""
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
    if not batch:
        return moved
    return (moved + _batch_data_ops(graph, loop, block, selects) + _float_scalars(graph, loop, block)
            + _list_items(block) + _last_only(graph, loop, block))


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
    """Nodes that read only the staged batches (an iteration's select of them), what other
    batched nodes made and invariants run once on all K batches before the loop, each iteration
    selecting its batch of the result: dtype casts, reshapes, comparisons, ``where``, and a loss's
    one-hot labels (``zeros_like`` of a tensor of fixed shape, then ``scatter_`` of the labels).
    Each batched kernel computes every element as the iteration's would (elementwise, exact, or a
    move); a node whose input is written in place in the loop stays. How many ops moved."""
    if not selects:
        return 0
    zero, k = selects[0].inputsAt(1), selects[0].inputsAt(2)
    inside = {v.unique() for v in block.inputs()}
    inside |= {v.unique() for n in block.nodes() for v in n.outputs()}
    selects += [n for n in block.nodes() if n.kind() == "aten::select" and n not in selects
                and n.inputsAt(0).unique() not in inside and n.inputsAt(2).unique() == k.unique()
                and n.inputsAt(1).toIValue() == 0]          # the rates' row: rates[k]
    whole = {s.output().unique(): s.inputsAt(0) for s in selects}   # an iteration's -> all K
    fresh: set = set()              # batched zeros that only their iteration's select reads
    staged = sum(_bytes(s.output().type()) or 0 for s in selects)
    budget = [4 * staged]           # bytes an iteration the batched results may add (4x staged)
    written = _written(block)
    counts: set = set()             # batched values of 0s and 1s (a cast of a mask)
    moved = 0
    for n in list(block.nodes()):
        try:
            b = _batched_node(graph, loop, n, whole, fresh, inside, written, budget, counts)
        except (RuntimeError, TypeError, ValueError):    # a schema or type it cannot rewrite
            b = None
        if b is None:
            continue
        one = graph.create("aten::select", [b.output(), zero, k], 1)
        one.insertBefore(n)
        one.output().setType(n.output().type())
        if n.output().unique() in written:     # an iteration writes its batch: nothing reads it
            written.add(one.output().unique())
        if n.output().unique() in counts:
            counts.add(one.output().unique())
        n.output().replaceAllUsesWith(one.output())
        whole[one.output().unique()] = b.output()
        if b.kind() == "aten::zeros":
            fresh.add(one.output().unique())
        n.destroy()
        moved += 1
    for n in reversed(list(block.nodes())):       # the selects nothing reads any more
        if n.kind() == "aten::select" and not n.output().uses():
            n.destroy()
    return moved


def _list_items(block) -> int:
    """``[a, b, ...][i]`` (an item at a constant index of a list made in the loop and never
    written) as the item itself: the loss appended each iteration. How many."""
    done = 0
    for n in list(block.nodes()):
        if n.kind() != "aten::__getitem__":
            continue
        lst, i = n.inputsAt(0), n.inputsAt(1).toIValue()
        make = lst.node()
        if (make.kind() == "prim::ListConstruct" and make.owningBlock() == block
                and isinstance(i, int) and -make.inputsSize() <= i < make.inputsSize()
                and not any(u.user.kind() in _LIST_WRITES for u in lst.uses())):
            n.output().replaceAllUsesWith(make.inputsAt(i))
            n.destroy()
            done += 1
    return done


def _last_only(graph, loop, block) -> int:
    """An iteration's select of a tensor made before the loop that only the loop-carried list
    of outputs reads (a staged top): the list holds the whole tensor in the loop, and the last
    iteration's select is put in its place after it (the loop runs at least one iteration).
    How many."""
    ret, done = block.returnNode(), 0
    for c in range(loop.outputsSize()):
        make = ret.inputsAt(1 + c).node()
        if (make.kind() != "prim::ListConstruct" or make.owningBlock() != block
                or len(make.output().uses()) != 1 or loop.outputsAt(c).type().kind() != "ListType"):
            continue
        for j, v in enumerate(make.inputs()):
            sel = v.node()
            index = sel.inputsAt(2).node() if sel.kind() == "aten::select" else None
            if (index is None or sel.owningBlock() != block or index.kind() != "aten::__derive_index"
                    or sel.inputsAt(0).node().owningBlock() != loop.owningBlock()
                    or index.inputsAt(0).unique() != next(block.inputs()).unique()
                    or sel.inputsAt(1).toIValue() != 0 or any(u.user != make for u in v.uses())):
                continue
            make.replaceInput(j, sel.inputsAt(0))
            one = _constant(graph, loop, 1)
            last = graph.create("aten::sub", [loop.inputsAt(0), one], 1)
            last.output().setType(torch._C.IntType.get())
            k = graph.create("aten::__derive_index", [last.output(), *list(index.inputs())[1:]], 1)
            k.output().setType(torch._C.IntType.get())
            item = graph.create("aten::select", [sel.inputsAt(0), sel.inputsAt(1), k.output()], 1)
            item.output().setType(v.type())
            put = graph.create("aten::_set_item", [loop.outputsAt(c), _constant(graph, loop, j),
                                                   item.output()], 1)
            put.output().setType(loop.outputsAt(c).type())
            for n in reversed((last, k, item, put)):
                n.insertAfter(loop)
            if not v.uses():
                sel.destroy()
            done += 1
    return done


def _float_scalars(graph, loop, block) -> int:
    """A traced Python number (a wrapped float64 0-dim constant: a loss's ``/ batch``) in
    arithmetic on float32 tensors with a float32 result, as a float32 0-dim constant made before
    the loop: the kernel converted it to float32 first at every iteration (a cast op), now once.
    How many."""
    done = 0
    for n in list(block.nodes()):
        if n.kind() not in ("aten::div", "aten::mul", "aten::add", "aten::sub") or n.inputsSize() < 2:
            continue
        for i in (0, 1):
            c, other = n.inputsAt(i), n.inputsAt(1 - i)
            if (c.node().kind() != "prim::Constant" or c.type().kind() != "TensorType"
                    or getattr(other.type(), "dtype", lambda: None)() != torch.float32
                    or getattr(n.output().type(), "dtype", lambda: None)() != torch.float32):
                continue
            t = c.node().t("value") if c.node().kindOf("value") == "t" else None
            if t is not None and t.dtype == torch.float64 and t.dim() == 0:
                n.replaceInput(i, _constant(graph, loop, t.float()))
                if not c.uses():
                    c.node().destroy()
                done += 1
    return done


_ELEMENTWISE = {"aten::ne", "aten::eq", "aten::lt", "aten::le", "aten::gt", "aten::ge",
                "aten::where", "aten::logical_not", "aten::clamp_min", "aten::clamp_max"}   # exact
_ARITHMETIC = {"aten::div", "aten::mul", "aten::add", "aten::sub"}   # IEEE: correctly rounded


def _batched_node(graph, loop, n, whole, fresh, inside, written, budget, counts):
    """``n``'s batched form, inserted before the loop (None: ``n`` stays in the loop)."""
    if n.outputsSize() != 1 or list(n.blocks()) or n.inputsSize() == 0:
        return None
    ins = list(n.inputs())
    batched = [v.unique() in whole for v in ins]
    kind = n.kind()
    if kind == "aten::zeros_like":      # its values depend on the input's (fixed) shape alone
        return _zeros(graph, loop, n, whole, inside, budget)
    if any(v.unique() in inside and not b for v, b in zip(ins, batched)):
        return None
    if kind in _ARITHMETIC and any(batched):
        return _arithmetic(graph, loop, n, ins, whole, written)
    if not batched[0]:
        return None
    if kind == "aten::scatter_":
        return _scatter(graph, loop, n, whole, fresh, written)
    if any(v.unique() in written for v in ins):          # read after a write: stays
        return None
    out_bytes = _bytes(n.output().type())
    if kind == "aten::to" and len(ins) == 5 and str(ins[1].type()) == "int":
        args = ins[1:]                                    # to(dtype, non_blocking, copy, format)
        if _dtype(ins[0]) == torch.bool:
            counts.add(n.output().unique())               # 0s and 1s
    elif (kind == "aten::sum" and len(ins) == 2 and ins[1].toIValue() is None
          and ins[0].unique() in counts and _shape(ins[0]) and _numel(ins[0]) < 1 << 24):
        # a count of 0s and 1s: exact in any order, so per batch as over the whole batch
        dims = graph.create("prim::ListConstruct", [_constant(graph, loop, d + 1)
                                                    for d in range(len(_shape(ins[0])))], 1)
        dims.output().setType(torch._C.ListType(torch._C.IntType.get()))
        dims.insertBefore(loop)
        args = [dims.output(), _constant(graph, loop, False), ins[1]]
    elif (kind == "aten::select" and isinstance(ins[1].toIValue(), int) and ins[1].toIValue() >= 0
          and isinstance(ins[2].toIValue(), int)):         # a rate of the rates' row
        args, out_bytes = [_constant(graph, loop, ins[1].toIValue() + 1), ins[2]], 0
    elif kind in ("aten::view", "aten::reshape") and _constant_sizes(ins[1]):
        kind, args, out_bytes = "aten::reshape", [_batched_size(graph, loop, ins[1])], 0
    elif (kind in _ELEMENTWISE and all(str(v.type()) in ("int", "float", "bool")
                                       for v, b in zip(ins, batched) if not b)
          and len({_shape(v) for v, b in zip(ins, batched) if b} - {None}) == 1
          and all(_shape(v) is not None for v, b in zip(ins, batched) if b)):
        args = ins[1:]                 # every tensor batched, of one shape: no broadcasting
    else:
        return None
    if (out_bytes or 0) > budget[0] or (out_bytes is None and kind != "aten::to"):
        return None                # a cast of unknown shape: at most 8x a staged batch's bytes
    budget[0] -= out_bytes or 0
    b = graph.create(kind, [whole[v.unique()] if v.unique() in whole else v
                            for v in [ins[0], *args]], 1)
    b.insertBefore(loop)
    b.output().setType(torch._C.TensorType.get())
    return b


def _arithmetic(graph, loop, n, ins, whole, written):
    """``a op b`` of batched tensors of one shape and loop-invariant 0-dim tensors, all of the
    result's dtype (no promotion; an invariant broadcast over the K), scalars as they are."""
    out = _dtype(n.output())
    if n.kind() == "aten::div" and len(ins) != 2:          # a rounding mode: left alone
        return None
    shapes = set()
    for v in ins:
        if v.type().kind() != "TensorType":
            if str(v.type()) not in ("int", "float"):
                return None
        elif v.unique() in whole:
            if v.unique() in written or _dtype(v) != out or _shape(v) is None:
                return None
            shapes.add(_shape(v))
        elif _dtype(v) != out or _shape(v) != ():
            return None
    if len(shapes) != 1 or out is None:
        return None
    b = graph.create(n.kind(), [whole.get(v.unique(), v) for v in ins], 1)
    b.insertBefore(loop)
    b.output().setType(torch._C.TensorType.get())
    return b


def _dtype(v):
    return getattr(v.type(), "dtype", lambda: None)()


def _numel(v) -> int:
    count = 1
    for d in _shape(v):
        count *= d
    return count


def _zeros(graph, loop, n, whole, inside, budget):
    """``zeros_like(x)`` of an x of fixed contiguous shape (default options, unpinned) as zeros of
    (K, *shape) made before the loop: one fresh batch of zeros an iteration, as before."""
    x, *opts = n.inputs()
    t = x.type()
    size, dtype = _shape(x), getattr(t, "dtype", lambda: None)()
    if (size is None or dtype is None or any(v.unique() in inside for v in opts)
            or list(t.strides()) != _contiguous(size) or str(t.device()) != "cpu"
            or any(v.node().kind() != "prim::Constant" or v.toIValue() not in (None, False)
                   for v in opts)
            or (_bytes(t) or 0) > budget[0]):
        return None
    budget[0] -= _bytes(t)
    first = next(iter(whole.values()))
    count = graph.create("aten::size", [first, _constant(graph, loop, 0)], 1)
    count.insertBefore(loop)
    count.output().setType(torch._C.IntType.get())
    dims = [count.output(), *[_constant(graph, loop, d) for d in size]]
    shape = graph.create("prim::ListConstruct", dims, 1)
    shape.output().setType(torch._C.ListType(torch._C.IntType.get()))
    shape.insertBefore(loop)
    none = _constant(graph, loop, None)
    b = graph.create("aten::zeros", [shape.output(), _constant(graph, loop, dtype), none, none,
                                     none], 1)
    b.insertBefore(loop)
    b.output().setType(torch._C.TensorType.get())
    return b


def _scatter(graph, loop, n, whole, fresh, written):
    """``scatter_(self, dim, index, value)`` into an iteration's fresh batched zeros, with a
    batched index, as one scatter_ on all K (dim one further in)."""
    me, dim, index, value = n.inputs() if n.inputsSize() == 4 else (None,) * 4
    if (me is None or me.unique() not in fresh or len(me.uses()) != 1
            or index.unique() not in whole or index.unique() in written
            or str(value.type()) not in ("int", "float") or dim.node().kind() != "prim::Constant"
            or _shape(me) is None):
        return None
    d = dim.toIValue()
    d = d + len(_shape(me)) if d < 0 else d
    b = graph.create("aten::scatter_", [whole[me.unique()], _constant(graph, loop, d + 1),
                                        whole[index.unique()], value], 1)
    b.insertBefore(loop)
    b.output().setType(torch._C.TensorType.get())
    return b


_VIEWS = {"aten::view", "aten::reshape", "aten::select", "aten::slice", "aten::t",
          "aten::transpose", "aten::permute", "aten::unsqueeze", "aten::squeeze",
          "aten::expand", "aten::as_strided", "aten::alias", "aten::detach", "aten::flatten"}


def _written(block) -> set:
    """The loop's values an in-place op writes, and what they view (back through view ops)."""
    out, todo = set(), [n.inputsAt(0) for n in block.nodes()
                        if n.kind().endswith("_") and not n.kind().endswith("__")
                        and n.inputsSize()]
    while todo:
        v = todo.pop()
        if v.unique() not in out:
            out.add(v.unique())
            if v.node().kind() in _VIEWS and v.node().inputsSize():
                todo.append(v.node().inputsAt(0))
    return out


def _shape(v):
    sizes = getattr(v.type(), "sizes", lambda: None)()
    return tuple(sizes) if sizes is not None and None not in sizes else None


def _contiguous(size) -> list:
    strides, step = [], 1
    for d in reversed(size):
        strides.insert(0, step)
        step *= max(d, 1)
    return strides


def _bytes(t):
    """An iteration's bytes of a tensor type of known shape and dtype (None: unknown)."""
    sizes = getattr(t, "sizes", lambda: None)()
    dtype = getattr(t, "dtype", lambda: None)()
    if sizes is None or None in sizes or dtype is None:
        return None
    count = 1
    for d in sizes:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


def _constant(graph, loop, value):
    c = graph.insertConstant(value)
    c.node().moveBefore(loop)
    return c


def _constant_sizes(size) -> bool:
    """``size`` is a list of int constants without -1."""
    node = size.node()
    return node.kind() == "prim::ListConstruct" and all(
        v.node().kind() == "prim::Constant" and v.node().i("value") != -1 for v in node.inputs())


def _batched_size(graph, loop, size):
    """``size`` (a list of int constants without -1) with -1 in front, made before the loop;
    None where it is not such a list."""
    node = size.node()
    if not _constant_sizes(size):
        return None
    first = graph.create("prim::Constant", [], 1)
    first.i_("value", -1)
    first.output().setType(torch._C.IntType.get())
    first.insertBefore(loop)
    out = graph.create("prim::ListConstruct", [first.output(), *node.inputs()], 1)
    out.output().setType(torch._C.ListType(torch._C.IntType.get()))
    out.insertBefore(loop)
    return out.output()
