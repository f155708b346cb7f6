"""``brewnet test --model M --weights W --iterations N``: ``caffe test``, and owl's multi-view tester.

Builds the net in the TEST phase (``--level``/``--stage``), loads the weights and runs
``iterations`` forwards, logging in Caffe's words and order each output element per batch
(``Batch i, name = v``), then the mean loss (``Loss: L``) and each output's mean (``name = m``,
with ``(* w = l loss)`` for loss outputs). The net must read its own data (Data, ImageData,
HDF5Data, DummyData...); Input blobs stay zeros, as with Caffe. ``--views 10``, ``--top-k`` or
``--images`` score class probabilities instead (``brewnet.analysis.multiview``): ``--views 10``
averages ``--output`` (default: the Softmax top) over the 10 oversampled crops, taken before the
Data/ImageData layer's crop (``--pad P`` for a net that does not crop); ``--images list.txt``
('path label' lines) feeds a deploy net image files prepared as pycaffe's ``Classifier.predict``
does; ``--top-k 1,5`` reports the accuracy per batch, with its running mean, and in a summary.
"""
from __future__ import annotations

import logging

import numpy as np

from ..execution.threads import plan_beside
from ..solvers.detection_eval import AP_VERSIONS, DetectionMAP, log_aps
from .common import (
    USER_ERRORS,
    CLIError,
    add_gpu_flag,
    add_image_flags,
    add_net_state_flags,
    image_transformer,
    ints,
    report,
    single_device,
    trained_net,
)

COMMAND = "test"
HELP = "score a model: run N test batches and average its outputs (Caffe's 'caffe test')"
log = logging.getLogger("brewnet")
f32 = np.float32


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the net definition (.prototxt)")
    p.add_argument("--weights", "-weights", required=True, metavar="W",
                   help="trained weights (.caffemodel or .caffemodel.h5)")
    p.add_argument("--iterations", "-iterations", type=int, default=50, metavar="N",
                   help="number of batches to run (default 50; with --images: the whole list)")
    p.add_argument("--views", type=int, choices=(1, 10), default=1,
                   help="1: as the net crops; 10: 4 corners + centre and their mirrors, averaged")
    p.add_argument("--top-k", default="", metavar="1,5", help="report top-k accuracy (default 1)")
    p.add_argument("--output", default="", metavar="BLOB", help="the class scores (default: the Softmax top)")
    p.add_argument("--pad", type=int, default=0, metavar="P",
                   help="--views 10: zero-pad the transformed images by P pixels before cropping")
    p.add_argument("--images", default="", metavar="LIST", help="'path label' lines for a deploy net")
    p.add_argument("--root-folder", default="", help="prefix of the --images paths (as ImageData's)")
    p.add_argument("--batch", type=int, default=0, help="--images per forward (default: the input's)")
    p.add_argument("--ap-version", "-ap_version", default="Integral", choices=AP_VERSIONS,
                   help="a detection net's AP (SSD's solver ap_version; default Integral)")
    p.add_argument("--per-class", action="store_true", help="a detection net: also each class's AP")
    add_image_flags(p)
    add_gpu_flag(p)
    add_net_state_flags(p)


def detection_outputs(net) -> list[str]:
    """The net's outputs made by DetectionEvaluate layers (scored as mAP, not averaged)."""
    made = {t for layer, tops in zip(net.layer_list, net.top_lists) if layer.type == "DetectionEvaluate"
            for t in tops}
    return [n for n in net.outputs if n in made]


def score(net, iterations: int, maps: dict | None = None) -> tuple[float, list[tuple[str, float, float]]]:
    """Run ``iterations`` forwards; returns (mean loss, [(output name, loss weight, mean)]),
    logging each batch's values. Sums are float32, as Caffe's. Outputs named in ``maps`` (a
    DetectionMAP each) are accumulated there instead."""
    import torch

    loss, sums, names = f32(0), None, []
    weights = net.blob_loss_weights
    maps = maps or {}
    with torch.no_grad():
        for i in range(iterations):
            loss += f32(net.forward_tensors().item())
            values = []
            for name in maps:
                maps[name].add(net.blobs[name].tensor.detach().float().cpu().numpy())
            for name in (n for n in net.outputs if n not in maps):
                flat = net.blobs[name].tensor.detach().reshape(-1).float().cpu().numpy()
                for v in flat:
                    log.info("Batch %d, %s = %g", i, name, v)
                values.append(flat)
                if i == 0:
                    names += [name] * flat.size
            row = np.concatenate(values) if values else np.zeros(0, f32)
            sums = row.copy() if sums is None else sums + row
    loss /= f32(iterations)
    means = (sums / f32(iterations)) if sums is not None else []
    return float(loss), [(n, weights[n], float(m)) for n, m in zip(names, means)]


