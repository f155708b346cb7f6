"""The fused net: K nets of one architecture run as one net of wide operators (HFTA's fusion).

A value of the fused net is held in one of four layouts (``Val.kind``): ``shared`` (N, ...), what
every net sees alike (the data tops, read once); ``chan`` (N, K*C, H, W), net k's channels at
[k*C, (k+1)*C); ``stack`` (K, N, D), per-net matrices stacked (InnerProduct: one ``baddbmm``);
``list``, K tensors (each net's own loss layer on its slice of the stacked scores, so its
normalisation is exactly the net's alone). ``exact=True`` runs Convolution and InnerProduct per
net on its own slice with its own kernel (``EXACT``): every net's sums are the ones it does alone.
Parameters are stacked per learnable index, (K, *shape), and each net's own layers re-pointed at
views of them (``stack_params``): its snapshot, test net and ``.net`` read the fused values without
copies. A layer type without a wide form is refused (``FuseError``).
How each layout computes, and the measurements: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blob import for_layers, nhwc
from ..errors import NetError
from ..execution import determinism
from ..execution.threads import TINY_FLOPS
from ..layers import functional as Fn
from ..layers.loss import FLT_MIN, _WeightedLogLoss, check_labels, normalizer
from ..proto import caffe_pb2 as pb


class FuseError(NetError):
    """Nets that cannot be fused; the message names the first layer (and field) that differs,
    or the layer whose type has no fused form."""


@dataclass
class Val:
    kind: str            # "shared" | "chan" | "stack" | "list"
    t: object            # a tensor, or a list of K tensors for "list"
    stacked: object = None   # "list" of K 0-D values: the (K,) tensor they are views of

    def net(self, k: int, c: int | None = None):
        """Net k's own tensor (``c``: its channel count, for ``chan``)."""
        if self.kind == "shared":
            return self.t
        if self.kind == "chan":
            return self.t[:, k * c:(k + 1) * c]
        return self.t[k]


# -- which nets fuse ---------------------------------------------------------------------------
_VARIED = ("weight_filler", "bias_filler", "filler")   # what a sweep may change in a layer


def _normalised(lp) -> "pb.LayerParameter":
    """The layer without what may differ between fused nets: fillers, lr_mult, decay_mult."""
    lp = pb.LayerParameter.FromString(lp.SerializeToString())
    for spec in lp.param:
        spec.ClearField("lr_mult")
        spec.ClearField("decay_mult")
    for fd, value in lp.ListFields():
        if fd.type == fd.TYPE_MESSAGE and not fd.is_repeated:
            for name in _VARIED:
                if name in value.DESCRIPTOR.fields_by_name:
                    value.ClearField(name)
    del lp.blobs[:]
    return lp


def _first_field(a, b, prefix: str = "") -> str:
    """The dotted path of the first field where messages ``a`` and ``b`` differ, with values."""
    fields = {fd.name: fd for fd, _ in a.ListFields()} | {fd.name: fd for fd, _ in b.ListFields()}
    for fd in sorted(fields.values(), key=lambda f: f.number):
        va, vb = getattr(a, fd.name), getattr(b, fd.name)
        if va == vb:
            continue
        path = prefix + fd.name
        if fd.type == fd.TYPE_MESSAGE and not fd.is_repeated:
            return _first_field(va, vb, path + ".")
        if fd.is_repeated:
            va, vb = list(va), list(vb)
            if fd.type == fd.TYPE_MESSAGE and len(va) == len(vb):
                j = next(i for i, (x, y) in enumerate(zip(va, vb)) if x != y)
                return _first_field(va[j], vb[j], f"{path}[{j}].")
        return f"{path} ({_show(va)} vs {_show(vb)})"
    return prefix.rstrip(".") or "(unknown field)"


