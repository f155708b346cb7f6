"""Merge independent nets into one NetParameter over one copy of their data (nideep's
``merge_indep_net_spec``), so one solver trains them side by side.

nideep's rules: a layer whose type contains "Data" and not "Output" is a data layer; the data
layers are kept once, from the first net, and the tops they produce keep their names (shared by
every net); every other layer name, top and bottom gets ``_nidx_%02d`` (the net's index); the
text keeps net 0's ``name:``. The nets' losses add up, but no gradient crosses from one net to
another, so a step of the merged net is the step of each net alone.
"""
from __future__ import annotations

import os

from google.protobuf import text_format

from ..proto import caffe_pb2 as pb
from ..proto.io import read_net
from ..proto.upgrade import upgrade_net

SUFFIX = "_nidx_%02d"


class MergeError(ValueError):
    """Nets that cannot be merged onto one data copy; the message names both nets and the field."""


def is_data_layer(layer_type: str) -> bool:
    """nideep's ``is_singular_layer_type``: kept once and shared ("Data" in the type, not "Output")."""
    t = layer_type.lower()
    return "data" in t and "output" not in t


def suffix_fmt_idx(idx: int) -> str:
    return SUFFIX % idx


def first_difference(a, b, path: str = ""):
    """The first field (a dotted path, ``[i]`` for repeated entries) where messages ``a`` and
    ``b`` differ, with both values; None when they are equal."""
    for fd in a.DESCRIPTOR.fields:
        name = f"{path}.{fd.name}" if path else fd.name
        va, vb = getattr(a, fd.name), getattr(b, fd.name)
        if fd.is_repeated:
            for i in range(max(len(va), len(vb))):
                if i >= len(va) or i >= len(vb):
                    return (f"{name}[{i}]", va[i] if i < len(va) else "(none)",
                            vb[i] if i < len(vb) else "(none)")
                d = (first_difference(va[i], vb[i], f"{name}[{i}]") if fd.message_type
                     else None if va[i] == vb[i] else (f"{name}[{i}]", va[i], vb[i]))
                if d:
                    return d
        elif fd.message_type:
            if a.HasField(fd.name) or b.HasField(fd.name):
                d = first_difference(va, vb, name)
                if d:
                    return d
        elif va != vb:
            return name, va, vb
    return None


def show(value) -> str:
    if hasattr(value, "DESCRIPTOR"):
        return "{ " + text_format.MessageToString(value, as_one_line=True) + " }"
    return repr(value)


def _message(net) -> "pb.NetParameter":
    """Our NetParameter (upgraded) from ours, another module's (the real caffe_pb2) or a path."""
    if isinstance(net, (str, os.PathLike)):
        return read_net(net)
    if not isinstance(net, pb.NetParameter):
        net = pb.NetParameter.FromString(net.SerializeToString())
    return upgrade_net(net)


def _data_definition(layer) -> "pb.LayerParameter":
    """What decides the batches a data layer makes: all but its name."""
    d = pb.LayerParameter()
    d.CopyFrom(layer)
    d.ClearField("name")
    return d


def _check_shared(nets, names) -> None:
    """Net j's data layers must be net 0's, field for field (their tops are shared)."""
    ref = [l for l in nets[0].layer if is_data_layer(l.type)]
    for j in range(1, len(nets)):
        mine = [l for l in nets[j].layer if is_data_layer(l.type)]
        if len(mine) != len(ref):
            raise MergeError(f"{names[0]} has {len(ref)} data layer(s), {names[j]} has {len(mine)}: "
                             "merged nets read one copy of the same data")
        for a, b in zip(ref, mine):
            d = first_difference(_data_definition(a), _data_definition(b))
            if d:
                raise MergeError(
                    f"data layer '{a.name}' of {names[0]} and '{b.name}' of {names[j]} differ in "
                    f"{d[0]} ({show(d[1])} vs {show(d[2])}): one data copy cannot feed both")
    for j in range(1, len(nets)):
        d = first_difference(_net_level(nets[0]), _net_level(nets[j]))
        if d:
            raise MergeError(f"{names[0]} and {names[j]} differ in the net's own {d[0]} "
                             f"({show(d[1])} vs {show(d[2])}); the merged net has one")


def _net_level(net) -> "pb.NetParameter":
    n = pb.NetParameter()
    n.CopyFrom(net)
    for f in ("name", "layer", "layers"):
        n.ClearField(f)
    return n


def merge_nets(nets, suffix_fmt=suffix_fmt_idx, names=None) -> "pb.NetParameter":
    """One NetParameter running ``nets`` (paths, prototxt text or NetParameter messages) side by
    side over net 0's data layers; the inputs are not modified.

    Beyond nideep: ``param { name }`` of shared weights gets the suffix too, so sharing stays
    inside one net (nideep leaves those names alone, so identically named params leak across
    nets); a layer of net j writing a shared data top (in place on ``data``) writes a copy of its
    own from there on (in nideep it changes the data every net sees); nets whose data layers
    differ are refused (``MergeError`` naming both nets and the first field that differs) rather
    than silently fed net 0's data."""
    msgs = [_message(n) for n in nets]
    if not msgs:
        raise MergeError("merge needs at least one net")
    names = names or [f"net {i} ('{m.name}')" if m.name else f"net {i}" for i, m in enumerate(msgs)]
    _check_shared(msgs, names)
    data_tops = {t for m in msgs for l in m.layer if is_data_layer(l.type) for t in l.top}
    out = pb.NetParameter()
    out.CopyFrom(msgs[0])
    del out.layer[:]
    for idx, m in enumerate(msgs):
        suffix = suffix_fmt(idx)
        shared = set(data_tops)           # names that still mean the shared data in this net
        for l in m.layer:
            if is_data_layer(l.type):
                if idx == 0:
                    out.layer.add().CopyFrom(l)
                continue
            n = out.layer.add()
            n.CopyFrom(l)
            n.name += suffix
            n.bottom[:] = [b if b in shared else b + suffix for b in l.bottom]
            shared -= set(l.top)
            n.top[:] = [t + suffix for t in l.top]
            for p in n.param:
                if p.name:
                    p.name += suffix
    return out


def merge_indep_net_spec(net_specs, suffix_fmt=suffix_fmt_idx) -> str:
    """nideep's ``merge_indep_net_spec``: the prototxt text of ``merge_nets(net_specs)`` (a list
    of NetParameter messages). Differs from nideep: the inputs are left unmodified, and see
    ``merge_nets`` for param names, in-place layers on data tops and differing data layers."""
    return text_format.MessageToString(merge_nets(net_specs, suffix_fmt))
