"""Multi-view testing (owl's NetTester / MultiviewTester): a class-score output averaged over 1
or 10 views of each image, and top-k accuracy from it and the labels.

10 views are Caffe's ``oversample``: the four corner crops (top-left, top-right, bottom-left,
bottom-right) and the centre crop, then each of them mirrored left-right, in that order. On a net
whose Data/ImageData layer crops, ``data_layer_scores`` reads the images before the crop (the
layer rebuilt without ``crop_size`` and ``mirror``: its mean and scale are elementwise, so a crop
of the transformed image equals Caffe's transform of that crop, the mean file indexed at the
crop's offset) and feeds each view to the net with the data layer replaced by an Input.

Top-k: an image counts when its label is among the k classes ``np.argsort(-scores,
kind="stable")[:k]``: of equal scores the lower class index ranks first. Differs from Caffe's
Accuracy layer, which counts every class tied with the true one as better than it.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..proto import caffe_pb2 as pb

log = logging.getLogger("brewnet")
CROPPING = ("Data", "ImageData")       # the layers whose transform_param crop is re-done here


def crop_starts(size, crop) -> list[tuple[int, int]]:
    """(row, col) of the 5 crops of ``crop`` (h, w) in an image of ``size`` (H, W), in
    oversample's order: corners, then the centre (pycaffe's ``int(H / 2 - h / 2)``)."""
    (H, W), (h, w) = size, crop
    centre = (int(H / 2.0 - h / 2.0), int(W / 2.0 - w / 2.0))
    return [(0, 0), (0, W - w), (H - h, 0), (H - h, W - w), centre]


def take_views(x: np.ndarray, crop, views: int) -> list[np.ndarray]:
    """The ``views`` (1: the centre crop; 10: oversample's) crops of a (N, C, H, W) batch."""
    crop = tuple(int(c) for c in crop)
    starts = crop_starts(x.shape[2:], crop)
    cut = [x[:, :, i:i + crop[0], j:j + crop[1]] for i, j in (starts[4:] if views == 1 else starts)]
    if views == 10:
        cut += [c[..., ::-1] for c in cut]
    return [np.ascontiguousarray(c) for c in cut]


def topk_hits(scores: np.ndarray, labels: np.ndarray, ks) -> dict[int, int]:
    """{k: how many rows have their label among the k best scores} (ties: see the module)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    labels = np.asarray(labels).astype(np.int64).reshape(-1, 1)
    return {k: int((order[:, :k] == labels).any(1).sum()) for k in ks}


def score_blob(net, output: str | None) -> tuple[str, bool]:
    """(blob, softmax it?) for the scores: ``output`` (a blob, or a Softmax or SoftmaxWithLoss
    layer's name: its probabilities, as owl names them), else the last Softmax layer's top, else
    the scores bottom of the last SoftmaxWithLoss (softmaxed, as that layer does inside)."""
    named = [(l.type, b, t) for l, b, t in zip(net.layer_list, net.bottom_lists, net.top_lists)
             if output and l.name == output and l.type in ("Softmax", "SoftmaxWithLoss")]
    if named:
        kind, bottoms, tops = named[-1]
        return (tops[0], False) if kind == "Softmax" else (bottoms[0], True)
    if output:
        if output not in net.blobs:
            raise ValueError(f"no blob '{output}' in net '{net.name}'; its blobs are: {', '.join(net.blobs)}")
        return output, False
    for layer, bottoms, tops in reversed(list(zip(net.layer_list, net.bottom_lists, net.top_lists))):
        if layer.type == "Softmax":
            return tops[0], False
        if layer.type == "SoftmaxWithLoss":
            log.info("Scores: softmax of '%s' (the bottom of SoftmaxWithLoss '%s')", bottoms[0], layer.name)
            return bottoms[0], True
    raise ValueError(f"net '{net.name}' has no Softmax or SoftmaxWithLoss layer; name the class "
                     "scores with --output")


def scores_of(net, blob: str, softmax: bool) -> np.ndarray:
    """The (N, classes) float64 scores in ``blob`` after a forward."""
    t = net.blobs[blob].tensor.detach().double()
    if t.dim() > 2 and any(d != 1 for d in t.shape[2:]):
        raise ValueError(f"blob '{blob}' has shape {tuple(t.shape)}; class scores are (N, classes)")
    t = t.reshape(t.shape[0], -1)
    return (torch.softmax(t, 1) if softmax else t).cpu().numpy()


def forward_views(net, input_name: str, views: list[np.ndarray], blob: str, softmax: bool) -> np.ndarray:
    """The scores of each view (each (N, C, h, w)) through ``net``, averaged."""
    total = None
    blob_in = net.blobs[input_name]
    with torch.no_grad():
        for v in views:
            if tuple(blob_in.shape) != v.shape:
                blob_in.reshape(*v.shape)
            blob_in.data[...] = v
            net.forward_tensors()
            s = scores_of(net, blob, softmax)
            total = s if total is None else total + s
    return total / len(views)


def net_batches(net, iterations: int, output: str | None = None):
    """Single view through the net as it is: yields (scores, labels or None) per forward."""
    blob, softmax = score_blob(net, output)
    label = label_blob(net)
    with torch.no_grad():
        for _ in range(iterations):
            net.forward_tensors()
            labels = net.blobs[label].tensor.cpu().numpy().reshape(-1).copy() if label else None
            yield scores_of(net, blob, softmax), labels


def label_blob(net) -> str | None:
    for layer, bottoms, tops in zip(net.layer_list, net.bottom_lists, net.top_lists):
        if not bottoms and layer.type != "Input" and len(tops) > 1:
            return tops[1]
    return None


def split_data_layer(param: "pb.NetParameter", views: int, pad: int):
    """For a filtered TEST NetParameter: (the Data/ImageData layer alone without crop and
    mirror, a function (source top shapes) -> (the net with that layer replaced by an Input of
    the view size, the view size (h, w)))."""
    idx = [i for i, l in enumerate(param.layer) if l.type in CROPPING and not l.bottom]
    if len(idx) != 1:
        raise ValueError(f"net '{param.name}': multi-view testing needs one Data or ImageData "
                         f"layer, found {len(idx)} (the layers: "
                         f"{', '.join(f'{l.name} ({l.type})' for l in param.layer if not l.bottom)})")
    layer = param.layer[idx[0]]
    crop = layer.transform_param.crop_size
    source = pb.NetParameter(name=param.name + "_source")
    src = source.layer.add()
    src.CopyFrom(layer)
    src.transform_param.crop_size = 0
    src.transform_param.mirror = False

    def trunk(shapes):
        (n, c, h, w) = shapes[0]
        size = (crop, crop) if crop else (h, w)
        if views == 10 and (size[0] >= h + 2 * pad or size[1] >= w + 2 * pad):
            raise ValueError(
                f"--views 10 needs crops smaller than the image: layer '{layer.name}' gives "
                f"{h}x{w} images and " + (f"crop_size {crop}" if crop else "no transform_param.crop_size")
                + (f", padded by {pad}" if pad else "") + "; give --pad P to crop "
                f"{size[0]}x{size[1]} views from the image padded by P pixels, or test a net that crops")
        out = pb.NetParameter()
        out.CopyFrom(param)
        inp = pb.LayerParameter(name=layer.name, type="Input", top=list(layer.top))
        for s in [(n, c) + size] + [tuple(t) for t in shapes[1:]]:
            inp.input_param.shape.add(dim=list(s))
        del out.layer[idx[0]]
        out.layer.insert(idx[0], inp)
        return out, size

    return source, trunk


def data_layer_scores(model, weights, views: int, iterations: int, output: str | None = None,
                      pad: int = 0, level: int = 0, stages=(), device=None):
    """Yield (scores averaged over the views (N, classes), labels or None) for ``iterations``
    batches of a net with a Data/ImageData layer; ``pad`` zero pixels (the transformed image's
    zero: the mean) are added on each side before the views are cut. ``model`` is a file or a
    NetParameter; ``weights`` a weights file or a Net whose parameters the views' net shares."""
    import os

    from ..net import Net
    from ..proto.filter import filter_net, make_state
    from ..proto.io import read_net
    from ..weights import load_weights

    param = model if isinstance(model, pb.NetParameter) else read_net(os.fspath(model))
    param = filter_net(param, make_state(pb.TEST, level, stages, param.state))
    source_param, make_trunk = split_data_layer(param, views, pad)
    source = Net(source_param, pb.TEST)
    tops = source.top_lists[0]
    trunk_param, size = make_trunk([source.shapes[t] for t in tops])
    net = Net(trunk_param, pb.TEST, device=device)
    if isinstance(weights, (str, os.PathLike)):
        load_weights(net, weights, require_match=True)
    else:
        net.share_with(weights)
    blob, softmax = score_blob(net, output)
    log.info("Testing %d view(s) of %dx%d%s per image", views, size[0], size[1],
             f" from images padded by {pad}" if pad else "")
    with torch.no_grad():
        for _ in range(iterations):
            source.forward_tensors()
            x = source.blobs[tops[0]].tensor.cpu().numpy()
            if pad:
                x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
            labels = source.blobs[tops[1]].tensor.cpu().numpy().reshape(-1).copy() if len(tops) > 1 else None
            for t in tops[1:]:
                net.blobs[t].data[...] = source.blobs[t].tensor.cpu().numpy()
            yield forward_views(net, tops[0], take_views(x, size, views), blob, softmax), labels


def report(batches, ks, views: int):
    """Consume (scores, labels) batches: log per batch each top-k and its running mean, then
    the summary, in Caffe's log format. Returns ({k: accuracy}, images)."""
    hits, n = {k: 0 for k in ks}, 0
    for i, (scores, labels) in enumerate(batches):
        if labels is None:
            raise ValueError("top-k accuracy needs labels: the net's data layer has no label top")
        if scores.shape[1] < max(ks):
            raise ValueError(f"--top-k {max(ks)}: the scores have only {scores.shape[1]} classes")
        got = topk_hits(scores, labels, ks)
        n += len(labels)
        for k in ks:
            hits[k] += got[k]
            log.info("Batch %d, top-%d = %g (running mean %g)", i, k, got[k] / len(labels), hits[k] / n)
    log.info("Views: %d, images: %d", views, n)
    acc = {k: hits[k] / n for k in ks} if n else {}
    for k in ks:
        log.info("top-%d = %g", k, acc.get(k, 0.0))
    return acc, n
