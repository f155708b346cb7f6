"""PriorBox layouts of the SSD forks that make more priors per cell than SSD, and no field of
theirs says so: TextBoxes (MhLiao/TextBoxes: every prior twice, the copy half a cell lower) and
FaceBoxes (sfzhang15/FaceBoxes: min_size 32 and 64 densified). Their deploy prototxts read as
SSD's; the net's loc branch says which layout it was trained with.

``prior_counts`` is the number of priors per cell each fork's ``LayerSetUp`` allocates (and its
``Forward_cpu`` writes; FaceBoxes' may differ, see ``faceboxes_written``); ``upgrade_prior_box_layouts``
sets ``prior_box_param.layout`` on a PriorBox whose prototxt names none, where the convolution
feeding the matching loc input of a DetectionOutput or MultiBoxLoss predicts exactly the
TextBoxes or FaceBoxes count and not SSD's (brewnet's reading, logged; ``upgrade-net`` writes it).
TextBoxes++ (MhLiao/TextBoxes_plusplus) names its layout: ``denser_prior_boxes: true``.
"""
from __future__ import annotations

import logging

from . import caffe_pb2 as pb

log = logging.getLogger("brewnet")
L = pb.PriorBoxParameter
__all__ = ["aspect_ratios", "prior_counts", "faceboxes_written", "needs_prior_box_layout_upgrade",
           "upgrade_prior_box_layouts"]


def aspect_ratios(p) -> list[float]:
    """1, then each new ratio (and 1/r with flip), duplicates (within 1e-6) dropped: the forks'
    LayerSetUp, all alike."""
    import numpy as np

    ratios = [np.float32(1.0)]
    for ar in p.aspect_ratio:
        if all(abs(ar - r) >= 1e-6 for r in ratios):
            ratios.append(np.float32(ar))
            if p.flip:
                ratios.append(np.float32(1.0 / ar))
    return ratios


def faceboxes_written(p) -> int:
    """Priors a cell FaceBoxes' Forward_cpu writes: 16 for min_size 32, 4 for 64, else 1; one
    per max_size; one per aspect ratio != 1, for each min_size."""
    n = 0
    for mn in p.min_size:
        n += {32: 16, 64: 4}.get(int(mn), 1) + (1 if p.max_size else 0) + len(aspect_ratios(p)) - 1
    return n


def prior_counts(p, layout: int | None = None) -> int:
    """Priors per cell for ``layout`` (default: the param's own), as the fork's LayerSetUp
    counts them (FaceBoxes: 21 for three min_sizes, whatever they are)."""
    layout = p.layout if layout is None else layout
    n = len(aspect_ratios(p)) * len(p.min_size)
    if layout == L.FACEBOXES and len(p.min_size) == 3:
        n = 21
    n += len(p.max_size)
    if layout == L.TEXTBOXES or (layout == L.SSD and p.denser_prior_boxes):
        n *= 2
    return n


_PASS = {"Flatten", "Permute", "Reshape"}


def _plan(net) -> list[tuple[str, int, int]]:
    """(PriorBox layer name, index, layout) for each PriorBox to set."""
    layers = list(net.layer)

    def producer(blob, before):
        for i in range(before - 1, -1, -1):
            if blob in layers[i].top:
                return i
        return None

    def parts(blob, before):
        i = producer(blob, before)
        if i is not None and layers[i].type == "Concat":
            return [(b, i) for b in layers[i].bottom]
        return [(blob, before)]

    def loc_conv(blob, before):
        i = producer(blob, before)
        while i is not None and layers[i].type in _PASS and len(layers[i].bottom) == 1:
            i = producer(layers[i].bottom[0], i)
        return layers[i] if i is not None and layers[i].type == "Convolution" else None

    plan = {}
    for k, lp in enumerate(layers):
        if lp.type == "DetectionOutput":
            q, share = lp.detection_output_param, lp.detection_output_param.share_location
        elif lp.type == "MultiBoxLoss":
            q, share = lp.multibox_loss_param, lp.multibox_loss_param.share_location
        else:
            continue
        if len(lp.bottom) < 3:
            continue
        locs, priors = parts(lp.bottom[0], k), parts(lp.bottom[2], k)
        if len(locs) != len(priors):
            continue
        per_box = 4 * (1 if share else max(q.num_classes, 1))
        pairs = []                      # (PriorBox index, loc conv, boxes a cell it predicts)
        for (loc, lk), (pri, pk) in zip(locs, priors):
            j = producer(pri, pk)
            conv = loc_conv(loc, lk)
            if (j is None or layers[j].type != "PriorBox" or conv is None
                    or conv.convolution_param.num_output % per_box):
                break
            p = layers[j].prior_box_param
            if p.HasField("layout") or p.denser_prior_boxes or not p.min_size:
                break
            pairs.append((j, conv.name, conv.convolution_param.num_output // per_box))
        else:
            # one layout for the whole head: FaceBoxes' 256 and 512 priors count as SSD's but
            # are (size - 1) wide; TextBoxes doubles every one
            counts = [(layers[j].prior_box_param, want) for j, _, want in pairs]
            if all(want == prior_counts(p, L.SSD) for p, want in counts):
                continue
            for layout in (L.TEXTBOXES, L.FACEBOXES):
                if all(want == prior_counts(p, layout) and (
                        layout != L.FACEBOXES or want == faceboxes_written(p)) for p, want in counts):
                    for j, conv, want in pairs:
                        plan[layers[j].name] = (j, layout, conv, want)
                    break
    return [(name, *v) for name, v in plan.items()]


def needs_prior_box_layout_upgrade(net) -> bool:
    return any(lp.type == "PriorBox" for lp in net.layer) and bool(_plan(net))


def upgrade_prior_box_layouts(net, source: str = "<net>") -> None:
    """Set ``layout`` on each PriorBox whose loc branch predicts the TextBoxes or FaceBoxes
    number of boxes a cell, not SSD's (see the module's doc)."""
    if not any(lp.type == "PriorBox" for lp in net.layer):
        return
    for name, j, layout, conv, want in _plan(net):
        p = net.layer[j].prior_box_param
        log.info("%s: PriorBox '%s' read as %s's layout: its head's loc convolutions predict "
                 "that fork's boxes a cell ('%s': %d, SSD's priors: %d)", source, name,
                 {L.TEXTBOXES: "TextBoxes", L.FACEBOXES: "FaceBoxes"}[layout], conv, want,
                 prior_counts(p, L.SSD))
        p.layout = layout
