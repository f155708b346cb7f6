"""pycaffe's ``caffe.io``: BlobProto/Datum <-> array conversions, image loading and resizing,
oversampling, and the ``Transformer`` that prepares images for a net's input blob.

Same names, arguments and results as pycaffe; images are decoded with OpenCV instead of
scikit-image (load_image still gives RGB floats in [0, 1]); resize_image computes pycaffe's
scikit-image rule with numpy (see its docstring).
"""
from __future__ import annotations

import numpy as np

from ..data.transform import cv
from ..proto import caffe_pb2
from ..proto.io import array_to_blob

__all__ = ["blobproto_to_array", "array_to_blobproto", "arraylist_to_blobprotovector_str",
           "blobprotovector_str_to_arraylist", "array_to_datum", "datum_to_array", "Transformer",
           "load_image", "resize_image", "oversample"]


# ---------------------------------------------------------------- proto / datum / ndarray

def blobproto_to_array(blob, return_diff: bool = False) -> np.ndarray:
    """The blob's data (or diff) as float64, shaped by the legacy num/channels/height/width
    when any is set, else by ``shape.dim`` (a blob with neither is a scalar)."""
    values = blob.diff if return_diff else blob.data
    if not len(values):
        values = blob.double_diff if return_diff else blob.double_data
    arr = np.array(values, dtype=np.float64)
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        return arr.reshape(blob.num, blob.channels, blob.height, blob.width)
    return arr.reshape(tuple(blob.shape.dim))


def array_to_blobproto(arr, diff=None) -> "caffe_pb2.BlobProto":
    """A BlobProto with ``shape.dim`` = arr.shape and the values as float32 ``data``/``diff``."""
    return array_to_blob(np.asarray(arr), None if diff is None else np.asarray(diff))


def arraylist_to_blobprotovector_str(arraylist) -> bytes:
    """A serialized BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(s: bytes) -> list[np.ndarray]:
    """The arrays of a serialized BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(s)
    return [blobproto_to_array(b) for b in vec.blobs]


def array_to_datum(arr, label=None) -> "caffe_pb2.Datum":
    """A Datum from a (C, H, W) array: uint8 arrays go to ``data`` bytes, others to
    ``float_data``."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError("Incorrect array shape.")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(arr.astype(float).flat)
    if label is not None:
        datum.label = int(label)
    return datum


def datum_to_array(datum) -> np.ndarray:
    """A Datum's (C, H, W) array (uint8 for byte data, float64 for float_data); the label is
    ``datum.label``. Encoded datums: decode ``datum.data`` with OpenCV first."""
    shape = (datum.channels, datum.height, datum.width)
    if len(datum.data):
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    return np.array(datum.float_data).astype(float).reshape(shape)


# -------------------------------------------------------------------------- pre-processing

class Transformer:
    """Prepares (H, W, K) images for net input blobs: ``Transformer({name: blob shape})``.

    ``preprocess`` does, in order: float32, resize to the blob's H x W, transpose, channel
    swap, ``*= raw_scale``, ``-= mean``, ``*= input_scale``; ``deprocess`` inverts it.
    """

    def __init__(self, inputs):
        self.inputs = {k: tuple(v) for k, v in inputs.items()}
        self.transpose, self.channel_swap = {}, {}
        self.raw_scale, self.mean, self.input_scale = {}, {}, {}

    def __check_input(self, in_):
        if in_ not in self.inputs:
            raise Exception(f"{in_} is not one of the net inputs: {self.inputs}")

    def preprocess(self, in_, data) -> np.ndarray:
        """(H', W', K) image -> (K, H, W) float32 array for input ``in_``."""
        self.__check_input(in_)
        caffe_in = np.array(data, dtype=np.float32)     # a copy: the steps below are in place
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if in_ in self.transpose:
            caffe_in = caffe_in.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            caffe_in = caffe_in[list(self.channel_swap[in_]), :, :]
        if in_ in self.raw_scale:
            caffe_in *= self.raw_scale[in_]
        if in_ in self.mean:
            caffe_in -= self.mean[in_]
        if in_ in self.input_scale:
            caffe_in *= self.input_scale[in_]
        return caffe_in

    def deprocess(self, in_, data) -> np.ndarray:
        """Invert ``preprocess`` (except the resize) for a (1, K, H, W) or (K, H, W) array."""
        self.__check_input(in_)
        decaf_in = np.array(data, copy=True).squeeze()
        if in_ in self.input_scale:
            decaf_in /= self.input_scale[in_]
        if in_ in self.mean:
            decaf_in += self.mean[in_]
        if in_ in self.raw_scale:
            decaf_in /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            decaf_in = decaf_in[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            decaf_in = decaf_in.transpose(np.argsort(self.transpose[in_]))
        return decaf_in

    def set_transpose(self, in_, order):
        """Axis order from the image's (H, W, K) to the blob's, e.g. (2, 0, 1)."""
        self.__check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise Exception("Transpose order needs to have the same number of dimensions as the input.")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order):
        """Channel order after the transpose, e.g. (2, 1, 0) for RGB -> BGR."""
        self.__check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise Exception("Channel swap needs to have the same number of dimensions as the "
                            "input channels.")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale):
        """Scale applied before the mean: 255 for models trained on [0, 255] images."""
        self.__check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """Mean to subtract: per channel (K,) or elementwise (K, H, W) / (H, W)."""
        self.__check_input(in_)
        mean = np.asarray(mean)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError("Mean shape invalid")
            if ms != self.inputs[in_][1:]:
                raise ValueError("Mean shape incompatible with input shape.")
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Scale applied after the mean subtraction."""
        self.__check_input(in_)
        self.input_scale[in_] = scale


