"""SSD's image augmentation (weiliu89/caffe ``util/im_transforms.cpp`` and the
``DataTransformer`` additions): photometric distortion, expansion (zoom out), cropping to a
sampled box, and resizing. Images are OpenCV's (H, W[, C]) uint8 BGR; ``rng`` is a numpy
Generator whose ``uniform(a, b)`` stands for caffe_rng_uniform.

Differs from the fork: an encoded record is decoded once and stays an array between the steps
(the fork re-encodes it as JPEG after each of distortion, expansion and cropping, losing detail
each time), and raw records take the same path (the fork skips distortion for them, fills the
expansion canvas with byte 32 and cannot resize them).
"""
from __future__ import annotations

import numpy as np

from ..proto import caffe_pb2 as pb
from .transform import cv

f32 = np.float32


def convert(img: np.ndarray, alpha, beta) -> np.ndarray:
    """cv::Mat::convertTo(uint8, alpha, beta): saturate(round(alpha * x + beta))."""
    return np.clip(np.rint(img.astype(f32) * f32(alpha) + f32(beta)), 0, 255).astype(np.uint8)


def _hsv_channel(img: np.ndarray, ch: int, alpha, beta) -> np.ndarray:
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError("distort_param: saturation and hue need a 3-channel (BGR) image, got "
                         f"shape {img.shape}")
    hsv = cv().cvtColor(img, cv().COLOR_BGR2HSV)
    hsv[..., ch] = convert(hsv[..., ch], alpha, beta)
    return cv().cvtColor(hsv, cv().COLOR_HSV2BGR)


def brightness(img, delta):
    return convert(img, 1, delta) if abs(delta) > 0 else img


def contrast(img, delta):
    return convert(img, delta, 0) if abs(delta - 1) > 1e-3 else img


def saturation(img, delta):
    # The fork tests fabs(delta - 1) != 1e-3, true for every draw: it always converts.
    return _hsv_channel(img, 1, delta, 0)


def hue(img, delta):
    return _hsv_channel(img, 0, 1, delta) if abs(delta) > 0 else img


def distort(img: np.ndarray, p, rng: np.random.Generator) -> np.ndarray:
    """ApplyDistort: with even odds brightness, contrast, saturation, hue (or brightness,
    saturation, hue, contrast), each applied with its own probability and a uniform amount;
    then the channels shuffled with random_order_prob."""
    def maybe(prob, lo, hi, fn, im):
        if f32(rng.uniform(0, 1)) < f32(prob):
            if hi < lo or (fn is not brightness and fn is not hue and lo < 0):
                raise ValueError(f"distort_param: bad range [{lo:g}, {hi:g}] for {fn.__name__}")
            return fn(im, f32(rng.uniform(lo, hi)))
        return im

    b = (p.brightness_prob, -p.brightness_delta, p.brightness_delta, brightness)
    c = (p.contrast_prob, p.contrast_lower, p.contrast_upper, contrast)
    s = (p.saturation_prob, p.saturation_lower, p.saturation_upper, saturation)
    h = (p.hue_prob, -p.hue_delta, p.hue_delta, hue)
    order = (b, c, s, h) if f32(rng.uniform(0, 1)) > f32(0.5) else (b, s, h, c)
    for step in order:
        img = maybe(*step, img)
    if f32(rng.uniform(0, 1)) < f32(p.random_order_prob):
        if img.ndim != 3 or img.shape[2] != 3:
            raise ValueError("distort_param: random_order_prob needs a 3-channel image")
        img = np.ascontiguousarray(img[..., rng.permutation(3)])
    return img


