"""Caffe's DataTransformer, image decoding and the Datum <-> array conversions.

Images are OpenCV's: decoded colour images are BGR, arrays are (C, H, W) uint8 in a Datum's
own layout. The transform is Caffe's, operation for operation in float32:
``out = (pixel - mean) * scale``, with the crop taken first (random offset in TRAIN, centred in
TEST), the mean image indexed at the crop offset of the full image, and a random horizontal
mirror (in both phases) applied to the result.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..proto import caffe_pb2 as pb
from .db import _show

log = logging.getLogger("brewnet")


class TransformError(ValueError):
    """Transform parameters that cannot apply to the data (mean shape, crop size...)."""


# ------------------------------------------------------------------------------- decoding

def cv():
    """OpenCV, imported on first use (it costs ~0.1 s; ``import brewnet`` need not pay it)."""
    import cv2

    return cv2


def decode_image(buf, color: bool | None = None) -> np.ndarray:
    """Decode JPEG/PNG/... bytes as OpenCV does: ``color`` True -> (H, W, 3) BGR, False ->
    (H, W) gray, None -> as stored (Caffe's ``DecodeDatumToCVMatNative``). None on failure."""
    cv2 = cv()
    flag = {True: cv2.IMREAD_COLOR, False: cv2.IMREAD_GRAYSCALE, None: cv2.IMREAD_UNCHANGED}[color]
    arr = np.frombuffer(buf, np.uint8)
    return cv2.imdecode(arr, flag) if arr.size else None


def read_image(path, height: int = 0, width: int = 0, color: bool = True,
               nearest: bool = False) -> np.ndarray:
    """Caffe's ``ReadImageToCVMat``: (H, W, 3) BGR or (H, W) gray uint8, resized with bilinear
    interpolation (``nearest``: nearest neighbour, as caffe-segnet reads label images) to
    ``height`` x ``width`` when both are positive. Raises OSError when the file is missing or
    does not decode."""
    try:
        raw = np.fromfile(os.fspath(path), np.uint8)
    except OSError as e:
        raise OSError(f"could not open or find file {path}: {e.strerror or e}") from None
    img = decode_image(raw, color)
    if img is None:
        raise OSError(f"could not decode image file {path} ({raw.size} bytes)")
    if height > 0 and width > 0:
        interp = cv().INTER_NEAREST if nearest else cv().INTER_LINEAR
        img = cv().resize(img, (width, height), interpolation=interp)
    return img


def hwc_to_chw(img: np.ndarray) -> np.ndarray:
    """An OpenCV image (H, W[, C]) as a (C, H, W) view."""
    return img[None] if img.ndim == 2 else img.transpose(2, 0, 1)


def datum_to_chw(datum, force_color: bool = False, force_gray: bool = False, key=b"",
                 source: str = "") -> np.ndarray:
    """The image of a Datum as (C, H, W): uint8 for byte data and encoded images, float32 for
    ``float_data``. Encoded images decode natively unless ``force_color``/``force_gray``."""
    if datum.encoded:
        color = True if force_color else (False if force_gray else None)
        img = decode_image(datum.data, color)
        if img is None:
            raise TransformError(f"{source}: record {_show(key)}: encoded image does not decode "
                                 f"({len(datum.data)} bytes)")
        if img.dtype != np.uint8:
            raise TransformError(f"{source}: record {_show(key)}: image data type must be unsigned "
                                 f"byte, got {img.dtype}")
        return hwc_to_chw(img)
    shape = (datum.channels, datum.height, datum.width)
    if datum.data:
        return np.frombuffer(datum.data, np.uint8).reshape(shape)
    img = np.asarray(datum.float_data, np.float32).reshape(shape)
    if not np.isfinite(img).all():
        j = int(np.flatnonzero(~np.isfinite(img))[0])
        raise TransformError(f"{source}: record {_show(key)} holds a non-finite value "
                             f"({img.flat[j]} at float_data[{j}] of {img.size})")
    return img


def chw_to_datum(img: np.ndarray, label: int | None = None) -> "pb.Datum":
    """Caffe's ``CVMatToDatum`` for (C, H, W) arrays: uint8 -> ``data`` bytes, other dtypes ->
    ``float_data``."""
    img = np.asarray(img)
    if img.ndim != 3:
        raise ValueError(f"a Datum holds a (C, H, W) array, got shape {img.shape}")
    d = pb.Datum(channels=img.shape[0], height=img.shape[1], width=img.shape[2])
    if img.dtype == np.uint8:
        d.data = np.ascontiguousarray(img).tobytes()
    else:
        d.float_data.extend(np.asarray(img, np.float32).ravel().tolist())
    if label is not None:
        d.label = int(label)
    return d


def encode_image(img_hwc: np.ndarray, ext: str) -> bytes:
    """``cv::imencode`` of an OpenCV image with the extension's format ('jpg', 'png', ...)."""
    ok, buf = cv().imencode("." + ext.lstrip("."), img_hwc)
    if not ok:
        raise ValueError(f"OpenCV cannot encode an image as '{ext}'")
    return buf.tobytes()


# ------------------------------------------------------------------------------ transform

def _seed_rng() -> np.random.Generator:
    # Seeded from torch's stream, so caffe.set_random_seed / a solver's random_seed fix it.
    return np.random.default_rng(int(torch.randint(0, 2 ** 62, (1,)).item()))


class DataTransformer:
    """Caffe's ``DataTransformer`` for one layer (TransformationParameter, phase).

    ``transform(images)`` maps a list of (C, H, W) arrays (or an (N, C, H, W) array) of one
    shape to float32 (N, C, h, w); ``out`` may be a preallocated (e.g. pinned) array.
    """

    def __init__(self, param=None, phase: int = pb.TEST, rng: np.random.Generator | None = None,
                 who: str = "transform_param"):
        param = param if param is not None else pb.TransformationParameter()
        self.who, self.phase = who, phase
        for field in ("resize_param", "noise_param", "distort_param", "expand_param"):
            if param.HasField(field):
                raise TransformError(f"{who}: {field} (SSD's AnnotatedData augmentation) is not "
                                     "supported by this transformer")
        if param.force_color and param.force_gray:
            raise TransformError(f"{who}: cannot set both force_color and force_gray")
        if param.HasField("mean_file") and len(param.mean_value):
            raise TransformError(f"{who}: cannot specify mean_file and mean_value at the same time")
        self.scale = np.float32(param.scale)
        self.mirror, self.crop = bool(param.mirror), int(param.crop_size)
        self.force_color, self.force_gray = bool(param.force_color), bool(param.force_gray)
        self.mean_file = param.mean_file if param.HasField("mean_file") else None
        self.mean = self._load_mean(self.mean_file) if self.mean_file else None
        self.mean_values = np.asarray(param.mean_value, np.float32)
        self.rng = rng if rng is not None else _seed_rng()
        self._warned_force = False

    def _load_mean(self, path) -> np.ndarray:
        from ..proto.errors import ProtoError
        from ..proto.io import read_binaryproto

        try:
            mean = read_binaryproto(path).astype(np.float32)
        except ProtoError as e:
            raise TransformError(f"{self.who}: cannot load mean_file: {e}") from None
        while mean.ndim > 3 and mean.shape[0] == 1:
            mean = mean[0]
        if mean.ndim == 2:
            mean = mean[None]
        if mean.ndim != 3:
            raise TransformError(f"{self.who}: mean file {path} holds shape {mean.shape}, "
                                 "expected (1, C, H, W)")
        return np.ascontiguousarray(mean)

    # -- shapes ----------------------------------------------------------------------------
    def check(self, shape) -> tuple[int, int, int]:
        """Validate the parameters against an image of ``shape`` (C, H, W); returns the
        transformed item shape (Caffe's ``InferBlobShape`` plus its CHECKs)."""
        c, h, w = (int(d) for d in shape)
        if c <= 0:
            raise TransformError(f"{self.who}: images must have channels, got shape {(c, h, w)}")
        if self.crop and (h < self.crop or w < self.crop):
            raise TransformError(f"{self.who}: crop_size {self.crop} is larger than the "
                                 f"{h}x{w} image")
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise TransformError(
                f"{self.who}: mean file {self.mean_file} has shape {self.mean.shape} but the images "
                f"are {(c, h, w)}; Caffe indexes the mean at the crop offset of the full image, "
                f"so it must match the image (crop_size {self.crop}), not the crop")
        if len(self.mean_values) not in (0, 1, c):
            raise TransformError(f"{self.who}: specify either 1 mean_value or as many as "
                                 f"channels ({c}), got {len(self.mean_values)}")
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    # -- the transform ---------------------------------------------------------------------
    def image(self, datum, key=b"", source="") -> np.ndarray:
        """A Datum's (C, H, W) image, decoded under force_color/force_gray."""
        if not datum.encoded and (self.force_color or self.force_gray) and not self._warned_force:
            log.error("%s: force_color and force_gray only apply to encoded datums", self.who)
            self._warned_force = True
        return datum_to_chw(datum, self.force_color, self.force_gray, key, source)

    def transform(self, images, out: np.ndarray | None = None) -> np.ndarray:
        n = len(images)
        if n == 0:
            raise TransformError(f"{self.who}: there are no images to transform")
        batch = isinstance(images, np.ndarray)     # (N, C, H, W): one shape by construction
        c, H, W = images.shape[1:] if batch else images[0].shape
        c, h, w = self.check((c, H, W))
        for i in range(1, 0 if batch else n):
            if images[i].shape != images[0].shape:
                raise TransformError(f"{self.who}: image {i} of the batch has shape "
                                     f"{images[i].shape}, the first has {images[0].shape}; "
                                     "a batch needs one shape (resize or crop them)")
        if out is None:
            out = np.empty((n, c, h, w), np.float32)
        # Offsets: random per item in TRAIN, centred in TEST (Caffe's Rand(H - crop + 1)).
        if self.crop and self.phase == pb.TRAIN:
            hs = self.rng.integers(0, H - h + 1, n)
            ws = self.rng.integers(0, W - w + 1, n)
            same = bool((hs == hs[0]).all() and (ws == ws[0]).all())
            a, b = int(hs[0]), int(ws[0])
        else:
            a, b, same = (H - h) // 2, (W - w) // 2, True
        flips = self.rng.integers(0, 2, n).astype(bool) if self.mirror else None
        if same and batch:
            x = images[:, :, a:a + h, b:b + w]
        elif batch:                                 # every item's crop in one gather
            x = sliding_window_view(images, (h, w), axis=(2, 3))[np.arange(n), :, hs, ws]
        else:
            # One dtype for the batch that holds every item: a float_data Datum after a byte
            # one keeps its floats (Caffe transforms each Datum on its own).
            x = np.empty((n, c, h, w), np.result_type(*{im.dtype for im in images}))
            for i in range(n):
                ai, bi = (a, b) if same else (hs[i], ws[i])
                x[i] = images[i][:, ai:ai + h, bi:bi + w]
        scale = self.scale != 1
        if self.mean is not None:
            if same:
                mean = self.mean[:, a:a + h, b:b + w]
            else:
                mean = sliding_window_view(self.mean, (h, w), axis=(1, 2))[:, hs, ws]
                mean = mean.transpose(1, 0, 2, 3)      # (C, N, h, w) -> (N, C, h, w)
            np.subtract(x, mean, out=out, dtype=np.float32)
        elif len(self.mean_values):
            np.subtract(x, self.mean_values.reshape(-1, 1, 1), out=out, dtype=np.float32)
        elif scale:         # one pass: the cast to float32 is exact, the product rounds once
            np.multiply(x, self.scale, out=out, dtype=np.float32)
            scale = False
        else:
            out[...] = x
        if scale:
            np.multiply(out, self.scale, out=out)
        if flips is not None and flips.any():
            out[flips] = out[flips][..., ::-1]
        return out
