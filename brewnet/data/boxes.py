"""SSD's annotation geometry and crop sampler (weiliu89/caffe ``util/sampler.cpp``,
``util/bbox_util.cpp``, ``DataTransformer::TransformAnnotation``), on numpy float32 as the fork
keeps boxes in float protobuf fields.

An image's boxes are an ``Annos``: ``box`` (n, 4) [xmin, ymin, xmax, ymax] normalised to the
image, and per box its group label, instance id and difficult flag, in the record's order
(group by group), which is the order of the label top's rows. Random draws come from a numpy
Generator: ``uniform(a, b)`` is caffe_rng_uniform's [a, b).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..proto import caffe_pb2 as pb

f32 = np.float32
UNIT = np.array([0, 0, 1, 1], f32)


@dataclass
class Annos:
    box: np.ndarray          # (n, 4) float32
    label: np.ndarray        # (n,) int: the AnnotationGroup's group_label
    instance: np.ndarray     # (n,) int
    difficult: np.ndarray    # (n,) bool

    @classmethod
    def of(cls, anno_datum) -> "Annos":
        rows = [(g.group_label, a.instance_id, a.bbox.xmin, a.bbox.ymin, a.bbox.xmax, a.bbox.ymax,
                 a.bbox.difficult) for g in anno_datum.annotation_group for a in g.annotation]
        r = np.array(rows, np.float64).reshape(-1, 7)
        return cls(r[:, 2:6].astype(f32), r[:, 0].astype(np.int64), r[:, 1].astype(np.int64),
                   r[:, 6].astype(bool))

    def keep(self, mask: np.ndarray, box: np.ndarray) -> "Annos":
        return Annos(box[mask], self.label[mask], self.instance[mask], self.difficult[mask])

    def __len__(self) -> int:
        return len(self.box)


def size(b: np.ndarray) -> np.ndarray:
    """BBoxSize (normalised): w * h, 0 for an inverted box. (numpy: the sampler calls these
    for a few boxes thousands of times a batch, where a torch call costs more than the math.)"""
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    return np.where((w < 0) | (h < 0), f32(0), w * h).astype(f32)


def clip(b: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(b, f32), f32(0), f32(1))


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IntersectBBox of box ``a`` (4,) with boxes ``b`` (n, 4) -> (n, 4), or of each of boxes
    ``a`` (m, 4) with each of ``b`` -> (m, n, 4): zeros where they do not meet."""
    a = a[..., None, :] if a.ndim == 2 else a
    apart = ((b[:, 0] > a[..., 2]) | (b[:, 2] < a[..., 0]) | (b[:, 1] > a[..., 3])
             | (b[:, 3] < a[..., 1]))
    out = np.concatenate(np.broadcast_arrays(np.maximum(a[..., :2], b[:, :2]),
                                             np.minimum(a[..., 2:], b[:, 2:])), -1)
    out[apart] = 0
    return out


def jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """JaccardOverlap of box ``a`` (4,) with each of ``b`` (n, 4) -> (n,); of each of boxes
    ``a`` (m, 4) with each of ``b`` -> (m, n)."""
    inter = intersect(a, b)
    iw, ih = inter[..., 2] - inter[..., 0], inter[..., 3] - inter[..., 1]
    i = iw * ih
    sa = size(a)[..., None] if a.ndim == 2 else size(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((iw > 0) & (ih > 0), i / (sa + size(b) - i), f32(0)).astype(f32)


def coverage(a: np.ndarray, b: np.ndarray, a_is_one: bool = True) -> np.ndarray:
    """BBoxCoverage: |a & b| / |a| for box ``a`` (4,) and each of ``b`` (n, 4) (``a_is_one``),
    or |b_i & a| / |b_i| (not ``a_is_one``: each of b covered by a); for boxes ``a`` (m, 4),
    (m, n) values."""
    inter = size(intersect(a, b))
    if a_is_one:
        den = np.broadcast_to(size(a)[..., None] if a.ndim == 2 else size(a[None]), inter.shape)
    else:
        den = size(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, inter / den, f32(0)).astype(f32)


def locate(src: np.ndarray, b: np.ndarray) -> np.ndarray:
    """LocateBBox: box(es) ``b`` (..., 4) given inside ``src`` -> image coordinates."""
    w, h = src[2] - src[0], src[3] - src[1]
    return np.stack([src[0] + b[..., 0] * w, src[1] + b[..., 1] * h, src[0] + b[..., 2] * w,
                     src[1] + b[..., 3] * h], -1).astype(f32)


def project(src: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ProjectBBox of boxes ``b`` (n, 4) into ``src``'s frame, clipped: (boxes, kept) where kept
    says which overlap ``src`` and keep a positive size."""
    inside = ~((b[:, 0] >= src[2]) | (b[:, 2] <= src[0]) | (b[:, 1] >= src[3]) | (b[:, 3] <= src[1]))
    w, h = src[2] - src[0], src[3] - src[1]
    out = clip(np.stack([(b[:, 0] - src[0]) / w, (b[:, 1] - src[1]) / h,
                         (b[:, 2] - src[0]) / w, (b[:, 3] - src[1]) / h], 1))
    return out, inside & (size(out) > 0)


def meet_emit(src: np.ndarray, b: np.ndarray, emit) -> np.ndarray:
    """MeetEmitConstraint: CENTER: the box's centre lies in ``src`` (edges included);
    MIN_OVERLAP: the share of the box inside ``src`` exceeds emit_overlap."""
    if emit.emit_type == pb.EmitConstraint.CENTER:
        cx, cy = (b[:, 0] + b[:, 2]) / f32(2), (b[:, 1] + b[:, 3]) / f32(2)
        return (cx >= src[0]) & (cx <= src[2]) & (cy >= src[1]) & (cy <= src[3])
    return coverage(src, b, a_is_one=False) > f32(emit.emit_overlap)


def resize_boxes(rp, old_w: int, old_h: int, b: np.ndarray) -> np.ndarray:
    """UpdateBBoxByResizePolicy: boxes of an ``old_w`` x ``old_h`` image after ``rp``'s resize."""
    nh, nw = f32(rp.height), f32(rp.width)
    orig, new = f32(old_w) / f32(old_h), nw / nh
    x0, y0, x1, y1 = (b[:, i] * f32(old_w if i % 2 == 0 else old_h) for i in range(4))
    z = f32(0)
    if rp.resize_mode == pb.ResizeParameter.FIT_LARGE_SIZE_AND_PAD:
        if orig > new:
            pad = (nh - nw / orig) / f32(2)
            x0, x1 = np.maximum(z, x0 * nw / f32(old_w)), np.minimum(nw, x1 * nw / f32(old_w))
            y0 = pad + np.maximum(z, y0 * (nh - f32(2) * pad) / f32(old_h))
            y1 = pad + np.minimum(nh, y1 * (nh - f32(2) * pad) / f32(old_h))
        else:
            pad = (nw - orig * nh) / f32(2)
            x0 = pad + np.maximum(z, x0 * (nw - f32(2) * pad) / f32(old_w))
            x1 = pad + np.minimum(nw, x1 * (nw - f32(2) * pad) / f32(old_w))
            y0, y1 = np.maximum(z, y0 * nh / f32(old_h)), np.minimum(nh, y1 * nh / f32(old_h))
    else:
        if rp.resize_mode == pb.ResizeParameter.FIT_SMALL_SIZE:
            if orig < new:
                nh = nw / orig
            else:
                nw = orig * nh
        x0, x1 = np.maximum(z, x0 * nw / f32(old_w)), np.minimum(nw, x1 * nw / f32(old_w))
        y0, y1 = np.maximum(z, y0 * nh / f32(old_h)), np.minimum(nh, y1 * nh / f32(old_h))
    return np.stack([x0 / nw, y0 / nh, x1 / nw, y1 / nh], 1).astype(f32)


def extrapolate(rp, h: int, w: int, crop: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ExtrapolateBBox: FIT_SMALL_SIZE with height_scale/width_scale rescales the boxes to the
    scale window; every other setting leaves them."""
    if not (rp.height_scale > 0 and rp.width_scale > 0
            and rp.resize_mode == pb.ResizeParameter.FIT_SMALL_SIZE):
        return b
    orig, rh, rw = f32(w) / f32(h), f32(rp.height), f32(rp.width)
    if orig < rw / rh:
        rh = rw / orig
    else:
        rw = rh * orig
    ch, cw = rh * (crop[3] - crop[1]), rw * (crop[2] - crop[0])
    if cw < rp.width_scale or ch < rp.height_scale:
        raise ValueError(f"resize_param: the crop ({cw:g} x {ch:g}) is smaller than "
                         f"width_scale x height_scale ({rp.width_scale} x {rp.height_scale})")
    sx, sy = cw / f32(rp.width_scale), ch / f32(rp.height_scale)
    return (b * np.array([sx, sy, sx, sy], f32)).astype(f32)


def transform_annos(annos: Annos, crop: np.ndarray, mirror: bool = False, resize=None,
                    emit=None) -> Annos:
    """TransformAnnotation: the boxes that survive cropping the image to ``crop`` (normalised),
    projected into it, mirrored, and resized by ``resize`` = (ResizeParameter, width, height of
    the image before the resize) when given; ``emit`` is the EmitConstraint (or None)."""
    b = annos.box
    if resize is not None:
        b = resize_boxes(resize[0], resize[1], resize[2], b)
    ok = meet_emit(crop, b, emit) if emit is not None else np.ones(len(b), bool)
    proj, kept = project(crop, b)
    if mirror:
        proj = np.stack([f32(1) - proj[:, 2], proj[:, 1], f32(1) - proj[:, 0], proj[:, 3]], 1)
    if resize is not None:
        proj = extrapolate(resize[0], resize[2], resize[1], crop, proj)
    return annos.keep(ok & kept, proj.astype(f32))


# --------------------------------------------------------------------------------- sampler

def check_sampler(sampler) -> None:
    """SampleBBox's CHECKs on a Sampler's ranges."""
    if not (0 < sampler.min_scale <= sampler.max_scale <= 1):
        raise ValueError(f"sampler: need 0 < min_scale <= max_scale <= 1, got "
                         f"{sampler.min_scale:g}, {sampler.max_scale:g}")
    if not 0 < sampler.min_aspect_ratio <= sampler.max_aspect_ratio:
        raise ValueError(f"sampler: need 0 < min_aspect_ratio <= max_aspect_ratio, got "
                         f"{sampler.min_aspect_ratio:g}, {sampler.max_aspect_ratio:g}")


def sample_box(sampler, rng: np.random.Generator) -> np.ndarray:
    """SampleBBox: a box of random scale and aspect ratio placed uniformly in [0, 1]^2."""
    check_sampler(sampler)
    scale = f32(rng.uniform(sampler.min_scale, sampler.max_scale))
    ratio = f32(rng.uniform(sampler.min_aspect_ratio, sampler.max_aspect_ratio))
    return place_box(scale, ratio, rng)


def place_box(scale, ratio, rng) -> np.ndarray:
    """The rest of SampleBBox: the aspect ratio clamped to [scale^2, 1/scale^2] (the box stays
    inside the image), w = scale * sqrt(ratio), h = scale / sqrt(ratio), offsets uniform."""
    scale, ratio = f32(scale), f32(ratio)
    ratio = min(max(ratio, f32(scale * scale)), f32(f32(1) / (scale * scale)))
    w, h = f32(scale * np.sqrt(ratio)), f32(scale / np.sqrt(ratio))
    x = f32(rng.uniform(0, max(f32(1) - w, f32(0))))
    y = f32(rng.uniform(0, max(f32(1) - h, f32(0))))
    return np.array([x, y, x + w, y + h], f32)


def sample_boxes(sampler, u: np.ndarray) -> np.ndarray:
    """``sample_box`` for each row of ``u`` (T, 4), the uniform [0, 1) draws each trial takes in
    turn (scale, ratio, x, y): the same float64 ``low + (high - low) * u`` numpy's
    ``Generator.uniform`` computes, and the same float32 steps, so the boxes are its bits."""
    scale = (sampler.min_scale + (sampler.max_scale - sampler.min_scale) * u[:, 0]).astype(f32)
    lo, hi = sampler.min_aspect_ratio, sampler.max_aspect_ratio
    ratio = (lo + (hi - lo) * u[:, 1]).astype(f32)
    ratio = np.minimum(np.maximum(ratio, scale * scale), f32(1) / (scale * scale))
    root = np.sqrt(ratio)
    w, h = scale * root, scale / root
    x = (np.maximum(f32(1) - w, f32(0)).astype(np.float64) * u[:, 2]).astype(f32)
    y = (np.maximum(f32(1) - h, f32(0)).astype(np.float64) * u[:, 3]).astype(f32)
    return np.stack([x, y, x + w, y + h], 1)


def constraint_met(boxes: np.ndarray, objects: np.ndarray, c) -> np.ndarray:
    """SatisfySampleConstraint for each of ``boxes`` (T, 4) -> (T,) bool. No constraint accepts
    every box. Otherwise, as the fork's loop runs, ``found`` is set once an object passes the
    first kind of test the constraint has (jaccard, else sample coverage, else object
    coverage) and never reset; a later kind failing only skips to the next object. So a box
    is accepted exactly when some object passes that first kind; the later ones never decide."""
    kinds = [k for k in ("jaccard_overlap", "sample_coverage", "object_coverage")
             if c.HasField("min_" + k) or c.HasField("max_" + k)]
    if not kinds:
        return np.ones(len(boxes), bool)
    if not len(objects):
        return np.zeros(len(boxes), bool)
    first = kinds[0]
    if first == "jaccard_overlap":
        v = jaccard(boxes, objects)
    else:
        v = coverage(boxes, objects, a_is_one=first == "sample_coverage")
    ok = np.ones(v.shape, bool)
    if c.HasField("min_" + first):
        ok &= ~(v < f32(getattr(c, "min_" + first)))
    if c.HasField("max_" + first):
        ok &= ~(v > f32(getattr(c, "max_" + first)))
    return ok.any(1)


def satisfies(box: np.ndarray, objects: np.ndarray, c) -> bool:
    """SatisfySampleConstraint of one box (4,) (``constraint_met``)."""
    return bool(constraint_met(np.asarray(box, f32)[None], objects, c)[0])


def batch_samples(objects: np.ndarray, samplers, rng: np.random.Generator) -> list[np.ndarray]:
    """GenerateBatchSamples: for each BatchSampler (use_original_image), up to max_trials boxes
    drawn, those meeting its constraint kept, stopping at max_sample when it is set.

    All of a sampler's trials are drawn and tested at once (per trial: the loop's numpy calls
    cost more than its arithmetic, ~300 trials an image); when max_sample stops the loop
    early, the generator is wound back to where the loop would have left it, so it yields
    the same boxes and leaves ``rng`` in the same state as drawing trial by trial."""
    out: list[np.ndarray] = []
    for s in samplers:
        limit = s.max_sample if s.HasField("max_sample") else None
        if not s.use_original_image or s.max_trials <= 0 or (limit is not None and limit <= 0):
            continue
        check_sampler(s.sampler)
        state = rng.bit_generator.state
        u = rng.random((s.max_trials, 4))
        boxes = locate(UNIT, sample_boxes(s.sampler, u))
        found = np.flatnonzero(constraint_met(boxes, objects, s.sample_constraint))
        if limit is not None and len(found) >= limit:
            found = found[:limit]
            used = int(found[-1]) + 1           # trials the loop runs before it stops
            if used < s.max_trials:
                rng.bit_generator.state = state
                rng.random(4 * used)
        out.extend(boxes[found])
    return out
