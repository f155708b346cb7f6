"""Per-layer shapes, parameter counts and FLOPs of a built Net (``brewnet shapes``).

Each layer says its own FLOPs (``Layer.flops``: a multiply-add counts 2, elementwise layers one
per output element, data and routing layers none); the shapes are the net's own (``Net.shapes``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerRow:
    name: str
    type: str
    tops: list
    params: int
    flops: int


def summarize(net) -> list[LayerRow]:
    rows = []
    for layer, bn, tn in zip(net.layer_list, net.bottom_lists, net.top_lists):
        b = [net.shapes[n] for n in bn]
        t = [net.shapes[n] for n in tn]
        rows.append(LayerRow(layer.name, layer.type, list(zip(tn, t)),
                             sum(x.numel() for x in layer.blobs), layer.flops(b, t) if t else 0))
    return rows


def format_table(net) -> str:
    rows = summarize(net)
    lines = [f"{'layer':<28} {'type':<18} {'top shapes':<42} {'params':>12} {'FLOPs':>16}"]
    for r in rows:
        tops = ", ".join(f"{n} {tuple(s)}" for n, s in r.tops) or "-"
        lines.append(f"{r.name:<28} {r.type:<18} {tops:<42} {r.params:>12,} {r.flops:>16,}")
    lines.append(f"{'total':<28} {'':<18} {'':<42} {sum(r.params for r in rows):>12,} "
                 f"{sum(r.flops for r in rows):>16,}")
    return "\n".join(lines)
