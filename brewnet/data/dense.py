"""SegNet's DenseImageData (caffe-segnet): an image and its dense label map per list entry.

The fork's semantics, read from alexgkendall/caffe-segnet 344c113
(src/caffe/layers/dense_image_data_layer.cpp, util/io.cpp, data_transformer.cpp): the list is
read as whitespace-separated tokens taken in pairs (``infile >> image >> label``); the image is
read as ImageData reads it (colour or gray, bilinear resize to new_height x new_width), the label
image in gray with a nearest-neighbour resize; a random horizontal flip of both (``mirror``) and
a random crop_height x crop_width window of both, in either phase; then the data goes through
transform_param (mean, scale) and the label keeps its pixel values (no mean, no scale).
The machinery (list position, shuffling, prefetching, the records each batch came from) is
ImageData's (layers.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..layers.registry import register
from .convert import ListError
from .layers import _ImageLoader, open_list
from .source import Prefetching, check_batch, layer_error
from .transform import TransformError, hwc_to_chw, read_image


def read_pairs(path) -> list[tuple[str, str, int]]:
    """The fork's list: tokens in pairs, across lines as ``operator>>`` reads them ->
    [(image, label image, line number of the image)]."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ListError(f"cannot read image list {path}: {e.strerror or e}") from None
    tokens = [(tok, n) for n, line in enumerate(text.splitlines(), 1) for tok in line.split()]
    if len(tokens) % 2:
        tok, n = tokens[-1]
        raise ListError(f"{path} line {n}: image {tok!r} has no label image after it (the list "
                        "holds 'image label-image' pairs)")
    if not tokens:
        raise ListError(f"image list {path} is empty")
    return [(tokens[i][0], tokens[i + 1][0], tokens[i][1]) for i in range(0, len(tokens), 2)]


class _DenseLoader(_ImageLoader):
    """ImageData's loader over (image, label image, line) entries; ``fixed``: the (C, H, W) every
    batch must have (None: each batch takes its image's, the fork's batch-1 reshape)."""

    def __init__(self, lines, list_path, root, size, color, shuffle, batch_size, tf, pos,
                 mirror, crop, fixed=None):
        super().__init__(lines, list_path, root, size, color, shuffle, batch_size, tf, pos)
        self.mirror, self.crop, self.fixed = mirror, crop, fixed

    def read_pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Line ``i``'s image (H, W[, C]) and label image (H, W), as the fork reads them."""
        name, label_name, lineno = self.lines[i]
        try:
            img = read_image(self.root + name, *self.size, color=self.color)
            lab = read_image(self.root + label_name, *self.size, color=False, nearest=True)
        except OSError as e:
            raise OSError(f"{self.list_path} line {lineno}: {e}") from None
        if lab.shape[:2] != img.shape[:2]:
            raise OSError(f"{self.list_path} line {lineno}: input and label image heights and "
                          f"widths must match: image {self.root + name} is {img.shape[0]}x"
                          f"{img.shape[1]}, label {self.root + label_name} {lab.shape[0]}x"
                          f"{lab.shape[1]}")
        return img, lab

    def read(self, i: int) -> np.ndarray:
        return hwc_to_chw(self.read_pair(i)[0])

    def _augment(self, img, lab, lineno):
        # The fork's order per item: the flip's draw, then the crop's two offsets.
        if self.mirror and self.tf.rng.integers(0, 2):
            img, lab = img[:, ::-1], lab[:, ::-1]
        if self.crop:
            ch, cw = self.crop
            h, w = lab.shape
            if h < ch or w < cw:
                raise TransformError(f"{self.list_path} line {lineno}: crop_height x crop_width "
                                     f"{ch}x{cw} is larger than the {h}x{w} image")
            a = int(self.tf.rng.integers(0, h - ch + 1))
            b = int(self.tf.rng.integers(0, w - cw + 1))
            img, lab = img[a:a + ch, b:b + cw], lab[a:a + ch, b:b + cw]
        return img, lab

    def next_batch(self):
        images, labels = [], []
        self.picked = []
        for _ in range(self.batch_size):
            entry = self.lines[self.pos]
            img, lab = self._augment(*self.read_pair(self.pos), entry[2])
            img = hwc_to_chw(img)
            want = self.fixed or (images[0].shape if images else None)
            if want is not None and img.shape != tuple(want):
                raise TransformError(f"{self.list_path} line {entry[2]}: image {entry[0]} gives "
                                     f"{img.shape}, the batch's blob is {tuple(want)}; the fork "
                                     "reshapes per image only at batch_size 1 without resize or "
                                     "crop")
            images.append(img)
            labels.append(lab)
            self.picked.append(entry)
            self.pos += 1
            if self.pos >= len(self.lines):
                self.pos = 0
                if self.shuffle:
                    self.tf.rng.shuffle(self.lines)
        data = self.alloc((self.batch_size,) + self.tf.check(images[0].shape))
        self.tf.transform(images, out=data.numpy())
        label = self.alloc((self.batch_size, 1) + labels[0].shape)
        label.numpy()[:, 0] = np.stack(labels)     # pixel values kept (preserve_pixel_vals)
        return [data, label]