def image_list_scores(net, args, views: int):
    """Yield (scores averaged over the views, labels) for the images of ``args.images`` in
    batches, prepared as pycaffe's Classifier.predict (resize to --image-dims, oversample or
    centre crop, Transformer)."""
    from ..analysis.multiview import forward_views, score_blob
    from ..data.convert import read_list
    from ..pycaffe import io
    from ..pycaffe.classifier import prepare

    if len(net.inputs) != 1 or len(net.shapes[net.inputs[0]]) != 4:
        raise CLIError(f"{args.model}: --images needs a deploy net with one (N, C, H, W) Input; it has "
                       f"{[(n, net.shapes[n]) for n in net.inputs] or 'none'}")
    name, shape = net.inputs[0], net.shapes[net.inputs[0]]
    t, dims = image_transformer(args, name, (1,) + tuple(shape[1:]))
    if views == 10 and tuple(dims) == tuple(shape[2:]):
        raise CLIError(f"--views 10 needs --image-dims larger than the net's {shape[2]}x{shape[3]} "
                       "input (e.g. 256,256 for a 227 or 224 net): the crops would all be the image")
    blob, softmax = score_blob(net, args.output)
    lines = read_list(args.images)
    batch = args.batch or shape[0]
    for s in range(0, len(lines), batch):
        part = lines[s:s + batch]
        images = []
        for path, _, lineno in part:
            try:
                images.append(io.load_image(args.root_folder + path, color=shape[1] == 3))
            except OSError as e:
                raise OSError(f"{args.images} line {lineno}: {e}") from None
        data = prepare(t, name, images, dims, shape[2:], views == 10)
        yield (forward_views(net, name, [data[v::views] for v in range(views)], blob, softmax),
               np.array([label for _, label, _ in part]))


def run_multiview(args) -> None:
    from ..analysis import multiview
    from ..execution import process

    ks = sorted(set(ints(args.top_k, "--top-k"))) if args.top_k else [1]
    if min(ks) < 1:
        raise CLIError(f"--top-k {args.top_k}: k must be at least 1")
    if args.images:
        net = trained_net(args, COMMAND)
        plan_beside(net.layer_list)
        batches = image_list_scores(net, args, args.views)
    elif args.views == 10 or args.pad:
        device = single_device(args.gpu, COMMAND)
        process.configure(device)
        batches = multiview.data_layer_scores(args.model, args.weights, args.views, args.iterations,
                                              args.output, args.pad, args.level,
                                              [s for s in args.stage.split(",") if s], device)
    else:
        net = trained_net(args, COMMAND)
        plan_beside(net.layer_list)
        if net.inputs and not multiview.label_blob(net):
            raise CLIError(f"{args.model}: the net has an Input layer and no data layer; give "
                           "--images list.txt to test a deploy net")
        if not multiview.label_blob(net):
            raise CLIError(f"--top-k needs labels: no data layer of net '{net.name}' has a label top")
        batches = multiview.net_batches(net, args.iterations, args.output)
    multiview.report(batches, ks, args.views)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.iterations < 1:
        return report(COMMAND, f"--iterations must be at least 1, got {args.iterations}")
    try:
        if args.views == 10 or args.top_k or args.images or args.pad:
            run_multiview(args)
            return 0
        net = trained_net(args, COMMAND)
        plan_beside(net.layer_list)
        log.info("Running for %d iterations.", args.iterations)
        maps = {name: DetectionMAP() for name in detection_outputs(net)}
        loss, results = score(net, args.iterations, maps)
        log.info("Loss: %g", loss)
        for name, w, mean in results:
            extra = f" (* {w:g} = {f32(w) * f32(mean):g} loss)" if w else ""
            log.info("%s = %g%s", name, mean, extra)
        for name, m in maps.items():
            report_map(name, m, args.ap_version, args.per_class)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    return 0


def report_map(name: str, m: DetectionMAP, version: str, per_class: bool) -> None:
    """SSD's solver lines: per class AP (``per_class``), then the output's mAP."""
    log_aps(m, version, per_class)
    log.info("%s = %g (mAP, %s, %d ground-truth boxes)", name, m.mean_ap(version), version,
             sum(m.num_pos.values()))