# ------------------------------------------------------------------------------- image IO

_GRAY = np.array([0.2125, 0.7154, 0.0721])   # scikit-image's rgb2gray weights (R, G, B)


def load_image(filename, color: bool = True) -> np.ndarray:
    """An image file as float32 in [0, 1]: (H, W, 3) RGB, or (H, W, 1) intensity when
    ``color`` is False (colour files are converted with scikit-image's luminance weights)."""
    raw = cv().imread(str(filename), cv().IMREAD_UNCHANGED)
    if raw is None:
        raise IOError(f"could not open or decode image file {filename}")
    return _as_float(raw, color)


def decode_image(data: bytes, color: bool = True) -> np.ndarray:
    """``load_image`` of an encoded image held in memory (JPEG, PNG...)."""
    raw = cv().imdecode(np.frombuffer(data, np.uint8), cv().IMREAD_UNCHANGED)
    if raw is None:
        raise IOError("could not decode the image")
    return _as_float(raw, color)


def _as_float(raw: np.ndarray, color: bool) -> np.ndarray:
    img = raw.astype(np.float64) / np.iinfo(raw.dtype).max if raw.dtype.kind == "u" else raw.astype(np.float64)
    if img.ndim == 3:
        img = img[:, :, 2::-1] if img.shape[2] >= 3 else img[:, :, :1]   # BGR(A) -> RGB
        if not color:
            img = img @ _GRAY if img.shape[2] == 3 else img[:, :, 0]
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    return np.ascontiguousarray(img, dtype=np.float32)


