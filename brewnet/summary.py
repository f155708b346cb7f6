"""Per-layer shapes, parameter counts and FLOPs of a built Net (``brewnet shapes``).

FLOPs count a multiply-add as 2 for one forward pass; layers without a formula here count one
FLOP per output element (elementwise work), data/routing layers count 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layers.base import count

ROUTING = {"Input", "Split", "Concat", "Slice", "Flatten", "Reshape", "Crop", "Silence",
           "Parameter", "DummyData", "MemoryData", "Permute", "Filter", "BatchReindex", "Tile"}


def layer_flops(layer, bottoms, tops) -> int:
    t = layer.type
    if t in ROUTING or not tops:
        return 0
    if t in ("Convolution", "Deconvolution"):
        w = layer.blobs[0].shape          # conv: (out, in/g, k...); deconv: (in, out/g, k...)
        spatial = tops[0] if t == "Convolution" else bottoms[0]
        macs = count(w) * count(spatial[2:]) * spatial[0]
        return 2 * macs + (count(tops[0]) if len(layer.blobs) > 1 else 0)
    if t == "InnerProduct":
        return 2 * count(layer.blobs[0].shape) * count(tops[0]) // layer.param.inner_product_param.num_output
    if t == "Pooling":
        p = layer.param.pooling_param
        k = (bottoms[0][2] * bottoms[0][3]) if p.global_pooling else (
            (p.kernel_h or p.kernel_size) * (p.kernel_w or p.kernel_size))
        return count(tops[0]) * k
    if t == "LRN":
        return count(tops[0]) * (layer.param.lrn_param.local_size + 3)
    return sum(count(s) for s in tops)


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
        b = [net._shapes[n] for n in bn]
        t = [net._shapes[n] for n in tn]
        rows.append(LayerRow(layer.name, layer.type, list(zip(tn, t)),
                             sum(x.numel() for x in layer.blobs), layer_flops(layer, b, t)))
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
