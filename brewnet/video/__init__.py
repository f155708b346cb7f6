"""Video: a net on every frame for a fraction of the cost, by reusing deep features.

The net is cut after the last layer that writes the ``split`` blob: a cheap *low* part (the layers
up to it) and a costly *high* part (the rest), run only on keyframes. Between keyframes the high
part's outputs are the last keyframe's, as they are (``copy``: Clockwork Convnets) or warped to
the current frame by optical flow (``flow``: Deep Feature Flow). Keyframes: ``every:N`` (frames 0,
N, 2N, ...; the frames between run no layer) or ``adaptive:T`` (a keyframe when the ``change`` of
the *measure* blob since the last keyframe passes ``T``, at most ``max_gap`` frames apart; between
keyframes only the layers up to the measure blob run). Frames are BGR uint8 (Caffe's order) from
a video file or a folder of images, resized and transformed as Caffe's DataTransformer, on the
net's device. The flow warp's conventions and the measure's definition: docs/internals.md,
*Design notes by module*.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch

from ..errors import NetError

__all__ = ["VideoNet", "FrameOutput", "read_frames", "split_index", "parse_keyframes", "change",
           "pool_measure", "warp"]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
PROPAGATIONS = ("copy", "flow")
FLOW_PRESETS = {"ultrafast": 0, "fast": 1, "medium": 2}     # cv2.DISOPTICAL_FLOW_PRESET_*


class FrameOutput(NamedTuple):
    """One frame's result: its index, the output blobs, and whether the net ran on it."""
    index: int
    outputs: dict            # output blob name -> tensor (1, ...) on the net's device
    is_keyframe: bool


# -- frames -----------------------------------------------------------------------------------
def frame_count(source) -> int | None:
    """The number of frames ``source`` holds (a folder: exact; a video: what its header says)."""
    import cv2

    path = Path(source)
    if path.is_dir():
        return len(_image_files(path))
    cap = cv2.VideoCapture(str(path))
    n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) if cap.isOpened() else 0
    cap.release()
    return n or None


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def read_frames(source, limit: int | None = None) -> Iterator[np.ndarray]:
    """BGR uint8 frames (H, W, 3) of a video file or a folder of images, at most ``limit``.
    A missing path, a file OpenCV cannot open or decode, or a folder without images is an
    error naming it (raised at the first ``next``)."""
    import cv2

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{source}: no such video file or frames folder")
    if path.is_dir():
        files = _image_files(path)
        if not files:
            raise ValueError(f"{source}: the frames folder holds no image "
                             f"({', '.join(IMAGE_SUFFIXES)})")
        for k, f in enumerate(files[:limit]):
            img = cv2.imread(str(f), cv2.IMREAD_COLOR)
            if img is None:
                raise ValueError(f"{f}: frame {k} of {source}: OpenCV cannot decode this image")
            yield img
        return
    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise ValueError(f"{source}: OpenCV cannot open this video (not a video file, or "
                             "no decoder for its format)")
        k = 0
        while limit is None or k < limit:
            ok, img = cap.read()
            if not ok:
                if k == 0:
                    raise ValueError(f"{source}: OpenCV opened the video but decoded no frame")
                return
            yield img
            k += 1
    finally:
        cap.release()


# -- the split ----------------------------------------------------------------------------------
def split_index(net, blob: str) -> int:
    """The index of the last layer writing ``blob``, after checking that every path from the
    inputs to the outputs goes through it: no later layer reads a blob made before it (or an
    input) other than ``blob``, and no net output is made before it."""
    if blob not in net.blobs:
        raise NetError(f"--split: no blob '{blob}' in net '{net.name}'; its blobs are: "
                       f"{', '.join(net.blobs)}")
    k = max(i for i, tops in enumerate(net.top_lists) if blob in tops)
    if k == len(net.layer_list) - 1:
        raise NetError(f"--split: '{blob}' is made by the last layer ('{net.layer_list[k].name}'); "
                       "nothing would be left to run on keyframes only")
    made_before = {}                 # blob -> the layer (before the split) that made it
    for i in range(k + 1):
        for t in net.top_lists[i]:
            made_before[t] = net.layer_list[i].name
    for i in range(k + 1, len(net.layer_list)):
        layer = net.layer_list[i]
        for t in (net.top_lists[i] if layer.type == "Input" else ()):
            made_before[t] = layer.name
        for b in net.bottom_lists[i]:
            if b != blob and b in made_before:
                raise NetError(f"--split '{blob}' is not on every path to the outputs: layer "
                               f"'{layer.name}' (after the split) reads '{b}', made by layer "
                               f"'{made_before[b]}' before it; split at a blob every path "
                               "crosses (e.g. after the layer that merges the branches)")
        for t in net.top_lists[i]:
            made_before.pop(t, None)
    early = [o for o in net.outputs if o in made_before and o != blob]
    if early:
        raise NetError(f"--split '{blob}' is not on every path to the outputs: output "
                       f"'{early[0]}' is made by layer '{made_before[early[0]]}' before the split")
    return k


