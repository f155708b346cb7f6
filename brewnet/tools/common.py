"""Helpers shared by the command modules: gflags-style booleans, Caffe's ``-gpu``/``-stage``/
``-level`` flags, user-facing errors, log set-up, thread sizing and the terminal progress bar."""
from __future__ import annotations

import contextlib
import logging
import sys

log = logging.getLogger("brewnet")

# What a bad file, flag or definition raises (NetError, SolverError, LayerError and ProtoError
# are ValueErrors; a missing file is an OSError; a diverging run a FloatingPointError).
USER_ERRORS = (ValueError, OSError, FloatingPointError)


class CLIError(ValueError):
    """A flag that cannot be honoured here; the message says why and what to do instead."""


def report(command: str, err: BaseException) -> int:
    """Print a one-line error for the user and return the exit status."""
    print(f"brewnet {command}: {err}", file=sys.stderr)
    return 1


def add_bool(p, name: str, help: str) -> None:
    """A gflags-style boolean: ``--name`` sets it, ``--noname`` clears it (Caffe's ``-name``
    reaches here as ``--name``)."""
    p.add_argument(f"--{name}", action="store_true", default=False, help=help)
    p.add_argument(f"--no{name}", dest=name, action="store_false", help="(the default)")


def log_to_stderr() -> None:
    """INFO lines on stderr unless the program configured logging already (the converters)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname).1s %(asctime)s %(message)s",
                        datefmt="%H:%M:%S")


def add_gpu_flag(p) -> None:
    p.add_argument("--gpu", "-gpu", default="", metavar="IDS",
                   help="run on CUDA devices: ids separated by ',' or 'all' (default: the CPU)")


def add_net_state_flags(p) -> None:
    p.add_argument("--level", "-level", type=int, default=0, help="network level (default 0)")
    p.add_argument("--stage", "-stage", default="", metavar="A,B",
                   help="network stages, separated by ','")


def stages(spec: str) -> list[str]:
    return [s for s in spec.split(",") if s]


def parse_gpus(spec: str) -> list[int]:
    """Caffe's ``-gpu``: "" -> [], "all" -> every device, "0,2" -> [0, 2]; a clear error when
    CUDA is missing or an id does not exist."""
    import torch

    spec = spec.strip()
    if not spec:
        return []
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise CLIError(f"--gpu {spec}: CUDA is not available ({why}, torch {torch.__version__}); "
                       "run without --gpu to use the CPU")
    if spec == "all":
        return list(range(available))
    try:
        ids = [int(s) for s in spec.split(",")]
    except ValueError:
        raise CLIError(f"--gpu '{spec}': expected device ids separated by ',' or 'all'") from None
    bad = [i for i in ids if not 0 <= i < available]
    if bad:
        raise CLIError(f"--gpu {spec}: no CUDA device {bad[0]}; this machine has {available} "
                       f"(ids 0..{available - 1})")
    return ids


def single_device(spec: str, command: str):
    """The torch device for a single-device command; extra ids are dropped with a note, as
    Caffe does for test and time."""
    import torch

    gpus = parse_gpus(spec)
    for g in reversed(gpus[1:]):
        log.info("Not using GPU #%d for single-GPU function", g)
    if not gpus:
        log.info("Use CPU.")
        return torch.device("cpu")
    log.info("Use GPU with device ID %d", gpus[0])
    log.info("GPU device name: %s", torch.cuda.get_device_name(gpus[0]))
    return torch.device("cuda", gpus[0])


def trained_net(args, command: str):
    """The TEST net of ``--model`` (with ``--level``/``--stage`` when the command has them) on
    ``--gpu``'s device, its ``--weights`` loaded; a file matching no layer is an error."""
    from ..execution import process
    from ..net import Net
    from ..proto import caffe_pb2 as pb
    from ..weights import load_weights

    device = single_device(args.gpu, command)
    process.configure(device)
    net = Net(args.model, pb.TEST, level=getattr(args, "level", 0),
              stages=stages(getattr(args, "stage", "")), device=device)
    load_weights(net, args.weights, require_match=True)   # another net's file is an error
    return net


def ints(spec: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in spec.split(",")]
    except ValueError:
        raise CLIError(f"{flag} '{spec}': expected integers separated by ','") from None


def add_image_flags(p) -> None:
    """pycaffe's Classifier preparation of image files for a deploy net (``image_transformer``)."""
    p.add_argument("--mean", metavar="FILE|B,G,R", help="mean: .binaryproto, .npy or one value per channel")
    p.add_argument("--raw-scale", type=float, help="multiply [0, 1] pixels by this (255 for ImageNet nets)")
    p.add_argument("--input-scale", type=float, help="multiply after the mean is subtracted")
    p.add_argument("--channel-swap", metavar="2,1,0", help="channel order (2,1,0: RGB -> BGR)")
    p.add_argument("--image-dims", metavar="H,W", help="resize to this, then crop to the input")


def mean_arg(spec: str, shape):
    """``--mean``: a .binaryproto or .npy (averaged per channel when its shape is not the
    input's ``shape`` (C, H, W)) or per-channel values."""
    import numpy as np

    if spec.endswith(".binaryproto"):
        from ..proto import caffe_pb2 as pb
        from ..pycaffe.io import blobproto_to_array

        blob = pb.BlobProto()
        with open(spec, "rb") as f:
            blob.ParseFromString(f.read())
        mean = blobproto_to_array(blob)[0]
    elif spec.endswith(".npy"):
        mean = np.load(spec, allow_pickle=False)
    else:
        try:
            return np.array([float(v) for v in spec.split(",")], np.float32)
        except ValueError:
            raise CLIError(f"--mean '{spec}': expected a file or numbers separated by ','") from None
    if mean.shape != tuple(shape):     # a 256x256 ImageNet mean for a 227 or 224 input
        log.info("Mean of shape %s averaged per channel for input %s", mean.shape, tuple(shape))
        mean = mean.reshape(mean.shape[0], -1).mean(1)
    return mean


def image_transformer(args, name: str, shape):
    """(pycaffe Transformer for input ``name`` of ``shape`` (N, C, H, W), image dims) from
    ``add_image_flags``' flags, as pycaffe's Classifier sets them up."""
    from ..pycaffe import io as cio

    t = cio.Transformer({name: shape})
    t.set_transpose(name, (2, 0, 1))
    if args.channel_swap:
        t.set_channel_swap(name, ints(args.channel_swap, "--channel-swap"))
    if args.raw_scale is not None:
        t.set_raw_scale(name, args.raw_scale)
    if args.mean:
        t.set_mean(name, mean_arg(args.mean, shape[1:]))
    if args.input_scale is not None:
        t.set_input_scale(name, args.input_scale)
    dims = ints(args.image_dims, "--image-dims") if args.image_dims else list(shape[2:])
    if len(dims) != 2 or dims[0] < shape[2] or dims[1] < shape[3]:
        raise CLIError(f"--image-dims {args.image_dims}: two sizes, at least the input's {list(shape[2:])}")
    return t, dims


def prefetching_layers(net) -> list:
    """The net's data layers that fill their batches in a background thread."""
    from ..data.source import Prefetching

    return [l for l in net.layer_list if isinstance(l, Prefetching) and l.prefetcher is not None]


@contextlib.contextmanager
def progress_bar(total: int | None, initial: int = 0, desc: str = "", unit: str = "it"):
    """A tqdm bar on stderr when stderr is a terminal (log lines are routed around it), else
    None: logs redirected to a file stay free of bar frames."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[log]), tqdm(total=total, initial=initial, desc=desc,
                                                    unit=unit, dynamic_ncols=True) as bar:
        yield bar
