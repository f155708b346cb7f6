"""SSD's AnnotatedData against the fork's formulas (weiliu89/caffe sampler.cpp, bbox_util.cpp,
im_transforms.cpp, data_transformer.cpp) on hand-checked cases, distributional checks where it
draws at random, the layer end to end (every emitted box lies on its object's pixels after the
MobileNet-SSD augmentation), and the detection mAP of SSD's solver."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
from google.protobuf import text_format

from brewnet import Net
from brewnet.data import augment as A
from brewnet.data import boxes as B
from brewnet.data.annoset import annotated_datum, label_map_from
from brewnet.data.boxes import Annos, batch_samples, place_box, satisfies, transform_annos
from brewnet.data.db import open_writer
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from brewnet.solvers.detection_eval import DetectionMAP, average_precision

f32 = np.float32


class Draws:
    """A Generator stand-in: uniform(a, b) returns a + u * (b - a) for the next preset u."""

    def __init__(self, *us):
        self.us = list(us)

    def uniform(self, a, b):
        return a + self.us.pop(0) * (b - a)


def msg(cls, text):
    return text_format.Parse(text, cls())


# ------------------------------------------------------------------------------ sampler

def test_place_box_clamps_the_ratio_and_places_inside():
    # scale 0.5, ratio 9 -> clamped to 1 / 0.5^2 = 4: w = 0.5 * 2 = 1, h = 0.5 / 2 = 0.25
    box = place_box(0.5, 9.0, Draws(0.3, 0.5))
    np.testing.assert_allclose(box, [0, 0.375, 1, 0.625], atol=1e-7)
    # ratio 0.1 -> clamped to 0.5^2 = 0.25: w = 0.25, h = 1; x offset 0.2 * 0.75
    np.testing.assert_allclose(place_box(0.5, 0.1, Draws(0.2, 0.9)), [0.15, 0, 0.4, 1], atol=1e-7)


def test_sampled_boxes_follow_the_sampler_distribution():
    rng = np.random.default_rng(0)
    s = msg(pb.BatchSampler, "sampler { min_scale: 0.3 max_scale: 1 min_aspect_ratio: 0.5 "
                             "max_aspect_ratio: 2 } max_sample: 1 max_trials: 1")
    boxes = np.array([batch_samples(np.zeros((0, 4), f32), [s], rng)[0] for _ in range(4000)])
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes >= 0).all() and (boxes <= 1 + 1e-6).all()
    scale, ratio = np.sqrt(w * h), w / h
    assert scale.min() >= 0.3 - 1e-5 and scale.max() <= 1 + 1e-5
    # scale is uniform on [0.3, 1]: mean 0.65, sd 0.7 / sqrt(12)
    assert abs(scale.mean() - 0.65) < 0.01 and abs(scale.std() - 0.7 / np.sqrt(12)) < 0.01
    # the ratio is uniform on [0.5, 2] then clamped into [scale^2, 1 / scale^2]
    assert (ratio >= scale ** 2 - 1e-4).all() and (ratio <= 1 / scale ** 2 + 1e-4).all()
    free = scale < np.sqrt(0.5)                     # where the clamp cannot bite
    assert abs(ratio[free].mean() - 1.25) < 0.03


def test_constraints_hand_checked():
    sampled = np.array([0, 0, 0.5, 0.5], f32)
    obj = np.array([[0.25, 0.25, 0.75, 0.75]], f32)     # IoU .0625 / .4375 = 1/7
    c = pb.SampleConstraint
    assert satisfies(sampled, obj, msg(c, "min_jaccard_overlap: 0.1"))
    assert not satisfies(sampled, obj, msg(c, "min_jaccard_overlap: 0.3"))
    assert satisfies(sampled, obj, msg(c, "max_jaccard_overlap: 0.2"))
    assert satisfies(sampled, obj, msg(c, "min_sample_coverage: 0.25"))   # .0625 / .25
    assert not satisfies(sampled, obj, msg(c, "min_object_coverage: 0.3"))
    assert satisfies(sampled, np.zeros((0, 4), f32), pb.SampleConstraint())   # none: any box
    assert not satisfies(sampled, np.zeros((0, 4), f32), msg(c, "min_jaccard_overlap: 0.1"))


def test_constraint_found_flag_stays_set_as_in_the_fork():
    # Object A passes the jaccard test but fails max_sample_coverage; B fails jaccard. The
    # fork's loop keeps ``found`` from A and returns true.
    sampled = np.array([0, 0, 0.5, 0.5], f32)
    objs = np.array([[0, 0, 0.5, 0.6], [0.9, 0.9, 1, 1]], f32)
    c = msg(pb.SampleConstraint, "min_jaccard_overlap: 0.5 max_sample_coverage: 0.5")
    assert satisfies(sampled, objs, c)
    assert not satisfies(sampled, objs[1:], c)


def test_max_sample_and_trials():
    rng = np.random.default_rng(1)
    full = msg(pb.BatchSampler, "max_sample: 1 max_trials: 1")
    assert [b.tolist() for b in batch_samples(np.zeros((0, 4), f32), [full], rng)] == [[0, 0, 1, 1]]
    many = msg(pb.BatchSampler, "sampler { min_scale: 0.3 } max_trials: 7")
    assert len(batch_samples(np.zeros((0, 4), f32), [many], rng)) == 7
    off = msg(pb.BatchSampler, "use_original_image: false")
    assert batch_samples(np.zeros((0, 4), f32), [off], rng) == []


def _satisfies_loop(box, objects, c):
    """The fork's SatisfySampleConstraint loop, object by object and test by test."""
    kinds = [k for k in ("jaccard_overlap", "sample_coverage", "object_coverage")
             if c.HasField("min_" + k) or c.HasField("max_" + k)]
    if not kinds:
        return True
    found = False
    for obj in objects:
        for k in kinds:
            if k == "jaccard_overlap":
                v = B.jaccard(box, obj[None])[0]
            else:
                v = B.coverage(box, obj[None]) if k == "sample_coverage" else \
                    B.coverage(obj, box[None])[0]
                v = v if np.ndim(v) == 0 else v[0]
            if (c.HasField("min_" + k) and v < f32(getattr(c, "min_" + k))) or \
                    (c.HasField("max_" + k) and v > f32(getattr(c, "max_" + k))):
                break
            found = True
        else:
            if found:
                return True
    return found