def _show(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return repr(v) if isinstance(v, str) else str(v).replace("\n", " ").strip()


def check_same_architecture(nets, labels) -> None:
    """Raise FuseError naming the first layer that differs between net 0 and another net."""
    ref = nets[0].param.layer
    for k, net in enumerate(nets[1:], 1):
        mine = net.param.layer
        for i in range(max(len(ref), len(mine))):
            if i >= len(ref) or i >= len(mine):
                extra = (mine if i >= len(ref) else ref)[i]
                raise FuseError(f"cannot fuse {labels[0]} and {labels[k]}: layer #{i} "
                                f"'{extra.name}' (type {extra.type}) is in only one of them "
                                f"({len(ref)} vs {len(mine)} layers)")
            a, b = _normalised(ref[i]), _normalised(mine[i])
            if a != b:
                raise FuseError(f"cannot fuse {labels[0]} and {labels[k]}: layer #{i} "
                                f"'{ref[i].name}' (type {ref[i].type}) differs in "
                                f"{_first_field(a, b)}")


# -- wide operators, keyed by Caffe's type -----------------------------------------------------
def _member_input(x: "Val", j: int, c: int) -> torch.Tensor:
    """Net j's own input, laid out as it is alone: the shared tensor itself, or its channel
    slice made dense in the wide tensor's memory format (what the lone net's layer produced)."""
    if x.kind == "shared":
        return x.t
    fmt = torch.channels_last if (x.t.dim() == 4 and not x.t.is_contiguous()
                                  and x.t.is_contiguous(memory_format=torch.channels_last)) \
        else torch.contiguous_format
    return x.t[:, j * c:(j + 1) * c].contiguous(memory_format=fmt)


def _conv(fn, layer, ins, params, k):
    x = ins[0]
    if layer.axis != 1 or x.kind not in ("shared", "chan") or len(ins) != 1:
        raise FuseError(f"layer '{layer.name}' (Convolution): only one bottom with channels on "
                        f"axis 1 fuses (got {len(ins)} bottom(s), axis {layer.axis})")
    w = params[0]                                           # (K, O, C/g, *kernel)
    if fn == EXACT:    # each net's own convolution: the kernel and sum order it runs alone
        c = w.shape[2] * layer.group
        bias = params[1] if layer.bias_term else None
        ys = [Fn.conv_nd(_member_input(x, j, c), w[j], None if bias is None else bias[j],
                         layer.stride, layer.pad, layer.dilation, layer.group) for j in range(k)]
        return [Val("chan", torch.cat(ys, 1))]
    b = params[1].reshape(-1) if layer.bias_term else None  # (K*O,)
    t = x.t
    if t.device.type == "cpu" and t.dim() == 4:   # oneDNN's grouped kernels are faster in NHWC
        t = nhwc(t)
    if x.kind == "shared" and layer.group > 1:              # each net's groups on its own copy
        t = t.repeat(1, k, *([1] * (t.dim() - 2)))
    groups = layer.group if x.kind == "shared" and layer.group == 1 else layer.group * k
    y = Fn.conv_nd(t, w.reshape(-1, *w.shape[2:]), b, layer.stride, layer.pad, layer.dilation,
                   groups)
    return [Val("chan", y)]


def _inner_product(fn, layer, ins, params, k):
    x = ins[0]
    if layer.axis != 1:
        raise FuseError(f"layer '{layer.name}' (InnerProduct): only axis 1 fuses, got {layer.axis}")
    w = params[0]                                   # (K, O, D), or (K, D, O) with transpose
    b = params[1] if len(params) > 1 else None                    # (K, O)
    if fn == EXACT:    # each net's own product (BLAS or oneDNN, as alone)
        if x.kind == "chan":
            c = x.t.shape[1] // k
            xs = [_member_input(x, j, c).reshape(x.t.shape[0], -1) for j in range(k)]
        elif x.kind == "shared":
            xs = [x.t.reshape(x.t.shape[0], -1)] * k
        else:
            xs = [x.t[j].reshape(x.t.shape[1], -1) for j in range(k)]
        return [Val("stack", torch.stack([Fn.inner_product(xj, w[j], None if b is None else b[j],
                                                           layer.transpose)
                                          for j, xj in enumerate(xs)]))]
    wt = w if layer.transpose else w.transpose(1, 2)              # (K, D, O)
    if x.kind == "shared":                          # one GEMM with the K matrices side by side
        x2 = x.t.reshape(x.t.shape[0], -1)
        wcat = wt.permute(1, 0, 2).reshape(wt.shape[1], -1)       # (D, K*O)
        y = x2 @ wcat if b is None else torch.addmm(b.reshape(-1), x2, wcat)
        return [Val("stack", y.view(x2.shape[0], k, -1).transpose(0, 1))]
    if x.kind == "chan":
        n = x.t.shape[0]
        xs = x.t.reshape(n, k, -1).transpose(0, 1)                # (K, N, D)
    else:
        xs = x.t.reshape(k, x.t.shape[1], -1)
    return [Val("stack", _WideProduct.apply(xs, wt, b))]


class _WideProduct(torch.autograd.Function):
    """K nets' InnerProducts as batched products, (K, N, D) x (K, D, O) + (K, O): forward and
    backward with MKL on torch's threads when large (a training thread keeps MKL on one,
    brewnet/execution/determinism.py; why: docs/internals.md, *Design notes by module*)."""

    @staticmethod
    def forward(ctx, xs, wt, b):
        ctx.save_for_backward(xs, wt)
        ctx.has_bias = b is not None
        ctx.large = 2 * xs.numel() * wt.shape[-1] >= TINY_FLOPS
        with determinism.blas_on_torch_threads(ctx.large):
            return torch.bmm(xs, wt) if b is None else torch.baddbmm(b.unsqueeze(1), xs, wt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        xs, wt = ctx.saved_tensors
        dx = dw = db = None
        with determinism.blas_on_torch_threads(ctx.large):
            if ctx.needs_input_grad[0]:
                dx = torch.bmm(dy, wt.transpose(1, 2))
            if ctx.needs_input_grad[1]:
                dw = torch.bmm(xs.transpose(1, 2), dy)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(1)
        return dx, dw, db


EXACT = "exact"    # the arg of Convolution/InnerProduct in an exact FusedNet: per-net kernels


def _same_layout(fn, layer, ins, params, k):
    """Layers that work on each element or channel alike: run the net's own layer on the
    stacked tensor (K results in one call)."""
    x = ins[0]
    if x.kind == "list":
        outs = [layer.forward([t]) for t in x.t]
        return [Val("list", [o[j] for o in outs]) for j in range(len(outs[0]))]
    if fn == "chan" and x.kind == "stack":
        raise FuseError(f"layer '{layer.name}' ({layer.type}) needs (N, C, H, W) features")
    return [Val(x.kind, y) for y in layer.forward([x.t])]


def _lrn(fn, layer, ins, params, k):
    x = ins[0]
    if x.kind != "chan" or layer.region != pb.LRNParameter.ACROSS_CHANNELS:
        return _same_layout("chan", layer, ins, params, k)
    n, kc, h, w = x.t.shape                        # windows must not reach a neighbour net
    y = layer.forward([x.t.reshape(n * k, kc // k, h, w)])[0]
    return [Val("chan", y.reshape(n, kc, h, w))]


def _per_net(fn, layer, ins, params, k, channels=None):
    """Each net's own layer on its slice (losses, accuracies)."""
    outs = [layer.forward([v.net(j, c) for v, c in zip(ins, channels)]) for j in range(k)]
    return [Val("list", [o[i] for o in outs]) for i in range(len(outs[0]))]


def _softmax_loss(fn, layer, ins, params, k, channels=None):
    """SoftmaxWithLoss: one wide pass for stacked 2-D scores, shared labels, no ignore_label
    and one top (per-net losses sum in another order than alone: float32 rounding, as the rest
    of the fused net); anything else each net's own layer."""
    x, label = ins
    if (x.kind != "stack" or x.t.dim() != 3 or label.kind != "shared" or layer.ignore is not None
            or layer.num_tops != 1 or layer.param.softmax_param.axis not in (1, -1)):
        return _per_net(fn, layer, ins, params, k, channels)
    n, c = x.t.shape[1], x.t.shape[2]
    check_labels(layer, label.t, c)
    lab = label.t.detach().reshape(1, n, 1).long().expand(k, n, 1)
    losses = _WeightedLogLoss.apply(x.t, lab, None, None, FLT_MIN, normalizer(layer.mode, n, 1),
                                    2, True)
    return [Val("list", list(losses.unbind(0)), losses)]


WIDE = {
    "Convolution": (_conv, None),
    "InnerProduct": (_inner_product, None),
    "Pooling": (_same_layout, "chan"),
    "LRN": (_lrn, None),
    "ReLU": (_same_layout, None),
    "Sigmoid": (_same_layout, None),
    "TanH": (_same_layout, None),
    "Dropout": (_same_layout, None),
    "SoftmaxWithLoss": (_softmax_loss, None),
    "Softmax": (_per_net, None),
    "Accuracy": (_per_net, None),
    "EuclideanLoss": (_per_net, None),
}


def _is_source(layer) -> bool:
    return layer.exact_bottoms == 0 and layer.routing and layer.type != "Input"


def _share_position(leader, others) -> None:
    """The others' data layers stand where the leader's does (their snapshots' data cursors say
    so, as alone); each keeps its own RNG state, which a shared stream never moves."""
    state = getattr(leader, "consumed_state", None)
    if state is None:
        return
    for layer in others:
        own = getattr(layer, "consumed_state", None) or {}
        layer.consumed_state = {**state, **{k: v for k, v in own.items() if k == "rng"}}


class FusedNet:
    """K train nets of one architecture as one net of wide operators.

    ``FusedNet(nets, labels)``: ``nets`` built alone (their own fillers and seeds), in the order
    to stack them; ``labels`` name them in errors. Net 0's data layer feeds all K, or
    ``source``'s (a net of the same architecture: the one that read so far, when a net leaves
    and the rest are fused again). ``params``:
    the stacked learnable tensors (learnable order); ``forward()`` returns (the summed weighted
    loss to backpropagate, each net's loss (K,), each net's outputs {name: K tensors})."""

    def __init__(self, nets, labels, exact: bool = False, source=None):
        check_same_architecture(nets, labels)
        self.nets, self.k, self.exact = nets, len(nets), exact
        self.source = source if source is not None else nets[0]
        ref = nets[0]
        for layer in ref.layer_list:
            if not _is_source(layer) and layer.type not in WIDE:
                raise FuseError(f"layer '{layer.name}' of type {layer.type} has no fused form "
                                f"(fused: data layers, {', '.join(sorted(WIDE))})")
        self.channels = {n: (s[1] if len(s) > 1 else None) for n, s in ref.shapes.items()}
        for net in (n for n in nets if n is not self.source):   # one data stream: the others
            for layer in net.layer_list:                         # stop reading ahead
                if getattr(layer, "prefetcher", None) is not None:
                    layer.prefetcher.close()
                    layer.prefetcher = None       # (a forward of that net alone still reads)
        self.params, self.layer_params = stack_params(nets)

    def forward(self):
        ref, k = self.nets[0], self.k
        vals: dict[str, Val] = {}
        for i, layer in enumerate(ref.layer_list):
            if _is_source(layer):
                reader, cl = self.source.layer_list[i], self.source._channels_last
                tops = [Val("shared", for_layers(t, cl)) for t in reader.forward([])]
                _share_position(reader, [net.layer_list[i] for net in self.nets if net is not self.source])
            else:
                fn, arg = WIDE[layer.type]
                if self.exact and layer.type in ("Convolution", "InnerProduct"):
                    arg = EXACT
                ins = [vals[b] for b in ref.bottom_lists[i]]
                if not all(ref.propagate_down[i]):
                    ins = [v if p else _detached(v) for v, p in zip(ins, ref.propagate_down[i])]
                params = [self.params[j] for j in self.layer_params[i]]
                if fn in (_per_net, _softmax_loss):
                    tops = fn(arg, layer, ins, params, k, [self.channels[b] for b in ref.bottom_lists[i]])
                else:
                    tops = fn(arg, layer, ins, params, k)
            vals.update(zip(ref.top_lists[i], tops))
        total = torch.zeros((), device=ref.device)
        losses = torch.zeros(k, device=ref.device)
        for name, w in ref._loss_weights.items():
            if vals[name].stacked is not None:        # the wide loss: K losses in one tensor
                total = total + w * vals[name].stacked.sum()
                losses += w * vals[name].stacked.detach()
                continue
            per = [vals[name].net(j, self.channels[name]) for j in range(k)]
            total = total + w * sum(t.sum() for t in per)
            losses += w * torch.stack([t.detach().sum() for t in per])
        outputs = {n: [vals[n].net(j, self.channels[n]).detach() for j in range(k)]
                   for n in ref.outputs}
        return total, losses, outputs


def _detached(v: Val) -> Val:
    return Val(v.kind, [t.detach() for t in v.t] if v.kind == "list" else v.t.detach())


def stack_params(nets):
    """Stack each learnable param of ``nets`` into one (K, *shape) leaf and point every net's
    layers (and learnable list) at its row, a view: the nets read the fused values in place.
    Returns the stacked leaves and, per layer, the learnable indices of its blobs."""
    ref = nets[0]
    owners = [{id(t): i for i, t in enumerate(n.learnable)} for n in nets]
    for n, own in zip(nets, owners):
        for layer in n.layer_list:
            for j, b in enumerate(layer.blobs):
                if id(b) not in own:
                    raise FuseError(f"layer '{layer.name}' blob {j} is a reshaped view of a shared "
                                    "param (PERMISSIVE sharing); it does not fuse")
    stacked = []
    for i in range(len(ref.learnable)):
        rows = [n.learnable[i].detach() for n in nets]
        grad = any(n.learnable[i].requires_grad for n in nets)
        stacked.append(torch.stack(rows).requires_grad_(grad))
    layer_params = [[owners[0][id(b)] for b in layer.blobs] for layer in ref.layer_list]
    for k, (n, own) in enumerate(zip(nets, owners)):
        views = [s.detach()[k] for s in stacked]
        for layer in n.layer_list:
            layer.blobs = [views[own[id(b)]] for b in layer.blobs]
        n.learnable_params.tensors[:] = views
    return stacked, layer_params
