"""pycaffe's ``caffe.Detector`` (R-CNN style windowed detection): each window of an image is
cropped, optionally with surrounding context, warped to the net's input and classified.

Differs from pycaffe: its context crop slices with the floats ``np.round`` returns, which
Python 3's numpy refuses; here the same box is used as ints, and the builtin ``round`` of
pycaffe's Python 2 (halves away from zero) is kept for the padding and the crop sizes.
"""
from __future__ import annotations

import math

import numpy as np

from ..proto import caffe_pb2 as pb
from . import io
from .classifier import deploy_transformer
from .net import Net


def _round(x: float) -> int:
    """Python 2's ``round``: halves away from zero."""
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


class Detector(Net):
    """``Detector(model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
    channel_swap=None, context_pad=None)``: ``context_pad`` pixels of the (square) net input
    show the window's surroundings, as in R-CNN's feature extraction."""

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        super().__init__(model_file, pb.TEST, weights=pretrained_file)
        self.transformer = deploy_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows) -> list[dict]:
        """``[(image filename, [(ymin, xmin, ymax, xmax), ...]), ...]`` ->
        ``[{'window', 'prediction', 'filename'}]``, one per window in order; ``prediction`` is
        the first output's row for the window's crop."""
        images_windows = [(f, list(ws)) for f, ws in images_windows]
        crops = []
        for fname, windows in images_windows:
            image = io.load_image(fname).astype(np.float32)
            crops += [self.crop(image, w) for w in windows]
        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, c) for c in crops]).astype(np.float32)
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        out, ix = [], 0
        for fname, windows in images_windows:
            for w in windows:
                out.append({"window": w, "prediction": predictions[ix], "filename": fname})
                ix += 1
        return out

    def detect_selective_search(self, image_fnames):
        """Windows from Selective Search (pycaffe calls the MATLAB-backed
        ``selective_search_ijcv_with_python``), then ``detect_windows``."""
        import os

        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise NotImplementedError(
                "detect_selective_search needs the selective_search_ijcv_with_python module "
                "(github.com/sergeyk/selective_search_ijcv_with_python, which runs MATLAB); it "
                "is not installed. Compute windows another way and call detect_windows") from None
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows))

    def crop(self, im, window) -> np.ndarray:
        """The window (ymin, xmin, ymax, xmax; the max row and column excluded, as pycaffe
        slices) of an H x W x K image. With ``context_pad``: the box scaled about its centre by
        size / (size - 2 * context_pad), clipped to the image, warped so the window fills the
        input less the pad, and placed on a ``crop_mean`` canvas of the input's size."""
        window = np.asarray(window)
        crop = im[window[0]:window[2], window[1]:window[3]]
        if not self.context_pad:
            return crop
        size = self.blobs[self.inputs[0]].shape[3]          # assumes square, as pycaffe
        scale = size / (1.0 * size - self.context_pad * 2)
        half_h = (window[2] - window[0] + 1) / 2.0
        half_w = (window[3] - window[1] + 1) / 2.0
        centre = (window[0] + half_h, window[1] + half_w)
        box = np.round(np.tile(centre, 2) + scale * np.array((-half_h, -half_w, half_h, half_w)))
        scale_h = size / (box[2] - box[0] + 1)
        scale_w = size / (box[3] - box[1] + 1)
        pad_y = _round(max(0, -box[0]) * scale_h)            # how far the box leaves the image
        pad_x = _round(max(0, -box[1]) * scale_w)
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h, clip_w = box[2] - box[0] + 1, box[3] - box[1] + 1
        y0, x0, y1, x1 = (int(v) for v in box)
        if y1 <= y0 or x1 <= x0:       # pycaffe's assert lets an empty slice through
            raise ValueError(f"window {tuple(window)} lies outside the {im_h}x{im_w} image")
        crop_h = min(_round(clip_h * scale_h), size - pad_y)
        crop_w = min(_round(clip_w * scale_w), size - pad_x)
        context = io.resize_image(im[y0:y1, x0:x1], (crop_h, crop_w))
        crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context
        return crop

    def configure_crop(self, context_pad) -> None:
        """Set ``crop_dims`` (the input as H x W x K) and ``context_pad``; with a pad, the
        ``crop_mean`` that fills the context outside the image: the transformer's mean taken
        back to image space (transpose and channel swap undone, divided by raw_scale)."""
        in_ = self.inputs[0]
        tpose = self.transformer.transpose[in_]
        inv = [tpose[t] for t in tpose]
        self.crop_dims = np.array(self.blobs[in_].shape[1:])[inv]
        self.context_pad = context_pad
        if not context_pad:
            return
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
            return
        crop_mean = np.array(mean, dtype=np.float64).transpose(inv)
        order = self.transformer.channel_swap.get(in_)
        if order is not None:
            order = list(order)
            crop_mean = crop_mean[:, :, [order.index(i) for i in range(crop_mean.shape[2])]]
        raw_scale = self.transformer.raw_scale.get(in_)
        if raw_scale is not None:
            crop_mean = crop_mean / raw_scale
        self.crop_mean = crop_mean