def _batch_samples_loop(objects, samplers, rng):
    """GenerateBatchSamples trial by trial: one sample_box and one constraint test each."""
    out = []
    for s in samplers:
        if not s.use_original_image:
            continue
        found = 0
        for _ in range(s.max_trials):
            if s.HasField("max_sample") and found >= s.max_sample:
                break
            box = B.locate(B.UNIT, B.sample_box(s.sampler, rng))
            if _satisfies_loop(box, objects, s.sample_constraint):
                found += 1
                out.append(box)
    return out


SSD_SAMPLERS = [msg(pb.BatchSampler, "max_sample: 1 max_trials: 1")] + [
    msg(pb.BatchSampler, "sampler { min_scale: 0.3 max_scale: 1 min_aspect_ratio: 0.5 "
        f"max_aspect_ratio: 2 }} sample_constraint {{ {c} }} max_sample: 1 max_trials: 50")
    for c in ("min_jaccard_overlap: 0.1", "min_jaccard_overlap: 0.3", "min_jaccard_overlap: 0.5",
              "min_jaccard_overlap: 0.7", "min_jaccard_overlap: 0.9", "max_jaccard_overlap: 1.0")]
OTHER_SAMPLERS = [msg(pb.BatchSampler, "sampler { min_scale: 0.1 max_scale: 0.9 min_aspect_ratio: "
                  f"0.3 max_aspect_ratio: 3 }} sample_constraint {{ {c} }} {m} max_trials: 20")
                  for c, m in (("min_sample_coverage: 0.4 max_jaccard_overlap: 0.6", "max_sample: 2"),
                               ("max_object_coverage: 0.5 min_jaccard_overlap: 0.05", ""),
                               ("min_object_coverage: 0.8", "max_sample: 3"))]


