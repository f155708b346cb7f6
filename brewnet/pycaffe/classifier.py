"""pycaffe's ``caffe.Classifier``: a TEST net that takes H x W x K images and returns class
scores, averaging the 10 oversampled crops (4 corners + centre, and their mirrors) or using the
centre crop only."""
from __future__ import annotations

import numpy as np

from ..proto import caffe_pb2 as pb
from . import io
from .net import Net


def deploy_transformer(net, mean=None, input_scale=None, raw_scale=None, channel_swap=None):
    """pycaffe's Classifier/Detector set-up: an ``io.Transformer`` for the net's first input,
    HWC images to CHW, with whichever of the four settings were given."""
    in_ = net.inputs[0]
    t = io.Transformer({in_: net.blobs[in_].shape})
    t.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        t.set_mean(in_, mean)
    if input_scale is not None:
        t.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        t.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        t.set_channel_swap(in_, channel_swap)
    return t


class Classifier(Net):
    """``Classifier(model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
    raw_scale=None, channel_swap=None)``; ``mean`` is per channel (K,) or K x H x W."""

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None):
        super().__init__(model_file, pb.TEST, weights=pretrained_file)
        in_ = self.inputs[0]
        self.transformer = deploy_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].shape[2:])
        self.image_dims = np.array(image_dims if image_dims is not None else self.crop_dims)

    def predict(self, inputs, oversample: bool = True) -> np.ndarray:
        """Scores (N x classes) for a list of H x W x K images (float, as ``io.load_image``)."""
        in_ = self.inputs[0]
        data = prepare(self.transformer, in_, inputs, self.image_dims, self.crop_dims, oversample)
        scores = self.forward_all(**{in_: data})[self.outputs[0]]
        if oversample:
            scores = scores.reshape(len(scores) // 10, 10, -1).mean(1)
        return scores.reshape(len(inputs), -1)


def prepare(transformer, in_, images, image_dims, crop_dims, oversample: bool) -> np.ndarray:
    """Classifier.predict's net input: each image resized to ``image_dims``, then its 10
    oversampled crops (image by image, oversample's order) or its centre crop, each through the
    transformer: (N * views, K, crop_h, crop_w) float32."""
    image_dims, crop_dims = np.asarray(image_dims), np.asarray(crop_dims)
    resized = np.stack([io.resize_image(im, image_dims) for im in images])
    if oversample:
        crops = io.oversample(resized, crop_dims)
    else:
        h, w = (image_dims - crop_dims) // 2
        crops = resized[:, h:h + crop_dims[0], w:w + crop_dims[1], :]
    return np.stack([transformer.preprocess(in_, c) for c in crops]).astype(np.float32)