# -- keyframe policies ----------------------------------------------------------------------------
def change(low: torch.Tensor, key_low: torch.Tensor) -> float:
    """The adaptive measure: ``mean|low - key_low| / mean|key_low|`` (the measure blob on this
    frame and on the last keyframe)."""
    return float((low - key_low).abs().mean() / key_low.abs().mean().clamp_min(1e-12))


def pool_measure(low: torch.Tensor, stride: int) -> torch.Tensor:
    """The measure blob averaged over ``stride`` x ``stride`` cells (N x C x H x W; as is
    otherwise or for a stride of 1)."""
    import torch.nn.functional as F

    if stride <= 1 or low.dim() != 4:
        return low
    return F.avg_pool2d(low, stride, ceil_mode=True)


class Every(NamedTuple):
    n: int
    adaptive = False

    def is_key(self, gap: int, change: float | None) -> bool:   # gap: frames since the keyframe
        return gap >= self.n


class Adaptive(NamedTuple):
    threshold: float
    max_gap: int
    adaptive = True

    def is_key(self, gap: int, change: float | None) -> bool:
        return gap >= self.max_gap or change > self.threshold


def parse_keyframes(spec: str, max_gap: int = 30):
    """``every:N`` (N >= 1) or ``adaptive:T`` (T >= 0; ``max_gap`` >= 1 frames at most between
    keyframes) -> a policy with ``is_key(frames since the last keyframe, change)``."""
    kind, _, value = str(spec).partition(":")
    try:
        if kind == "every" and int(value) >= 1:
            return Every(int(value))
        if kind == "adaptive" and float(value) >= 0 and int(max_gap) >= 1:
            return Adaptive(float(value), int(max_gap))
    except ValueError:
        pass
    raise ValueError(f"--keyframes '{spec}' (max gap {max_gap}): expected every:N with N >= 1 "
                     "or adaptive:T with T >= 0 (and a max gap >= 1)")


# -- flow ----------------------------------------------------------------------------------------
def warp(features: torch.Tensor, flow: np.ndarray) -> torch.Tensor:
    """``features`` (N, C, h, w) of a keyframe sampled at ``p + flow(p)``, with ``flow``
    (H, W, 2) in pixels of the frame the features were computed from (see the module notes)."""
    import cv2
    import torch.nn.functional as F

    n, c, h, w = features.shape
    H, W = flow.shape[:2]
    f = cv2.resize(flow, (w, h), interpolation=cv2.INTER_AREA if w < W else cv2.INTER_LINEAR)
    f = torch.from_numpy(f.reshape(h, w, 2)).to(features.device, torch.float32)
    ys, xs = torch.meshgrid(torch.arange(h, device=f.device, dtype=torch.float32),
                            torch.arange(w, device=f.device, dtype=torch.float32), indexing="ij")
    gx = (2 * (xs + f[..., 0] * (w / W)) + 1) / w - 1
    gy = (2 * (ys + f[..., 1] * (h / H)) + 1) / h - 1
    grid = torch.stack([gx, gy], -1)[None].expand(n, h, w, 2).to(features.dtype)
    return F.grid_sample(features, grid, mode="bilinear", padding_mode="border", align_corners=False)


class DISFlow:
    """OpenCV's DIS optical flow between grey uint8 frames: ``flow(cur, key)`` -> (H, W, 2)."""

    def __init__(self, preset: str = "fast"):
        import cv2

        if preset not in FLOW_PRESETS:
            raise ValueError(f"flow preset '{preset}': expected one of {', '.join(FLOW_PRESETS)}")
        self.dis = cv2.DISOpticalFlow_create(FLOW_PRESETS[preset])

    def __call__(self, cur: np.ndarray, key: np.ndarray) -> np.ndarray:
        return self.dis.calc(cur, key, None)