def test_batch_samples_at_once_equal_the_trial_loop_and_leave_the_same_rng():
    """All trials of a sampler drawn and tested at once: the same boxes, in order, and the
    generator left where the trial-by-trial loop leaves it (objects from none to four)."""
    gen = np.random.default_rng(7)
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    for _ in range(300):
        n = int(gen.integers(0, 5))
        xy = gen.uniform(0, 0.7, (n, 2))
        objects = np.concatenate([xy, xy + gen.uniform(0.05, 0.3, (n, 2))], 1).astype(f32)
        for samplers in (SSD_SAMPLERS, OTHER_SAMPLERS):
            got = batch_samples(objects, samplers, a)
            want = _batch_samples_loop(objects, samplers, b)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.dtype == np.float32 and g.tobytes() == w.tobytes()
            assert a.bit_generator.state == b.bit_generator.state


# ----------------------------------------------------------------------------- annotations

def _annos(*boxes):
    n = len(boxes)
    return Annos(np.array(boxes, f32), np.arange(1, n + 1), np.zeros(n, int), np.zeros(n, bool))


def test_transform_annotation_projects_mirrors_and_emits():
    crop = np.array([0.25, 0.25, 0.75, 0.75], f32)
    a = _annos([0.3, 0.3, 0.5, 0.6], [0.0, 0.0, 0.3, 0.3], [0.8, 0.8, 0.9, 0.9])
    out = transform_annos(a, crop)                      # the third lies outside: dropped
    np.testing.assert_allclose(out.box, [[0.1, 0.1, 0.5, 0.7], [0, 0, 0.1, 0.1]], atol=1e-6)
    assert out.label.tolist() == [1, 2]
    out = transform_annos(a, crop, mirror=True)
    np.testing.assert_allclose(out.box[0], [0.5, 0.1, 0.9, 0.7], atol=1e-6)
    centre = msg(pb.EmitConstraint, "emit_type: CENTER")
    assert transform_annos(a, crop, emit=centre).label.tolist() == [1]     # centre .15 is out
    # the second box: .05^2 of its .09 inside the crop, a coverage of .0278
    overlap = msg(pb.EmitConstraint, "emit_type: MIN_OVERLAP emit_overlap: 0.02")
    assert transform_annos(a, crop, emit=overlap).label.tolist() == [1, 2]
    strict = msg(pb.EmitConstraint, "emit_type: MIN_OVERLAP emit_overlap: 0.5")
    assert transform_annos(a, crop, emit=strict).label.tolist() == [1]


def test_fit_large_size_and_pad_boxes_match_the_image():
    rp = msg(pb.ResizeParameter, "resize_mode: FIT_LARGE_SIZE_AND_PAD height: 100 width: 100")
    img = np.full((100, 200, 3), 255, np.uint8)            # 200 wide: padded above and below
    out = A.resize(img, rp, np.random.default_rng(0))
    rows = np.flatnonzero(out[:, 50, 0] > 0)
    assert out.shape == (100, 100, 3) and (rows[0], rows[-1]) == (25, 74)
    box = transform_annos(_annos([0, 0, 1, 1]), np.array([0, 0, 1, 1], f32), resize=(rp, 200, 100))
    np.testing.assert_allclose(box.box, [[0, 0.25, 1, 0.75]], atol=1e-6)


# ------------------------------------------------------------------------------- images

def test_photometric_steps_hand_checked():
    x = np.array([[[0, 100, 250]]], np.uint8)
    assert A.brightness(x, f32(10.6)).tolist() == [[[11, 111, 255]]]
    assert A.brightness(x, f32(-10.5)).tolist() == [[[0, 90, 240]]]     # 89.5 -> 90 (to even)
    assert A.contrast(x, f32(1.5)).tolist() == [[[0, 150, 255]]]
    assert A.contrast(x, f32(1.0005)) is x                              # |delta - 1| <= 1e-3
    img = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    # The fork always converts for saturation (its test is != 1e-3): delta 1 is the HSV round trip.
    np.testing.assert_array_equal(A.saturation(img, f32(1)), cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR))
    shifted = hsv.copy()
    shifted[..., 0] = np.clip(hsv[..., 0].astype(int) + 200, 0, 255)    # saturates, no wrap
    np.testing.assert_array_equal(A.hue(img, f32(200)), cv2.cvtColor(shifted, cv2.COLOR_HSV2BGR))


