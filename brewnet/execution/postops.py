"""Post-op fusion in the lean inference graph: convolution + activation, residual add (+ ReLU).

What OpenCV's dnn and ONNX Runtime fuse, as PyTorch's own oneDNN ops that inductor uses
(``mkldnn._convolution_pointwise`` and its ``.binary``): the activation, or the add of the other
operand, is applied in the convolution's output pass. Only where the convolution's output has
no other user. The weights go in oneDNN's blocked layout, packed once per graph site and
re-packed when ``_bind`` hands over another tensor or the same one changed (identity,
``_version`` and the numpy views handed out: ``Folder``'s key). Mostly the same bits; oneDNN may
pick another algorithm for the op (a 1x1 1024->1024: 2e-5 off; nets ~5e-7 of scale): tests
allow ``1e-5`` of the scale, as lean.py's kernel choices. PReLU is not fused (the op takes
scalars only). Measured on AVX-512 (no AMX): benchmarks/postops.py.
"""
from __future__ import annotations

import operator

import torch

from .. import blob as _blob
from .recording import recorded_nchw

aten = torch.ops.aten
_MK = getattr(torch.ops, "mkldnn", None)
_UNARY = {aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
          aten.leaky_relu.default: "leaky_relu", aten.clamp.default: "hardtanh",
          aten.hardtanh.default: "hardtanh"}
# ops whose result is a fresh tensor nobody else aliases: the in-place add may write into it
_FRESH = {aten.relu.default, aten.add.Tensor, aten.convolution.default}
if _MK is not None:     # (the in-place one aliases a tensor whose readers all came before it)
    _FRESH |= {_MK._convolution_pointwise.default, _MK._convolution_pointwise.binary,
               _MK._convolution_pointwise_.binary}


def available() -> bool:
    """oneDNN's fused convolution is there (x86 builds; ACL's aarch64 oneDNN left out: unmeasured)."""
    if _MK is None or not torch.backends.mkldnn.is_available():
        return False
    acl = getattr(_MK, "_is_mkldnn_acl_supported", None)
    return not (acl is not None and acl())


def _conv_args(gm, n):
    """(x, w, b, stride, pad, dil, groups) of a plain 2-D float32 convolution reading its weight
    from an attribute, else None."""
    if n.op != "call_function" or n.kwargs:
        return None
    if n.target is aten.convolution.default:
        x, w, b, stride, pad, dil, transposed, out_pad, groups = n.args
        if transposed or any(out_pad):
            return None
    elif n.target is aten.conv2d.default:          # exported graphs
        defaults = [None, [1, 1], [0, 0], [1, 1], 1]
        x, w, b, stride, pad, dil, groups = list(n.args) + defaults[len(n.args) - 2:]
    else:
        return None
    if not isinstance(w, torch.fx.Node) or w.op != "get_attr" or not all(
            isinstance(v, (list, tuple)) and len(v) == 2 for v in (stride, pad, dil)):
        return None
    weight = operator.attrgetter(w.target)(gm)
    out = n.meta.get("val")
    if (not isinstance(x, torch.fx.Node) or weight.dtype != torch.float32 or weight.dim() != 4
            or weight.device.type != "cpu" or not isinstance(out, torch.Tensor)
            or out.dtype != torch.float32):
        return None
    return x, w, b, list(stride), list(pad), list(dil), int(groups)


def _input_size(x, out, weight, stride, pad, dil, groups):
    """A convolution's input size: a placeholder has no recorded value, and its size is taken
    as the smallest that gives ``out``'s (it only steers oneDNN's choice of weight layout; a
    mismatch at run time costs a reorder, never a wrong number). Recorded values carry shapes
    only (recording.py: ``empty`` on meta), so the layout is the graph's, not read here."""
    xv = x.meta.get("val")
    if isinstance(xv, torch.Tensor):
        return list(xv.shape)
    if x.op != "placeholder":
        return None
    hw = [(o - 1) * s + d * (k - 1) + 1 - 2 * p
          for o, s, d, k, p in zip(out.shape[2:], stride, dil, weight.shape[2:], pad)]
    return [out.shape[0], weight.shape[1] * groups, *hw]


def _unary(n):
    """(attr, scalars) of an activation oneDNN applies as a post-op, else None."""
    attr = _UNARY.get(n.target)
    if attr is None or n.kwargs:
        return None
    if attr == "leaky_relu":
        slope = n.args[1] if len(n.args) > 1 else 0.01
        return (attr, [slope]) if isinstance(slope, (int, float)) else None
    if attr == "hardtanh":
        lo, hi = (list(n.args[1:3]) + [-1.0, 1.0][len(n.args) - 1:]) if n.target is aten.hardtanh.default \
            else (list(n.args[1:3]) + [None, None])[:2]
        ok = all(isinstance(v, (int, float)) for v in (lo, hi)) and lo <= hi
        return (attr, [float(lo), float(hi)]) if ok else None
    return (attr, []) if len(n.args) == 1 else None


def _only_user(n):
    return next(iter(n.users)) if len(n.users) == 1 else None


def _pack(w, padding, stride, dilation, groups, input_size, blocked, channels_last):
    w = w.detach()
    if blocked:     # oneDNN's own blocked layout for this input size: no reorder per call
        return _MK._reorder_convolution_weight(w, padding, stride, dilation, groups, input_size)
    # the activations' layout (oneDNN reorders an NCHW weight on every call)
    return w.contiguous(memory_format=torch.channels_last) if channels_last else w.contiguous()


