"""Pictures of a net's outputs over video frames, for a look (``brewnet video --annotate``).

``annotate(frame, outputs, is_keyframe, index)`` draws on a BGR frame: an N x C x h x w output
as its per-position argmax, one colour per class, blended over the frame (the first such
output), else the top class and its score of an (N, C) output; the frame index and a "KEY" tag
on keyframes. ``FrameSink(path)`` writes the pictures as a Motion-JPEG ``.avi`` (OpenCV's
VideoWriter) or, for a path without a video suffix, as ``frame_000000.png``... in that folder.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

VIDEO_SUFFIXES = (".avi", ".mp4", ".mkv", ".mov")


def palette(n: int) -> np.ndarray:
    """``n`` distinct BGR colours (golden-ratio hues), class 0 first."""
    import cv2

    hues = ((np.arange(n) * 0.618034) % 1.0 * 179).astype(np.uint8)
    hsv = np.stack([hues, np.full(n, 200, np.uint8), np.full(n, 255, np.uint8)], -1)[None]
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0]


def annotate(frame: np.ndarray, outputs: dict, is_keyframe: bool, index: int) -> np.ndarray:
    import cv2

    img = frame.copy()
    h, w = img.shape[:2]
    maps = {k: v for k, v in outputs.items() if np.ndim(v) == 4}
    lines = [f"frame {index}" + ("  KEY" if is_keyframe else "")]
    if maps:
        name, v = next(iter(maps.items()))
        arg = np.asarray(v)[0].argmax(0)
        colours = palette(np.asarray(v).shape[1])[arg]
        colours = cv2.resize(colours, (w, h), interpolation=cv2.INTER_NEAREST)
        img = cv2.addWeighted(img, 0.6, colours, 0.4, 0)
        lines.append(f"{name}: argmax of {np.asarray(v).shape[1]} classes")
    for name, v in outputs.items():
        if name not in maps:
            flat = np.asarray(v).reshape(np.shape(v)[0], -1)[0]
            top = int(flat.argmax())
            lines.append(f"{name}: class {top} ({flat[top]:.3f})")
    for k, text in enumerate(lines):
        y = 18 + 18 * k
        cv2.putText(img, text, (6, y), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 3, cv2.LINE_AA)
        cv2.putText(img, text, (6, y), cv2.FONT_HERSHEY_SIMPLEX, 0.5,
                    (0, 0, 255) if is_keyframe and k == 0 else (255, 255, 255), 1, cv2.LINE_AA)
    return img


class FrameSink:
    """Annotated frames to a Motion-JPEG video (``.avi``...) or to PNGs in a folder."""

    def __init__(self, path, fps: float = 10.0):
        self.path, self.fps, self.writer, self.n = Path(path), float(fps), None, 0
        self.video = self.path.suffix.lower() in VIDEO_SUFFIXES
        folder = self.path.parent if self.video else self.path
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, img: np.ndarray) -> None:
        import cv2

        if not self.video:
            if not cv2.imwrite(str(self.path / f"frame_{self.n:06d}.png"), img):
                raise OSError(f"{self.path}: cannot write frame {self.n} there")
        else:
            if self.writer is None:
                self.writer = cv2.VideoWriter(str(self.path), cv2.VideoWriter_fourcc(*"MJPG"),
                                              self.fps, (img.shape[1], img.shape[0]))
                if not self.writer.isOpened():
                    raise OSError(f"{self.path}: OpenCV cannot write a Motion-JPEG video there")
            self.writer.write(img)
        self.n += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.release()
            self.writer = None