def test_distortion_probabilities_and_ranges():
    p = msg(pb.DistortionParameter, "brightness_prob: 0.5 brightness_delta: 32")
    rng = np.random.default_rng(0)
    img = np.full((2, 2, 3), 128, np.uint8)
    shifts = np.array([int(A.distort(img, p, rng)[0, 0, 0]) - 128 for _ in range(4000)])
    moved = shifts[shifts != 0]
    assert abs(len(moved) / len(shifts) - 0.5) < 0.03
    assert moved.min() >= -32 and moved.max() <= 32
    assert abs(moved.mean()) < 1.5 and abs(moved.std() - 64 / np.sqrt(12)) < 1.0


def test_expand_hand_checked():
    img = np.arange(18, dtype=np.uint8).reshape(2, 3, 3) + 1
    canvas, box = A.expand(img, 2.0, 1, 2, np.array([104, 117, 123.5], f32))
    assert canvas.shape == (4, 6, 3)
    np.testing.assert_array_equal(canvas[1:3, 2:5], img)
    assert canvas[0, 0].tolist() == [104, 117, 124]              # rint(123.5) = 124 (to even)
    np.testing.assert_allclose(box, [-2 / 3, -0.5, 4 / 3, 1.5], atol=1e-6)
    # The box of an object at the image's full extent becomes the image's place on the canvas.
    a = transform_annos(_annos([0, 0, 1, 1]), box)
    np.testing.assert_allclose(a.box, [[2 / 6, 1 / 4, 5 / 6, 3 / 4]], atol=1e-6)


def test_random_expand_distribution():
    p = msg(pb.ExpansionParameter, "prob: 0.5 max_expand_ratio: 4")
    rng = np.random.default_rng(0)
    img = np.zeros((10, 10, 3), np.uint8)
    sides = [A.random_expand(img, p, np.zeros(3, f32), rng)[0].shape[0] for _ in range(3000)]
    sides = np.array(sides)
    grown = sides[sides > 10]
    assert abs(len(grown) / len(sides) - 0.5) < 0.03
    assert grown.max() <= 40 and abs((grown / 10).mean() - 2.5) < 0.1    # ratio ~ U[1, 4)


def test_crop_truncates_as_the_fork():
    img = np.arange(100, dtype=np.uint8).reshape(10, 10)
    out = A.crop(img, np.array([0.25, 0.1, 0.78, 1.2], f32))     # clipped, then int()
    assert out.shape == (9, 5) and out[0, 0] == img[1, 2]


# ------------------------------------------------------------------------------ the layer