@register("DenseImageData")
class DenseImageData(Prefetching):
    """caffe-segnet's DenseImageData: images and their label images named in a list file
    ('image label-image' pairs), read with OpenCV (image BGR or gray, label gray).
    Shapes: none -> data (batch_size, C, H, W), label (batch_size, 1, H, W); H x W: the first
    image's, new_height x new_width when set, crop_height x crop_width when set. At batch_size 1
    without resize or crop each batch takes its own image's size (the fork's reshape).
    Params: dense_image_data_param {source, batch_size, rand_skip, shuffle, new_height,
    new_width, is_color, root_folder, mirror, crop_height, crop_width}; transform_param's mean
    and scale apply to the data only. ``mirror`` flips image and label together and the crop
    takes a random window of both, in TRAIN and TEST alike (as the fork does); transform_param's
    own mirror and crop_size are refused (the fork CHECK-fails on them: they would move the
    image and not its label). data_param.prefetch sets the queue depth.
    Differs from the fork: a list with an unpaired last token is an error (the fork drops it);
    mean_file of dense_image_data_param is parsed and ignored, as the fork does; the random
    draws come from brewnet's seeded stream, not Caffe's."""

    exact_tops = 2

    def setup(self, bottom_shapes):
        p = self.param.dense_image_data_param
        bs = check_batch(self, p.batch_size)
        if (p.crop_height > 0) != (p.crop_width > 0):
            raise self.fail("crop_height and crop_width must be set together (or neither), got "
                            f"{p.crop_height} x {p.crop_width}")
        t = self.param.transform_param
        if t.mirror or t.crop_size:
            raise self.fail("transform_param mirror and crop_size would move the image and not "
                            "its label (caffe-segnet refuses them too); use "
                            "dense_image_data_param's mirror, crop_height and crop_width")
        lines, tf, pos = open_list(self, p, read_pairs, "pairs")
        crop = (p.crop_height, p.crop_width) if p.crop_height > 0 else None
        loader = _DenseLoader(lines, p.source, p.root_folder, (p.new_height, p.new_width),
                              p.is_color, p.shuffle, bs, tf, pos, p.mirror, crop)
        try:
            img, _ = loader.read_pair(pos)
        except OSError as e:
            raise layer_error(self, e) from None
        c, h, w = hwc_to_chw(img).shape
        if crop:
            h, w = crop
        try:
            item = tf.check((c, h, w))
        except TransformError as e:
            raise layer_error(self, e) from None
        if bs > 1 or p.new_height > 0 or crop:
            loader.fixed = item
        self.shapes = [(bs,) + item, (bs, 1) + item[1:]]
        self.start_loader(loader, self.param.data_param)

    def reshape(self, bottom_shapes):
        return list(self.shapes)
