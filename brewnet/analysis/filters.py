"""What each unit of a layer looks for (owl's FilterVisualizer, done right): for every channel of
a convolution (or InnerProduct) blob, the 9 image patches that activate it most, from 9
different images, each cut from the input at the unit's receptive field (an InnerProduct unit
sees the whole input).

Streaming: per channel a heap of the 9 best (activation, image, patch) so far; an image offers
each channel only its best position, so the 9 come from 9 images. Memory is channels x 9
patches, whatever the number of images.
"""
from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch

from .geometry import receptive_fields
from .heatmap import data_source, undo_transform

TOP = 9


def _patch(img: np.ndarray, field, i: int, j: int) -> np.ndarray:
    """The pixels unit (i, j) sees, zero where its field leaves the image (H x W [x C])."""
    (fy, fx) = field
    y0, x0 = int(fy.start + i * fy.stride), int(fx.start + j * fx.stride)
    h, w = int(fy.size), int(fx.size)
    out = np.zeros((h, w) + img.shape[2:], img.dtype)
    ys, xs = max(y0, 0), max(x0, 0)
    ye, xe = min(y0 + h, img.shape[0]), min(x0 + w, img.shape[1])
    if ye > ys and xe > xs:
        out[ys - y0:ye - y0, xs - x0:xe - x0] = img[ys:ye, xs:xe]
    return out


class TopPatches:
    """The running top-9 per channel of one blob."""

    def __init__(self, channels: int):
        self.heaps: list[list] = [[] for _ in range(channels)]
        self.seen = 0

    def offer(self, channel: int, value: float, image: int, make_patch) -> None:
        heap = self.heaps[channel]
        if len(heap) < TOP:
            heapq.heappush(heap, (value, image, make_patch()))
        elif value > heap[0][0]:
            heapq.heapreplace(heap, (value, image, make_patch()))

    def bar(self) -> np.ndarray:
        """Per channel, what an activation must beat to enter its top 9."""
        return np.array([h[0][0] if len(h) == TOP else -np.inf for h in self.heaps])

    def best(self, channel: int) -> list[tuple[float, int, np.ndarray]]:
        """(activation, image index, patch), strongest first."""
        return sorted(self.heaps[channel], key=lambda e: (-e[0], e[1]))


def scan(net, blob: str, images: int, progress=None) -> TopPatches:
    """Run the TEST net over ``images`` images of its own data and keep each channel's top 9;
    ``progress(n)`` is told after each batch how many images it added."""
    shape = net.shapes[blob]
    data_name, tp = data_source(net)
    field = receptive_fields(net)[blob] if len(shape) == 4 else None
    if len(shape) == 4 and field is None:
        raise ValueError(f"blob '{blob}' has no receptive field on the input (see brewnet shapes)")
    top = TopPatches(shape[1])
    with torch.no_grad():
        while top.seen < images:
            net.forward_tensors()
            before = top.seen
            data = net.blobs[data_name].tensor.float().cpu().numpy()
            acts = net.blobs[blob].tensor.float().cpu().numpy()
            for x, a in zip(data, acts):
                if top.seen >= images:
                    break
                img = undo_transform(x, tp)
                flat = a.reshape(a.shape[0], -1)
                where = flat.argmax(1)
                peaks = flat[np.arange(len(where)), where]
                for c in np.nonzero(peaks > top.bar())[0]:     # only channels it enters
                    if len(shape) == 4:
                        i, j = divmod(int(where[c]), a.shape[2])
                        make = (lambda img=img, i=i, j=j: _patch(img, field, i, j))
                    else:
                        make = (lambda img=img: img.copy())
                    top.offer(c, float(flat[c, where[c]]), top.seen, make)
                top.seen += 1
            if progress is not None:
                progress(top.seen - before)
    return top


def save_grids(top: TopPatches, out: Path, blob: str) -> list[Path]:
    """A 3 x 3 grid PNG per channel and one overview of all channels."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    written = []
    n = len(top.heaps)
    cols = int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / cols))
    overview = Figure(figsize=(1.5 * cols, 1.5 * rows))
    grid = overview.add_gridspec(rows, cols, wspace=0.15, hspace=0.15)
    for c in range(n):
        best = top.best(c)
        fig = Figure(figsize=(4, 4))
        for k, (v, img, patch) in enumerate(best):
            a = fig.add_subplot(3, 3, k + 1)
            a.imshow(patch, cmap="gray" if patch.ndim == 2 else None, vmin=0, vmax=255)
            a.set_title(f"#{img}: {v:.3g}", fontsize=7)
            a.axis("off")
        fig.suptitle(f"{blob} channel {c}", fontsize=9)
        path = out / f"{blob}_{c:04d}.png"
        fig.savefig(path, dpi=80)
        written.append(path)
        sub = grid[c // cols, c % cols].subgridspec(3, 3, wspace=0.02, hspace=0.02)
        for k, (_, _, patch) in enumerate(best):
            a = overview.add_subplot(sub[k // 3, k % 3])
            a.imshow(patch, cmap="gray" if patch.ndim == 2 else None, vmin=0, vmax=255)
            a.axis("off")
    path = out / f"{blob}_overview.png"
    overview.suptitle(f"{blob}: the 9 strongest patches of each channel ({top.seen} images)")
    overview.savefig(path, dpi=80)
    written.append(path)
    return written