def _rect_lmdb(path, n=12, side=64, labels=(1, 2)):
    """Black images with one white rectangle each; boxes in pixels -> AnnotatedDatum records."""
    rng = np.random.default_rng(5)
    names = {"a": labels[0], "b": labels[1]}
    with open_writer(str(path)) as w:
        for i in range(n):
            img = np.zeros((side, side + 16, 3), np.uint8)
            x0, y0 = int(rng.integers(0, side // 2)), int(rng.integers(0, side // 2))
            x1, y1 = x0 + int(rng.integers(12, side // 2)), y0 + int(rng.integers(12, side // 2))
            img[y0:y1, x0:x1] = 255
            ok, buf = cv2.imencode(".png", img)
            ad = annotated_datum(buf.tobytes(), (side + 16, side), [("ab"[i % 2], x0, y0, x1, y1, False)],
                                 names, f"record {i}")
            w.put(f"{i:08d}", ad.SerializeToString())
    return str(path)


def _net(source, transform="", sampler="", batch=6, extra=""):
    return f"""name: "a"
layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ {transform} }}
  data_param {{ source: "{source}" batch_size: {batch} }}
  annotated_data_param {{ {sampler} {extra} }} }}"""


def test_plain_records_give_their_boxes(tmp_path):
    db = _rect_lmdb(tmp_path / "r")
    net = Net(_net(db), phase=pb.TRAIN)
    net.forward()
    data, label = net.blobs["data"].data, net.blobs["label"].data
    assert data.shape == (6, 3, 64, 80) and label.shape == (1, 1, 6, 8)
    for item, lab, inst, x0, y0, x1, y1, diff in label[0, 0]:
        white = data[int(item), 0] > 128
        ys, xs = np.nonzero(white)
        np.testing.assert_allclose([x0 * 80, y0 * 64, x1 * 80, y1 * 64],
                                   [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], atol=1e-3)
        assert lab == 1 + int(item) % 2 and inst == 0 and diff == 0


MOBILENET_AUG = """mirror: true mean_value: 127.5 mean_value: 127.5 mean_value: 127.5 scale: 0.007843
  resize_param { resize_mode: WARP height: 48 width: 48 interp_mode: NEAREST }
  emit_constraint { emit_type: CENTER }
  expand_param { prob: 0.5 max_expand_ratio: 4 }"""
MOBILENET_SAMPLERS = "batch_sampler { max_sample: 1 max_trials: 1 }" + "".join(
    f""" batch_sampler {{ sampler {{ min_scale: 0.3 max_scale: 1 min_aspect_ratio: 0.5
  max_aspect_ratio: 2 }} sample_constraint {{ {c} }} max_sample: 1 max_trials: 50 }}"""
    for c in ["min_jaccard_overlap: 0.1", "min_jaccard_overlap: 0.5", "max_jaccard_overlap: 1.0"])


def test_augmented_boxes_lie_on_their_objects(tmp_path):
    """MobileNet-SSD's augmentation (expand, sampled crops, warp, mirror, centre emit): every
    emitted box is the white rectangle's visible part in the output image (NEAREST resize keeps
    its edges sharp). Tolerance: the fork crops the pixels at an int-truncated offset d and an
    int-truncated size r (each truncated alone, d, r < 1 source pixel) but projects the boxes
    with the exact crop box of side L >= 0.21 of the 160-pixel side (scale >= 0.3, aspect <= 2):
    an edge moves by up to 48 (d + r) / L < 2.83 output pixels, NEAREST by one more. A box whose
    visible part is under ~1 output pixel thin may fall between NEAREST's samples: no pixels."""
    db = _rect_lmdb(tmp_path / "r", n=24, side=160)
    net = Net(_net(db, MOBILENET_AUG, MOBILENET_SAMPLERS, batch=24), phase=pb.TRAIN)
    rows, changed = 0, 0
    for _ in range(4):
        net.forward()
        data, label = net.blobs["data"].data, net.blobs["label"].data[0, 0]
        assert data.shape == (24, 3, 48, 48) and label.shape[1] == 8
        for item, _, _, x0, y0, x1, y1, _ in label:
            if item < 0:
                continue
            ys, xs = np.nonzero(data[int(item), 0] > 0.5)
            if not len(xs):
                assert min(x1 - x0, y1 - y0) * 48 < 1.05, (x0, y0, x1, y1)
                continue
            np.testing.assert_allclose([x0 * 48, y0 * 48, x1 * 48, y1 * 48],
                                       [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], atol=3.9)
            rows += 1
            changed += abs((x1 - x0) * (y1 - y0) - 0.1) > 0.05
    assert rows > 40 and changed > 10


def test_label_map_and_box_checks_name_the_record(tmp_path):
    db = _rect_lmdb(tmp_path / "r", labels=(1, 7))
    lm = tmp_path / "lm.prototxt"
    lm.write_text(text_format.MessageToString(label_map_from(["a", "b"])))
    net = Net(_net(db, extra=f'label_map_file: "{lm}"', batch=1), phase=pb.TRAIN)
    net.forward()
    with pytest.raises(LayerError, match=r"record '00000001' has a box of label 7, which is not in "
                                         r"the label map") as e:
        net.forward()
    assert str(tmp_path / "r") in str(e.value)
    with pytest.raises(LayerError, match=r"cannot read label map .*nope"):
        Net(_net(db, extra='label_map_file: "nope.prototxt"'), phase=pb.TRAIN)


def test_no_boxes_gives_one_row_of_minus_one(tmp_path):
    with open_writer(str(tmp_path / "e")) as w:
        ad = pb.AnnotatedDatum(type=pb.AnnotatedDatum.BBOX)
        ad.datum.CopyFrom(pb.Datum(channels=3, height=4, width=4, data=bytes(48)))
        w.put("0", ad.SerializeToString())
    net = Net(_net(str(tmp_path / "e"), batch=2), phase=pb.TRAIN)
    net.forward()
    assert net.blobs["label"].data.tolist() == [[[[-1.0] * 8]]]


def test_records_without_an_annotation_type_give_datum_labels(tmp_path):
    # The fork: no type in the record and no anno_type -> a (batch_size,) label of datum.label.
    with open_writer(str(tmp_path / "u")) as w:
        for i in range(3):
            ad = pb.AnnotatedDatum()
            ad.datum.CopyFrom(pb.Datum(channels=1, height=2, width=2, data=bytes([i] * 4), label=10 + i))
            w.put(f"{i}", ad.SerializeToString())
    net = Net(_net(str(tmp_path / "u"), batch=4), phase=pb.TRAIN)
    net.forward()
    assert net.blobs["label"].data.tolist() == [10, 11, 12, 10]
    assert net.blobs["data"].data[:, 0, 0, 0].tolist() == [0, 1, 2, 0]


def test_a_plain_datum_database_is_a_clear_error(tmp_path):
    from brewnet.data.transform import chw_to_datum

    with open_writer(str(tmp_path / "d")) as w:
        w.put("k0", chw_to_datum(np.zeros((3, 4, 4), np.uint8), 1).SerializeToString())
    with pytest.raises(LayerError, match=r"record 'k0' (holds no datum|is not a valid AnnotatedDatum)"):
        Net(_net(str(tmp_path / "d")), phase=pb.TRAIN)


# ------------------------------------------------------------------------------ mAP

def test_average_precision_hand_checked():
    scores, tp = [0.9, 0.8, 0.7], [1, 0, 1]       # 2 gt: prec 1, 1/2, 2/3; rec 1/2, 1/2, 1
    assert average_precision(scores, tp, 2, "Integral") == pytest.approx(0.5 + 0.5 * 2 / 3, abs=1e-6)
    assert average_precision(scores, tp, 2, "MaxIntegral") == pytest.approx(0.5 + 0.5 * 2 / 3, abs=1e-6)
    assert average_precision(scores, tp, 2, "11point") == pytest.approx((6 + 5 * 2 / 3) / 11, abs=1e-6)
    # MaxIntegral lifts a dip: prec 1, 1/2, 2/3, 3/4 over rec 1/3, 1/3, 2/3, 1
    assert average_precision([4, 3, 2, 1], [1, 0, 1, 1], 3, "MaxIntegral") == \
        pytest.approx((1 + 0.75 + 0.75) / 3, abs=1e-6)
    assert average_precision([4, 3, 2, 1], [1, 0, 1, 1], 3, "Integral") == \
        pytest.approx((1 + 2 / 3 + 0.75) / 3, abs=1e-6)


def test_11point_against_the_voc2007_formula():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 60))
        scores, tp = rng.random(n), rng.integers(0, 2, n)
        npos = int(tp.sum() + rng.integers(0, 5)) or 1
        order = np.argsort(-scores, kind="stable")
        c = np.cumsum(tp[order])
        # the fork's recall is a float, compared with the double j / 10: 27/30 as a float is
        # below 0.9, so that point falls to the next threshold
        rec, prec = (c.astype(f32) / f32(npos)).astype(float), c / np.arange(1, n + 1)
        ref = sum(max(prec[rec >= j / 10], default=0) for j in range(11)) / 11
        assert average_precision(scores, tp, npos, "11point") == pytest.approx(ref, abs=1e-5)


def test_map_accumulates_evaluate_rows_as_the_solver():
    m = DetectionMAP()
    m.add([[-1, 1, 2, -1, -1], [-1, 2, 1, -1, -1], [0, 1, 0.9, 1, 0], [0, 1, 0.8, 0, 1]])
    m.add([[-1, 1, 0, -1, -1], [-1, 2, 0, -1, -1], [1, 1, 0.7, 1, 0], [1, 2, 0.5, 0, 0]])
    aps = m.aps("Integral")
    assert aps[1] == pytest.approx(0.5 + 0.5 * 2 / 3, abs=1e-6)
    assert aps[2] is None                   # only a difficult match: skipped, still averaged
    assert m.mean_ap("Integral") == pytest.approx((0.5 + 0.5 * 2 / 3) / 2, abs=1e-6)


TINY_SSD = """name: "tiny_ssd"
layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.0078125 mean_value: 128 resize_param {{ height: 32 width: 32 }} }}
  data_param {{ source: "{source}" batch_size: 4 }} }}
layer {{ name: "f" type: "Convolution" bottom: "data" top: "f"
  convolution_param {{ num_output: 8 kernel_size: 8 stride: 8 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loc" type: "Convolution" bottom: "f" top: "loc"
  convolution_param {{ num_output: 4 kernel_size: 1 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loc_p" type: "Permute" bottom: "loc" top: "loc_p"
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "loc_f" type: "Flatten" bottom: "loc_p" top: "loc_f" }}
layer {{ name: "conf" type: "Convolution" bottom: "f" top: "conf"
  convolution_param {{ num_output: 3 kernel_size: 1 weight_filler {{ type: "gaussian" std: 1 }} }} }}
layer {{ name: "conf_p" type: "Permute" bottom: "conf" top: "conf_p"
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "conf_f" type: "Flatten" bottom: "conf_p" top: "conf_f" }}
layer {{ name: "conf_r" type: "Reshape" bottom: "conf_f" top: "conf_r"
  reshape_param {{ shape {{ dim: 0 dim: -1 dim: 3 }} }} }}
layer {{ name: "conf_s" type: "Softmax" bottom: "conf_r" top: "conf_s" softmax_param {{ axis: 2 }} }}
layer {{ name: "conf_sf" type: "Flatten" bottom: "conf_s" top: "conf_sf" }}
layer {{ name: "prior" type: "PriorBox" bottom: "f" bottom: "data" top: "prior"
  prior_box_param {{ min_size: 12 clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }} }}
layer {{ name: "det" type: "DetectionOutput" bottom: "loc_f" bottom: "conf_sf" bottom: "prior" top: "det"
  detection_output_param {{ num_classes: 3 background_label_id: 0 code_type: CENTER_SIZE
    nms_param {{ nms_threshold: 0.45 top_k: 50 }} keep_top_k: 20 confidence_threshold: 0.01 }} }}
layer {{ name: "detection_eval" type: "DetectionEvaluate" bottom: "det" bottom: "label" top: "detection_eval"
  detection_evaluate_param {{ num_classes: 3 background_label_id: 0 overlap_threshold: 0.1 }} }}
"""


@pytest.mark.parametrize("version", ["11point", "MaxIntegral"])
def test_brewnet_test_reports_the_solvers_map(tmp_path, caplog, version):
    """``brewnet test`` on an SSD test net: the mAP line is DetectionMAP over the batches'
    DetectionEvaluate tops (the net run again here on the same weights and records)."""
    import logging

    from brewnet import cli

    db = _rect_lmdb(tmp_path / "r", n=8)
    model = tmp_path / "ssd.prototxt"
    model.write_text(TINY_SSD.format(source=db))
    net = Net(str(model), phase=pb.TEST)
    net.save(str(tmp_path / "w.caffemodel"))
    m = DetectionMAP()
    for _ in range(3):
        net.forward()
        m.add(net.blobs["detection_eval"].data)
    assert sum(m.num_pos.values()) == 12 and m.dets          # 3 batches of 4 images, 1 box each
    with caplog.at_level(logging.INFO, logger="brewnet"):
        assert cli.main(["test", "--model", str(model), "--weights", str(tmp_path / "w.caffemodel"),
                         "--iterations", "3", "--ap-version", version, "--per-class"]) == 0
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("detection_eval = ")]
    assert line == [f"detection_eval = {m.mean_ap(version):g} (mAP, {version}, 12 ground-truth boxes)"]
    assert not any("Batch 0, detection_eval" in r.getMessage() for r in caplog.records)
