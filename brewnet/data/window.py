"""WindowData: R-CNN's window sampler (foreground/background windows warped to crop_size).

Window file, repeated per image: a ``# image_index`` line, then one line each for image_path,
channels, height, width and num_windows, then num_windows lines ``class_index overlap x1 y1 x2
y2`` (pixel corners inclusive). Windows with overlap >= fg_threshold are foreground (class > 0
required), < bg_threshold are background (label 0); the rest are dropped.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..layers.base import LayerError
from ..layers.registry import register
from .source import Loader, Prefetching
from .transform import _seed_rng, cv, decode_image, read_image

f32 = np.float32


def _round(x) -> int:
    # C's round(): halves away from zero (Python's round() goes to even).
    x = float(x)
    return int(np.floor(abs(x) + 0.5)) * (1 if x >= 0 else -1)


def parse_window_file(path, root: str, fg_threshold: float, bg_threshold: float, who: str):
    """-> (images [(path, channels, height, width)], fg windows, bg windows); a window is
    (image_index, label, overlap, x1, y1, x2, y2)."""
    try:
        tokens = Path(path).read_text().split()
    except OSError as e:
        raise LayerError(f"{who}: failed to open window file {path}: {e.strerror or e}") from None
    if not tokens:
        raise LayerError(f"{who}: window file {path} is empty")
    images, fg, bg, i = [], [], [], 0
    try:
        while i < len(tokens):
            if tokens[i] != "#":
                raise LayerError(f"{who}: window file {path}: expected '#' before image "
                                 f"{len(images)}, got {tokens[i]!r}")
            index, name = int(tokens[i + 1]), tokens[i + 2]
            c, h, w, n = (int(t) for t in tokens[i + 3:i + 7])
            images.append((root + name, c, h, w))
            i += 7
            for _ in range(n):
                label, overlap = int(tokens[i]), float(tokens[i + 1])
                x1, y1, x2, y2 = (int(t) for t in tokens[i + 2:i + 6])
                i += 6
                if overlap >= fg_threshold:
                    if label <= 0:
                        raise LayerError(f"{who}: window file {path}: image {index} has a "
                                         f"foreground window of class {label}; classes start at 1")
                    fg.append((index, label, overlap, x1, y1, x2, y2))
                elif overlap < bg_threshold:
                    bg.append((index, 0, 0.0, x1, y1, x2, y2))
    except (IndexError, ValueError):
        raise LayerError(f"{who}: window file {path} is truncated or malformed near token "
                         f"{i} (image {len(images) - 1})") from None
    return images, fg, bg


class _WindowLoader(Loader):
    def __init__(self, layer_name, images, fg, bg, batch_size, channels, crop, mirror, context_pad,
                 square, fg_fraction, scale, mean, mean_values, cache):
        self.name, self.images, self.fg, self.bg = layer_name, images, fg, bg
        self.batch_size, self.channels, self.crop = batch_size, channels, crop
        self.mirror, self.context_pad, self.square = mirror, context_pad, square
        self.num_fg = int(f32(batch_size) * f32(fg_fraction))
        self.scale, self.mean, self.mean_values = f32(scale), mean, mean_values
        self.cache = cache
        self.rng = _seed_rng()

    def image(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self.images):
            raise OSError(f"window refers to image {index}; the window file lists {len(self.images)}")
        if self.cache is not None:
            img = decode_image(self.cache[index], True)
            if img is None:
                raise OSError(f"could not decode cached image {self.images[index][0]}")
            return img
        return read_image(self.images[index][0], color=True)

    def next_batch(self):
        bs, crop = self.batch_size, self.crop
        data_t, labels_t = self.alloc((bs, self.channels, crop, crop)), self.alloc((bs,))
        data, labels = data_t.numpy(), labels_t.numpy()
        data[...] = 0
        item = 0
        for pool, count in ((self.bg, bs - self.num_fg), (self.fg, self.num_fg)):
            for _ in range(count):
                window = pool[int(self.rng.integers(len(pool)))]
                do_mirror = self.mirror and bool(self.rng.integers(2))
                self._fill(data[item], window, do_mirror)
                labels[item] = window[1]
                item += 1
        return [data_t, labels_t]

    def _fill(self, out: np.ndarray, window, do_mirror: bool) -> None:
        img = self.image(window[0])
        rows, cols = img.shape[:2]
        crop, pad = self.crop, self.context_pad
        x1, y1, x2, y2 = window[3:]
        size_w = size_h = crop
        pad_w = pad_h = 0
        if pad > 0 or self.square:
            # Grow the box so that, warped to crop x crop, it has ``pad`` pixels of context.
            context_scale = f32(crop) / f32(crop - 2 * pad)
            half_h, half_w = f32((y2 - y1 + 1) / 2.0), f32((x2 - x1 + 1) / 2.0)
            cx, cy = f32(x1) + half_w, f32(y1) + half_h
            if self.square:
                half_h = half_w = max(half_h, half_w)
            x1, x2 = _round(cx - half_w * context_scale), _round(cx + half_w * context_scale)
            y1, y2 = _round(cy - half_h * context_scale), _round(cy + half_h * context_scale)
            unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
            px1, py1 = max(0, -x1), max(0, -y1)
            px2, py2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
            x1, x2, y1, y2 = x1 + px1, x2 - px2, y1 + py1, y2 - py2
            sx, sy = f32(crop) / f32(unclipped_w), f32(crop) / f32(unclipped_h)
            size_w, size_h = _round(f32(x2 - x1 + 1) * sx), _round(f32(y2 - y1 + 1) * sy)
            px1, px2 = _round(f32(px1) * sx), _round(f32(px2) * sx)
            py1 = _round(f32(py1) * sy)
            pad_h, pad_w = py1, (px2 if do_mirror else px1)
            size_h, size_w = min(size_h, crop - pad_h), min(size_w, crop - pad_w)
        if not (0 <= x1 <= x2 < cols and 0 <= y1 <= y2 < rows):
            raise OSError(f"window {window[3:]} lies outside the {cols}x{rows} image "
                          f"{self.images[window[0]][0]}")
        if size_w <= 0 or size_h <= 0:
            return
        warped = cv().resize(img[y1:y2 + 1, x1:x2 + 1], (size_w, size_h), interpolation=cv().INTER_LINEAR)
        if warped.ndim == 2:
            warped = warped[:, :, None]
        if do_mirror:
            warped = warped[:, ::-1]
        chw = warped.transpose(2, 0, 1)
        region = out[:, pad_h:pad_h + size_h, pad_w:pad_w + size_w]
        if self.mean is not None:
            off = (self.mean.shape[2] - crop) // 2
            m = self.mean[:, off + pad_h:off + pad_h + size_h, off + pad_w:off + pad_w + size_w]
            np.subtract(chw, m, out=region, dtype=np.float32)
        elif len(self.mean_values):
            np.subtract(chw, self.mean_values.reshape(-1, 1, 1), out=region, dtype=np.float32)
        else:
            region[...] = chw
        np.multiply(region, self.scale, out=region)


@register("WindowData")
class WindowData(Prefetching):
    """R-CNN windows: each batch holds batch_size*(1-fg_fraction) background windows, then
    the foreground ones, each cut from its BGR image (grown by context_pad, or squared for
    crop_mode "square"), warped bilinearly to crop_size, randomly mirrored, with
    ``(pixel - mean) * window_data_param.scale`` (Caffe reads this layer's scale there, not
    from transform_param); area outside the image stays 0.
    Shapes: none -> data (batch_size, channels, crop, crop), label (batch_size,).
    Params: window_data_param {source, batch_size, fg_threshold, bg_threshold, fg_fraction,
    context_pad, crop_mode, cache_images, root_folder, scale}, transform_param {crop_size,
    mirror, mean_file | mean_value}; data_param.prefetch sets the queue depth."""

    exact_tops = 2

    def setup(self, bottom_shapes):
        p, t = self.param.window_data_param, self.param.transform_param
        who = f"Layer '{self.name}' (type WindowData)"
        if p.batch_size <= 0:
            raise self.fail(f"batch_size must be positive, got {p.batch_size}")
        if t.crop_size <= 0:
            raise self.fail("transform_param.crop_size must be positive (the warped size)")
        if 2 * p.context_pad >= t.crop_size:
            raise self.fail(f"context_pad {p.context_pad} leaves nothing of crop_size {t.crop_size}")
        if p.crop_mode not in ("warp", "square"):
            raise self.fail(f"crop_mode must be 'warp' or 'square', got {p.crop_mode!r}")
        images, fg, bg = parse_window_file(p.source, p.root_folder, p.fg_threshold,
                                           p.bg_threshold, who)
        if not fg or not bg:
            raise self.fail(f"window file {p.source} yields {len(fg)} foreground and {len(bg)} "
                            "background windows; both kinds are needed")
        channels = images[-1][1]
        mean, values = None, np.asarray(t.mean_value, np.float32)
        if t.HasField("mean_file"):
            if len(values):
                raise self.fail("cannot specify mean_file and mean_value at the same time")
            from ..proto.io import read_binaryproto

            mean = read_binaryproto(t.mean_file).astype(np.float32)
            mean = mean.reshape(mean.shape[-3:]) if mean.ndim >= 3 else mean
            if mean.ndim != 3 or mean.shape[0] != channels or min(mean.shape[1:]) < t.crop_size:
                raise self.fail(f"mean file {t.mean_file} has shape {mean.shape}; it needs "
                                f"{channels} channels and at least crop_size {t.crop_size} "
                                "rows and columns")
        if len(values) not in (0, 1, channels):
            raise self.fail(f"specify either 1 mean_value or as many as channels ({channels})")
        cache = None
        if p.cache_images:
            try:
                cache = [Path(path).read_bytes() for path, *_ in images]
            except OSError as e:
                raise self.fail(f"could not open or find file: {e}") from None
        loader = _WindowLoader(self.name, images, fg, bg, p.batch_size, channels, t.crop_size,
                               t.mirror, p.context_pad, p.crop_mode == "square",
                               p.fg_fraction, p.scale, mean, values, cache)
        self.shapes = [(p.batch_size, channels, t.crop_size, t.crop_size), (p.batch_size,)]
        self.start_loader(loader, self.param.data_param)

    def reshape(self, bottom_shapes):
        return list(self.shapes)