def make_packer(channels_last: bool):
    """The graph's weight-packing function, with its cache: one entry per site (so a rebound
    weight replaces, never piles up), hit only for the very tensor (``is``, held: its id cannot
    be reused), at the same version, with no numpy view of a parameter handed out since."""
    cache: dict = {}

    def packed_weight(w, site, padding, stride, dilation, groups, input_size, blocked):
        key = (_blob.param_views(), w._version)
        hit = cache.get(site)
        if hit is not None and hit[1] is w and hit[0] == key:
            return hit[2]
        p = _pack(w, padding, stride, dilation, groups, input_size, blocked, channels_last)
        cache[site] = (key, w, p)
        return p

    return packed_weight


def fuse_postops(gm: torch.fx.GraphModule, channels_last: bool = True, *, unary: bool = True,
                 binary: bool = True, inplace: bool = True, lone: bool = False,
                 blocked: bool = True) -> int:
    """Rewrite ``gm`` (before ``unbox``: aten overloads) in place; returns the convolutions
    rewritten. ``unary``: conv + activation; ``binary``: conv + add (+ ReLU), ``inplace`` into
    the other operand when nothing reads it later; ``lone``: other convolutions too, for their
    packed weights (off: no steady gain, MobileNetV2 ~5% slower at batch 1); ``blocked``:
    oneDNN's blocked weights, else NHWC copies (switches for benchmarks/postops.py)."""
    if not available():
        return 0
    g = gm.graph
    packer = make_packer(channels_last)
    sizes: dict = {}         # the convolutions to rewrite: their input sizes
    done = 0

    def packable(conv) -> bool:
        # an input of unknown size, or a pack refused (it raises), stays plain
        x, w, b, stride, pad, dil, groups = _conv_args(gm, conv)
        if channels_last and recorded_nchw(conv):   # an NCHW input: NHWC weights change its layout
            return False
        weight = operator.attrgetter(w.target)(gm)
        size = _input_size(x, conv.meta["val"], weight, stride, pad, dil, groups)
        if size is None or len(size) != 4:
            return False
        try:
            _pack(weight, pad, stride, dil, groups, size, blocked, channels_last)
        except RuntimeError:
            return False
        sizes[conv] = size
        return True

    def replace(conv, last, target, make_args):
        # args read now: an earlier rewrite may have replaced the conv's input
        nonlocal done
        x, w, b, stride, pad, dil, groups = _conv_args(gm, conv)
        with g.inserting_before(last):
            pw = g.call_function(packer, (w, conv.name, pad, stride, dil, groups,
                                          sizes.pop(conv), blocked))
            m = g.call_function(target, make_args(x, pw, b, pad, stride, dil, groups))
        m.meta = dict(last.meta)
        last.replace_all_uses_with(m)
        while last is not conv:         # the chain conv -> ... -> last, each its one user
            prev = conv if conv in last.args else last.args[0]
            g.erase_node(last)
            last = prev
        g.erase_node(conv)
        done += 1

    for n in g.nodes:
        if _conv_args(gm, n) is not None:
            packable(n)

    if binary:
        for add in list(g.nodes):
            if (add.op != "call_function" or add.target is not aten.add.Tensor
                    or add.kwargs not in ({}, {"alpha": 1}) or len(add.args) != 2 or add.args[0] is add.args[1]
                    or not isinstance(add.meta.get("val"), torch.Tensor)):
                continue
            order = {n: i for i, n in enumerate(g.nodes)}
            cands = [(c, o) for c, o in (add.args, add.args[::-1])
                     if c in sizes and _only_user(c) is add and isinstance(o, torch.fx.Node)]
            if not cands:
                continue
            conv, other = max(cands, key=lambda c: order[c[0]])   # the later conv: other is ready
            ov, cv = other.meta.get("val"), conv.meta["val"]
            # (no layout check: recorded values have none; oneDNN takes either, measured exact)
            if not isinstance(ov, torch.Tensor) or ov.shape != cv.shape or ov.dtype != cv.dtype:
                continue
            relu = _only_user(add)
            last = relu if relu is not None and relu.target is aten.relu.default \
                and relu.args == (add,) else add
            post = ("relu", [], "") if last is relu else (None, [], "")
            # in place into ``other`` only when it owns its memory, nothing reads it after the
            # add, none of its readers returns a view of it, and the conv does not read it
            free = (inplace and other.op == "call_function" and other.target in _FRESH
                    and conv.args[0] is not other
                    and all(u is add or (order[u] < order[add] and u.target in _FRESH)
                            for u in other.users))
            if free:
                target = _MK._convolution_pointwise_.binary
                mk = lambda x, pw, *a, o=other, p=post: (o, x, pw, *a, "add", 1.0, *p)  # noqa: E731
            else:
                target = _MK._convolution_pointwise.binary
                mk = lambda x, pw, *a, o=other, p=post: (x, o, pw, *a, "add", 1.0, *p)  # noqa: E731
            replace(conv, last, target, mk)
    for conv in list(sizes):
        act = _only_user(conv) if unary else None
        post = _unary(act) if act is not None and act.args[0] is conv else None
        if post is None and not lone:
            continue
        attr, scalars = post if post is not None else ("none", [])
        replace(conv, act if post is not None else conv, _MK._convolution_pointwise.default,
                lambda x, pw, *a, t=attr, s=scalars: (x, pw, *a, t, s, ""))
    g.lint()
    gm.recompile()
    return done