def resize_image(im, new_dims, interp_order: int = 1) -> np.ndarray:
    """(H, W, K) -> (new_dims[0], new_dims[1], K) float32, by pycaffe's rule.

    1 or 3 channels (pycaffe's skimage path): the image is scaled to [0, 1] by its min and max,
    resized as scikit-image's ``resize(order, mode='constant')`` of the versions pycaffe was
    written for (< 0.15) and scaled back. Output pixel i samples the input at
    ``(i + 0.5) * H / H' - 0.5``; order 1 is bilinear between the 4 neighbours, order 0 the
    nearest (rounded half away from zero), and a neighbour outside the image reads 0 — after
    the scaling, the image's minimum: enlarged edges fade towards it. No anti-aliasing when
    shrinking: scikit-image >= 0.15 Gaussian-smooths first (``anti_aliasing`` defaults to
    True), which changes pycaffe's numbers; brewnet keeps the rule pycaffe's results were
    made with. Other channel counts (pycaffe's ``scipy.ndimage.zoom`` path): the corners map to
    the corners, ``i * (H - 1) / (H' - 1)``, no border term. A constant image stays constant.
    Differs from pycaffe: orders 2-3 (spline) use OpenCV's bicubic.
    """
    im = np.asarray(im)
    if interp_order not in (0, 1, 2, 3):
        raise ValueError(f"interp_order must be 0..3, got {interp_order}")
    h, w = int(new_dims[0]), int(new_dims[1])
    if (h, w) == im.shape[:2] and interp_order <= 1:
        # every output pixel samples its own centre: the identity (the [0, 1] scaling and
        # back round in float64, far below float32's precision)
        return im.astype(np.float32)
    im_min, im_max = im.min(), im.max()
    if im_max == im_min:
        return np.full((h, w, im.shape[-1]), im_min, dtype=np.float32)
    if interp_order > 1:
        src = im.astype(np.float32)     # OpenCV takes at most 512 channels per call
        parts = [cv().resize(src[:, :, k:k + 512], (w, h), interpolation=cv().INTER_CUBIC)
                 for k in range(0, im.shape[-1], 512)]
        return np.concatenate([p[:, :, None] if p.ndim == 2 else p for p in parts], axis=2)
    x = im.astype(np.float64)
    skimage = im.shape[-1] in (1, 3)
    if skimage:
        x = (x - im_min) / (im_max - im_min)
    out = _resample(x, 0, h, interp_order, skimage)
    out = _resample(out, 1, w, interp_order, skimage)
    if skimage:
        out = out * (im_max - im_min) + im_min
    return out.astype(np.float32)


def _resample(x: np.ndarray, axis: int, m: int, order: int, half_pixel: bool) -> np.ndarray:
    """Resample ``axis`` of ``x`` to m samples: skimage's half-pixel map with zeros outside
    (``half_pixel``), else ndimage.zoom's corner-to-corner map."""
    n = x.shape[axis]
    i = np.arange(m, dtype=np.float64)
    if half_pixel:
        pos = (i + 0.5) * (n / m) - 0.5
    else:
        pos = i * ((n - 1) / (m - 1)) if m > 1 else np.zeros(1)
    if order == 0:
        taps = [(np.where(pos >= 0, np.floor(pos + 0.5), np.ceil(pos - 0.5)), np.ones(m))]  # C round()
    else:
        j0 = np.floor(pos)
        taps = [(j0, 1.0 - (pos - j0)), (j0 + 1, pos - j0)]
    shape = [1] * x.ndim
    shape[axis] = m
    out = 0.0
    for j, wt in taps:
        j = j.astype(np.int64)
        inside = (j >= 0) & (j < n)
        wt = np.where(inside, wt, 0.0).reshape(shape)
        out = out + np.take(x, np.clip(j, 0, n - 1), axis=axis) * wt
    return out


def oversample(images, crop_dims) -> np.ndarray:
    """The four corner crops and the centre crop of each (H, W, K) image, then their mirrors:
    (10 * N, crop_h, crop_w, K) float32."""
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    im_center = im_shape[:2] / 2.0
    corners = [(i, j) for i in (0, im_shape[0] - crop_dims[0]) for j in (0, im_shape[1] - crop_dims[1])]
    centre = (im_center - crop_dims / 2.0).astype(int)
    starts = corners + [tuple(centre)]
    crops = np.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]), dtype=np.float32)
    for n, im in enumerate(images):
        for k, (i, j) in enumerate(starts):
            crops[10 * n + k] = im[i:i + crop_dims[0], j:j + crop_dims[1], :]
        crops[10 * n + 5:10 * n + 10] = crops[10 * n:10 * n + 5, :, ::-1, :]
    return crops
