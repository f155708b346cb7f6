"""Per-layer shapes, receptive fields, parameter counts and FLOPs of a built Net (``brewnet shapes``).

Each layer says its own FLOPs (``Layer.flops``: a multiply-add counts 2, elementwise layers one
per output element, data and routing layers none); the shapes are the net's own (``Net.shapes``);
receptive fields come from ``geometry`` (size /stride @start on the input, in pixels).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .geometry import describe, layer_fields


@dataclass
class LayerRow:
    name: str
    type: str
    tops: list
    params: int
    flops: int
    fields: list = field(default_factory=list)


def summarize(net) -> list[LayerRow]:
    rows = []
    for layer, bn, tn, fields in zip(net.layer_list, net.bottom_lists, net.top_lists, layer_fields(net)):
        b = [net.shapes[n] for n in bn]
        t = [net.shapes[n] for n in tn]
        rows.append(LayerRow(layer.name, layer.type, list(zip(tn, t)),
                             sum(x.numel() for x in layer.blobs), layer.flops(b, t) if t else 0,
                             [describe(fields[n]) for n in tn]))
    return rows


def format_table(net) -> str:
    rows = summarize(net)
    lines = [f"{'layer':<28} {'type':<18} {'top shapes':<42} {'receptive field':<18} "
             f"{'params':>12} {'FLOPs':>16}"]
    for r in rows:
        tops = ", ".join(f"{n} {tuple(s)}" for n, s in r.tops) or "-"
        fields = ", ".join(dict.fromkeys(r.fields)) or "-"
        lines.append(f"{r.name:<28} {r.type:<18} {tops:<42} {fields:<18} {r.params:>12,} {r.flops:>16,}")
    lines.append(f"{'total':<28} {'':<18} {'':<42} {'':<18} {sum(r.params for r in rows):>12,} "
                 f"{sum(r.flops for r in rows):>16,}")
    return "\n".join(lines)