# -- the runner ----------------------------------------------------------------------------------
class VideoNet:
    """``net`` (a core or pycaffe Net with one 4-D input) run over frames with keyframe reuse.

    ``VideoNet(net, split="res3", propagate="copy"|"flow", keyframes="every:5"|"adaptive:0.2",
    max_gap=30, mean=(104, 117, 123), scale=1.0, outputs=None, flow_preset="fast",
    measure=None, measure_stride=1)``; ``split`` may be None with ``every:N``; ``measure``: the
    blob adaptive keyframes measure (default the split), at ``measure_stride`` (see the module
    notes). ``run(source_or_frames)`` yields a ``FrameOutput`` (index, {output: tensor},
    is_keyframe) per frame; ``changes`` holds the adaptive measure per frame (None for the first
    frame and with ``every:N``)."""

    def __init__(self, net, split: str | None = None, propagate: str = "copy",
                 keyframes: str = "every:1", max_gap: int = 30, mean=None, scale: float = 1.0,
                 outputs=None, flow_preset: str = "fast", measure: str | None = None,
                 measure_stride: int = 1):
        if len(net.inputs) != 1 or len(net.shapes[net.inputs[0]]) != 4:
            raise NetError(f"net '{net.name}': video needs one N x C x H x W Input blob, "
                           f"the net has inputs {[(n, net.shapes[n]) for n in net.inputs]}")
        if propagate not in PROPAGATIONS:
            raise ValueError(f"--propagate '{propagate}': expected one of {', '.join(PROPAGATIONS)}")
        self.net, self.propagate = net, propagate
        self.policy = parse_keyframes(keyframes, max_gap)
        if split is None and self.policy.adaptive:
            raise ValueError("adaptive keyframes measure the split blob: give a split")
        self.split = split
        self.k = split_index(net, split) if split is not None else None
        self.input = net.inputs[0]
        self.measure = measure or split
        self.m = self._measure_index() if self.policy.adaptive else None
        if int(measure_stride) < 1:
            raise ValueError(f"--measure-stride {measure_stride}: expected an integer >= 1")
        self.measure_stride = int(measure_stride)
        _, self.channels, self.height, self.width = net.shapes[self.input]
        if self.channels not in (1, 3):
            raise NetError(f"net '{net.name}': input '{self.input}' has {self.channels} channels; "
                           "frames give 3 (BGR) or 1 (grey)")
        self.outputs = list(outputs or net.outputs)
        missing = [o for o in self.outputs if o not in net.blobs]
        if missing:
            raise NetError(f"no blob '{missing[0]}' in net '{net.name}'; its blobs are: "
                           f"{', '.join(net.blobs)}")
        self.mean = np.zeros(self.channels, np.float32) if mean is None else np.asarray(mean, np.float32)
        if self.mean.size not in (1, self.channels):
            raise ValueError(f"mean {list(mean)}: give 1 value or {self.channels} (one per channel)")
        self.scale = float(scale)
        self.flow = DISFlow(flow_preset) if propagate == "flow" else None
        self.changes: list[float | None] = []

    def _measure_index(self) -> int | None:
        """The index of the last layer writing the measure blob (None: the input blob)."""
        net, blob = self.net, self.measure
        if blob not in net.blobs:
            raise NetError(f"--measure: no blob '{blob}' in net '{net.name}'; its blobs are: "
                           f"{', '.join(net.blobs)}")
        if blob == self.input:
            return None
        m = max(i for i, tops in enumerate(net.top_lists) if blob in tops)
        if m > self.k:
            raise NetError(f"--measure '{blob}' is made by layer '{net.layer_list[m].name}', after "
                           f"the split '{self.split}' (layer '{net.layer_list[self.k].name}'): "
                           "measure a blob at or before the split")
        return m

    def prepare(self, frame: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """(the net's input (1, C, H, W) on its device, the grey frame at that size)."""
        import cv2

        img = cv2.resize(frame, (self.width, self.height), interpolation=cv2.INTER_LINEAR)
        grey = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY) if img.ndim == 3 else img
        x = grey[..., None] if self.channels == 1 else img
        x = (x.astype(np.float32) - self.mean.reshape(1, 1, -1)) * np.float32(self.scale)
        t = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)[None]))
        return t.to(self.net.device), grey

    def run(self, source, limit: int | None = None) -> Iterator[FrameOutput]:
        """Yield a FrameOutput per frame of ``source`` (a video or image folder path, or frames):
        the net runs on keyframes, other frames take the last keyframe's outputs (copied or warped)."""
        net = self.net
        frames = read_frames(source, limit) if isinstance(source, (str, os.PathLike)) else source
        key_out = key_low = key_grey = None
        gap = 0
        self.changes = []
        with torch.no_grad():
            for index, frame in enumerate(frames):
                x, grey = self.prepare(frame)
                net.blobs[self.input].tensor = x
                delta, low = None, None
                gap += 1                    # frames since the last keyframe
                if self.policy.adaptive:
                    if self.m is None:       # the input blob: no layer runs for the measure
                        low = pool_measure(x, self.measure_stride)
                    else:
                        net.forward_tensors(0, self.m)
                        low = pool_measure(net.blobs[self.measure].tensor, self.measure_stride)
                    if key_low is not None:
                        delta = change(low, key_low)
                key = key_out is None or self.policy.is_key(gap, delta)
                self.changes.append(delta)
                if key:
                    if low is not None:
                        key_low = low.clone()
                    if not self.policy.adaptive or self.m is None:
                        net.forward_tensors()
                    else:
                        net.forward_tensors(self.m + 1, None)
                    key_out = {o: net.blobs[o].tensor.detach().clone() for o in self.outputs}
                    key_grey, gap = grey, 0
                    outs = {o: t.clone() for o, t in key_out.items()}
                else:
                    outs = self._propagate(key_out, grey, key_grey)
                yield FrameOutput(index, outs, key)

    def _propagate(self, key_out: dict, grey: np.ndarray, key_grey: np.ndarray) -> dict:
        if self.flow is None:
            return {o: t.clone() for o, t in key_out.items()}
        flow = self.flow(grey, key_grey)
        return {o: warp(t, flow) if t.dim() == 4 else t.clone() for o, t in key_out.items()}
