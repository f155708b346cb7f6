"""``brewnet video --model M --weights W --input VIDEO|FRAMES_DIR --split BLOB --out OUT.npy|.h5``:
a net over every frame of a video, the layers after ``--split`` only on keyframes and their
outputs carried to the frames between by ``--propagate copy|flow`` (``brewnet.video``).
Writes each output per frame (frames first) and which frames were keyframes; ``--annotate``
adds a video or PNGs of the outputs drawn on the frames."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .common import USER_ERRORS, add_gpu_flag, progress_bar, report, trained_net

COMMAND = "video"
HELP = "run a net over a video, recomputing the layers after --split only on keyframes"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="a deploy net (one Input)")
    p.add_argument("--weights", "-weights", required=True, metavar="W")
    p.add_argument("--input", "-input", required=True, metavar="VIDEO|DIR",
                   help="a video file OpenCV reads, or a folder of frame images (sorted by name)")
    p.add_argument("--split", "-split", required=True, metavar="BLOB",
                   help="the blob after which the layers run only on keyframes")
    p.add_argument("--out", "-out", required=True, metavar="OUT.npy|OUT.h5",
                   help="outputs per frame: OUT.npy (OUT_<blob>.npy when several) and "
                        "OUT_keyframes.npy, or one .h5 with a dataset per blob and 'keyframe'")
    p.add_argument("--propagate", choices=("copy", "flow"), default="copy",
                   help="between keyframes: copy the keyframe's outputs, or warp them by DIS flow")
    p.add_argument("--keyframes", default="every:10", metavar="every:N|adaptive:T",
                   help="every N-th frame, or when the measure blob's mean absolute change since "
                        "the keyframe, relative to its mean magnitude there, passes T (default every:10)")
    p.add_argument("--measure", default="", metavar="BLOB",
                   help="adaptive: the blob measured (default the split; one made at or before "
                        "it; the input blob is the transformed frame: no layer runs between keyframes)")
    p.add_argument("--measure-stride", type=int, default=1, metavar="S",
                   help="adaptive: average the measure blob over S x S cells first (default 1)")
    p.add_argument("--max-gap", type=int, default=30, help="adaptive: frames at most between keyframes")
    p.add_argument("--blobs", default="", metavar="A,B", help="outputs to keep (default: the net's)")
    p.add_argument("--mean", default="", metavar="B,G,R", help="per-channel mean, e.g. 104,117,123")
    p.add_argument("--scale", type=float, default=1.0, help="after the mean, as transform_param's")
    p.add_argument("--size", default="", metavar="WxH",
                   help="resize frames to WxH (default: the net's input)")
    p.add_argument("--fully-convolutional", action="store_true",
                   help="turn InnerProduct layers into convolutions first (score maps; "
                        "brewnet.fully_convolutional)")
    p.add_argument("--frames", type=int, default=0, metavar="N", help="only the first N frames")
    p.add_argument("--flow-preset", choices=("ultrafast", "fast", "medium"), default="fast")
    p.add_argument("--annotate", default="", metavar="OUT.avi|DIR", help="pictures of the outputs")
    add_gpu_flag(p)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    sink = None
    try:
        import numpy as np

        from ..video import VideoNet, frame_count, read_frames

        net = _net(args)
        vn = VideoNet(net, args.split, args.propagate, args.keyframes, args.max_gap,
                      mean=[float(v) for v in args.mean.split(",")] if args.mean else None,
                      scale=args.scale, outputs=[b for b in args.blobs.split(",") if b] or None,
                      flow_preset=args.flow_preset, measure=args.measure or None,
                      measure_stride=args.measure_stride)
        if Path(args.out).suffix.lower() not in (".npy", ".h5"):
            raise ValueError(f"--out {args.out}: expected a .npy or .h5 file")
        shown = {}

        def frames():
            for f in read_frames(args.input, args.frames or None):
                shown["frame"] = f
                yield f

        if args.annotate:
            from ..analysis.annotate import FrameSink, annotate

            sink = FrameSink(args.annotate)
        results = {o: [] for o in vn.outputs}
        keys = []
        total = min(frame_count(args.input) or 0, args.frames or 1 << 60) or None
        log.info("Video %s through net %s: split after '%s', %s, keyframes %s", args.input,
                 net.name, args.split, args.propagate, args.keyframes)
        start = time.perf_counter()
        with progress_bar(total, desc="video", unit="frame") as bar:
            for out in vn.run(frames()):
                arrays = {o: t.float().cpu().numpy() for o, t in out.outputs.items()}
                for o, a in arrays.items():
                    results[o].append(a[0])
                keys.append(out.is_keyframe)
                if sink is not None:
                    sink.write(annotate(shown["frame"], arrays, out.is_keyframe, out.index))
                if bar is not None:
                    bar.update(1)
            if bar is not None and bar.n != bar.total:
                # the header's frame count can overstate (tree.avi: 444, of which 376 are empty
                # "repeat the previous frame" chunks that OpenCV skips): end at what was read
                bar.total = bar.n
                bar.refresh()
        seconds = time.perf_counter() - start
        written = _save(args.out, {o: np.stack(v) for o, v in results.items()}, np.asarray(keys))
    except USER_ERRORS as e:
        return report(COMMAND, e)
    finally:
        if sink is not None:
            sink.close()
    log.info("Processed %d frames (%d keyframes) in %.2f s: %.2f frames/s", len(keys), sum(keys),
             seconds, len(keys) / seconds)
    shown_at = [args.annotate] if args.annotate else []
    log.info("Wrote %s", ", ".join(str(p) for p in written + shown_at))
    return 0


def _net(args):
    net = trained_net(args, COMMAND)
    size = None
    if args.size:
        try:
            w, h = (int(v) for v in args.size.lower().split("x"))
        except ValueError:
            raise ValueError(f"--size '{args.size}': expected WxH, e.g. 320x240") from None
        size = (h, w)
    if args.fully_convolutional:
        from ..deploy.surgery import fully_convolutional

        return fully_convolutional(net, size)
    if size is not None and net.inputs:
        name = net.inputs[0]
        net.blobs[name].reshape(*net.shapes[name][:-2], *size)
        net.reshape()
    return net


def _save(out: str, arrays: dict, keys) -> list[Path]:
    """Each array atomically (a temporary file renamed into place)."""
    import numpy as np

    out = Path(out)
    if out.suffix.lower() == ".h5":
        import h5py

        tmp = out.with_name(out.name + ".tmp")
        with h5py.File(tmp, "w") as f:
            for name, a in arrays.items():
                f.create_dataset(name, data=a)
            f.create_dataset("keyframe", data=keys)
        os.replace(tmp, out)
        return [out]
    named = {(out if len(arrays) == 1 else out.with_name(f"{out.stem}_{n}.npy")): a
             for n, a in arrays.items()}
    named[out.with_name(f"{out.stem}_keyframes.npy")] = keys
    for path, a in named.items():
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, a)
        os.replace(tmp, path)
    return list(named)