def expand(img: np.ndarray, ratio, h_off, w_off, fill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ExpandImage: the image at (``h_off``, ``w_off``) on a canvas ``ratio`` times its size
    filled with ``fill`` (the mean, (C,) values or a (C, H', W') image); returns (canvas, the
    canvas as a box in the image's normalised coordinates)."""
    h, w = img.shape[:2]
    height, width = int(f32(h) * f32(ratio)), int(f32(w) * f32(ratio))
    c = 1 if img.ndim == 2 else img.shape[2]
    if fill.ndim == 3:
        if fill.shape != (c, height, width):
            raise ValueError(f"expand_param: the mean file's shape {fill.shape} is not the "
                             f"expanded image's {(c, height, width)}")
        canvas = fill.astype(np.int64).astype(np.uint8).transpose(1, 2, 0).copy()
    else:
        canvas = np.empty((height, width, c), np.uint8)
        canvas[...] = np.clip(np.rint(fill), 0, 255).astype(np.uint8) if fill.size else 0
    canvas = canvas.reshape((height, width) + img.shape[2:])
    canvas[h_off:h_off + h, w_off:w_off + w] = img
    box = np.array([-w_off / f32(w), -h_off / f32(h), (width - w_off) / f32(w),
                    (height - h_off) / f32(h)], f32)
    return canvas, box


def random_expand(img: np.ndarray, p, fill, rng) -> tuple[np.ndarray, np.ndarray | None]:
    """The expand_param step: with probability ``prob``, a ratio uniform in [1, max_expand_ratio)
    and floor-uniform offsets; returns (image, its box) or (image, None) when not expanded."""
    if f32(rng.uniform(0, 1)) > f32(p.prob) or abs(p.max_expand_ratio - 1) < 1e-2:
        return img, None
    ratio = f32(rng.uniform(1, p.max_expand_ratio))
    h, w = img.shape[:2]
    height, width = int(f32(h) * ratio), int(f32(w) * ratio)
    h_off = int(np.floor(f32(rng.uniform(0, height - h))))
    w_off = int(np.floor(f32(rng.uniform(0, width - w))))
    return expand(img, ratio, h_off, w_off, fill)


def crop(img: np.ndarray, box: np.ndarray) -> np.ndarray:
    """CropImage: the pixels of ``box`` (normalised, clipped to the image), offsets and sizes
    truncated to int as the fork does."""
    h, w = img.shape[:2]
    b = np.clip(box.astype(f32), f32(0), f32(1)) * np.array([w, h, w, h], f32)
    x0, y0 = int(b[0]), int(b[1])
    return img[y0:y0 + int(b[3] - b[1]), x0:x0 + int(b[2] - b[0])].copy()


_INTERP = {pb.ResizeParameter.LINEAR: "INTER_LINEAR", pb.ResizeParameter.AREA: "INTER_AREA",
           pb.ResizeParameter.NEAREST: "INTER_NEAREST", pb.ResizeParameter.CUBIC: "INTER_CUBIC",
           pb.ResizeParameter.LANCZOS4: "INTER_LANCZOS4"}
_PAD = {pb.ResizeParameter.CONSTANT: "BORDER_CONSTANT", pb.ResizeParameter.MIRRORED: "BORDER_REFLECT101",
        pb.ResizeParameter.REPEAT_NEAREST: "BORDER_REPLICATE"}


def new_size(rp, w: int, h: int) -> tuple[int, int]:
    """InferNewSize: (width, height) after ``rp``."""
    width, height = int(rp.width), int(rp.height)
    if rp.resize_mode == pb.ResizeParameter.FIT_SMALL_SIZE:
        orig = f32(w) / f32(h)
        if orig < f32(width) / f32(height):
            height = int(f32(width) / orig)
        else:
            width = int(orig * f32(height))
    return width, height


def resize(img: np.ndarray, rp, rng) -> np.ndarray:
    """ApplyResize: WARP to height x width, FIT_SMALL_SIZE (the short side to the target,
    aspect kept) or FIT_LARGE_SIZE_AND_PAD (the long side, then padded); the interpolation is
    one of interp_mode picked uniformly (LINEAR when none)."""
    cv2 = cv()
    interp = cv2.INTER_LINEAR
    if len(rp.interp_mode):
        cum = np.cumsum(np.full(len(rp.interp_mode), f32(1) / f32(len(rp.interp_mode)), f32))
        pick = int(np.searchsorted(cum, f32(rng.uniform(0, cum[-1])), "left"))
        interp = getattr(cv2, _INTERP[rp.interp_mode[min(pick, len(cum) - 1)]])
    nw, nh = int(rp.width), int(rp.height)
    h, w = img.shape[:2]
    orig, new = f32(w) / f32(h), f32(nw) / f32(nh)
    if rp.resize_mode == pb.ResizeParameter.WARP:
        return cv2.resize(img, (nw, nh), interpolation=interp)
    if rp.resize_mode == pb.ResizeParameter.FIT_SMALL_SIZE:
        size = (nw, int(np.floor(f32(nw) / orig))) if orig < new else (int(np.floor(orig * f32(nh))), nh)
        return cv2.resize(img, size, interpolation=interp)
    c = 1 if img.ndim == 2 else img.shape[2]
    pad = list(rp.pad_value) or [0.0]
    if len(pad) not in (1, c):
        raise ValueError(f"resize_param: give 1 pad_value or one per channel ({c}), got {len(pad)}")
    value = (pad * c if len(pad) == 1 else pad) + [0.0] * (4 - c)
    border = getattr(cv2, _PAD[rp.pad_mode])
    if orig > new:
        out = cv2.resize(img, (nw, int(np.floor(f32(nw) / orig))), interpolation=interp)
        top = (nh - out.shape[0]) // 2
        return cv2.copyMakeBorder(out, top, nh - out.shape[0] - top, 0, 0, border, value=value)
    out = cv2.resize(img, (int(np.floor(orig * f32(nh))), nh), interpolation=interp)
    left = (nw - out.shape[1]) // 2
    return cv2.copyMakeBorder(out, 0, 0, left, nw - out.shape[1] - left, border, value=value)
