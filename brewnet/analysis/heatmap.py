"""Class-agnostic heatmaps of a blob (owl's HeatmapVisualizer): where in the image a feature map
responds.

For a C x h x w feature blob F of one image: w_c = (max F_c - mean F_c)^2, heatmap = sum_c w_c
F_c (channels that stand out weigh most), resized bilinearly to the network input. ``images``
gives the inputs as a person sees them: a data layer's transform undone (data / scale + mean);
BGR becomes RGB. (Image files through a deploy net: ``brewnet heatmap --images``, which prepares
them with pycaffe's Transformer.)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def heatmap(features: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """owl's rule for one image's (C, h, w) features, resized to ``size`` (H, W)."""
    from ..data.transform import cv

    f = features.reshape(features.shape[0], -1).astype(np.float64)
    w = (f.max(1) - f.mean(1)) ** 2
    hm = (w[:, None] * f).sum(0).reshape(features.shape[1:]).astype(np.float32)
    cv2 = cv()
    return cv2.resize(hm, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)


def undo_transform(data: np.ndarray, tp) -> np.ndarray:
    """A data layer's (C, H, W) input back to an H x W x C image in [0, 255], RGB: Caffe's
    transform is (x - mean) * scale, mean from mean_value or the mean file's crop centre."""
    x = data.astype(np.float64) / (tp.scale if tp.HasField("scale") else 1.0)
    if tp.mean_value:
        means = list(tp.mean_value)
        x += np.array(means if len(means) == x.shape[0] else means[:1] * x.shape[0])[:, None, None]
    elif tp.HasField("mean_file"):
        from ..proto.io import blob_to_array, read_binaryproto

        mean = blob_to_array(read_binaryproto(tp.mean_file))
        mean = mean.reshape(mean.shape[-3:])
        h0 = (mean.shape[1] - x.shape[1]) // 2
        w0 = (mean.shape[2] - x.shape[2]) // 2
        x += mean[:, h0:h0 + x.shape[1], w0:w0 + x.shape[2]]
    return _to_rgb(x)


def _to_rgb(chw: np.ndarray) -> np.ndarray:
    img = np.clip(chw, 0, 255).transpose(1, 2, 0)
    return (img[:, :, ::-1] if img.shape[2] == 3 else img[:, :, 0]).astype(np.uint8)


def data_source(net) -> tuple[str, object]:
    """The net's first data layer's image blob and its transform_param."""
    i = next(i for i, b in enumerate(net.bottom_lists) if not b)
    return net.top_lists[i][0], net.layer_list[i].param.transform_param


def from_net(net, blob: str, iterations: int):
    """Yield (RGB image, heatmap) for every image of ``iterations`` batches of the net's own
    TEST data (its first data layer's transform is undone for display)."""
    data_name, tp = data_source(net)
    with torch.no_grad():
        for _ in range(iterations):
            net.forward_tensors()
            data = net.blobs[data_name].tensor.float().cpu().numpy()
            feats = net.blobs[blob].tensor.float().cpu().numpy()
            for x, f in zip(data, feats):
                yield undo_transform(x, tp), heatmap(f, x.shape[1:])


def save_pictures(pairs, out: Path, blob: str, name: str = "heatmap_{:04d}.png",
                  sheet: bool = True) -> list[Path]:
    """One picture per image (input, heatmap, overlay), named ``name.format(index)`` (its
    extension picks the format: owl wrote ``{}.jpg``), and a contact sheet of the overlays."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    written, shown = [], []
    for k, (img, hm) in enumerate(pairs):
        fig = Figure(figsize=(9, 3.2))
        axes = fig.subplots(1, 3)
        cmap = "gray" if img.ndim == 2 else None
        axes[0].imshow(img, cmap=cmap)
        axes[0].set_title("input")
        axes[1].imshow(hm, cmap="jet")
        axes[1].set_title(f"heatmap of {blob}")
        axes[2].imshow(img, cmap=cmap)
        axes[2].imshow(hm, cmap="jet", alpha=0.5)
        axes[2].set_title("overlay")
        for a in axes:
            a.axis("off")
        path = out / name.format(k)
        fig.savefig(path, dpi=80, bbox_inches="tight")
        written.append(path)
        if sheet:
            shown.append((img, hm))
    if shown:
        cols = min(8, len(shown))
        rows = (len(shown) + cols - 1) // cols
        fig = Figure(figsize=(2 * cols, 2 * rows))
        for k, (img, hm) in enumerate(shown):
            a = fig.add_subplot(rows, cols, k + 1)
            a.imshow(img, cmap="gray" if img.ndim == 2 else None)
            a.imshow(hm, cmap="jet", alpha=0.5)
            a.axis("off")
        path = out / "contact_sheet.png"
        fig.savefig(path, dpi=80, bbox_inches="tight")
        written.append(path)
    return written
