"""Call N equals call 1 on every deploy net the project can reach (tests/data/caffe-models,
tests/data/forks, ../shared/caffe-models), called as a pycaffe loop is, with the user's defaults
(no BREWNET_* switch), past every switch brewnet makes on its own: the lean graph recorded at call
``lean.AFTER + 1`` (brewnet/execution/lean.py), again after the input blob is reshaped to another
batch, and the thread tuner's calls on another thread count (brewnet/execution/threads.py).

What holds, measured on 2 cores and asserted (``calls``, ``same_bits_as_eager``): calls on one
path (eager or lean) at one thread count give the same bits; the lean graph gives the eager
path's bits at one thread count where it re-chose no kernel (``rechosen``); across thread counts
and re-chosen kernels a sum runs in another order: within ``LEAN_RTOL`` of the output's largest
magnitude. Nets with a layer brewnet/deploy/fx_export.py's NO_GRAPH declines are cut before it
(``CUT``: the graph up to it), a net the graph cannot hold stays eager (``EAGER``); no call logs
a WARNING. Random weights are drawn to compute what a trained net would (``realistic``).
A net whose forwards on one shape reach ``engines.AUTO_AFTER_S`` may move to the engine auto
picks (brewnet/execution/engines.py): its calls are held to ``engines.RTOL`` of call 1 and to
the same bits among themselves.
Default: ``LARGE`` nets skipped, ``SIZES`` smaller (77 s with ``-n 2`` on 2 idle cores);
``BREWNET_ALL_NETS=1``: every net at its own size (~15 min on one process; PSPNet peaks at ~15 GB).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import operator
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.execution import engines, lean
from brewnet.layers import functional as Fn
from helpers import SHARED, VENDORED, have, need, pick

CALLS = 20
LEAN_RTOL = 1e-5      # a re-chosen kernel, another thread count: a sum in another order
# a cut net's tail rows (``same_rows``) within this many times that: box decoding's exp() turns
# the trunk's rounding into as much of each box's size (YOLOv2: 3.3e-4 of a scale of 19, 1.7x)
TAIL_GAIN = 10
ALL_NETS = os.environ.get("BREWNET_ALL_NETS") == "1"

# The real weights in ../shared/caffe-models for a deploy prototxt (relative to caffe-models/).
WEIGHTS = {
    "trained/open_nsfw/deploy.prototxt": "trained/open_nsfw/resnet_50_1by2_nsfw.caffemodel",
    "trained/lenet_mnist_ethereon/examples/mnist/lenet.prototxt":
        "trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel",
    "trained/everpeace_caffe_2014_v1format/examples/mnist/lenet.prototxt":
        "trained/everpeace_caffe_2014_v1format/examples/mnist/lenet_iter_10000.caffemodel",
    "trained/everpeace_caffe_2014_v1format/examples/cifar10/cifar10_full.prototxt":
        "trained/everpeace_caffe_2014_v1format/examples/cifar10/cifar10_full_iter_70000.caffemodel",
    "trained/everpeace_caffe_2014_v1format/examples/cifar10/cifar10_quick.prototxt":
        "trained/everpeace_caffe_2014_v1format/examples/cifar10/cifar10_quick_iter_5000.caffemodel",
    "trained/cifar10_hdf5_siegfriedgreg/examples/cifar10/cifar10_full.prototxt":
        "trained/cifar10_hdf5_siegfriedgreg/examples/cifar10/cifar10_full_iter_100000.caffemodel.h5",
    "trained/cifar10_hdf5_siegfriedgreg/examples/cifar10/cifar10_quick.prototxt":
        "trained/cifar10_hdf5_siegfriedgreg/examples/cifar10/cifar10_quick_iter_5000.caffemodel.h5",
}
# Deploy nets only in the shared data (listed, so that they are reported skipped without it).
SHARED_ONLY = [f"densenet/DenseNet_{n}.prototxt" for n in (121, 161, 169, 201)] + [
    "vgg/model/VGG_ILSVRC_16_layers_deploy.prototxt", "vgg/model/VGG_ILSVRC_19_layers_deploy.prototxt"]
# Nets cut before a layer brewnet/deploy/fx_export.py's NO_GRAPH names (brewnet/execution/cut.py):
# the graph runs what comes before it, that layer and what it feeds run eagerly.
CUT = {
    "caffe-models/mobilenet-ssd/deploy.prototxt": "DetectionOutput",
    "caffe-models/mobilenet-ssd/voc/MobileNetSSD_deploy.prototxt": "DetectionOutput",
    "caffe-models/ssd/models/VGGNet/VOC0712/SSD_300x300/deploy.prototxt": "DetectionOutput",
    "forks/caffe_ocr_densenet_res_blstm_deploy.prototxt": "CTCGreedyDecoder",   # its output's length is data
    "forks/faceboxes_deploy.prototxt": "DetectionOutput",
    "forks/faster_rcnn_zf_test.prototxt": "Python",
    "forks/rfcn_resnet50_test_agnostic.prototxt": "Python",
    "forks/textboxes_deploy.prototxt": "DetectionOutput",
    "forks/textboxes_plusplus_deploy.prototxt": "DetectionOutput",
    "forks/yolov2_darknet19_deploy.prototxt": "YoloDetectionOutput",
    "forks/yolov3_lite_mobilenetv2_deploy.prototxt": "Yolov3DetectionOutput",
}
# Nets that stay on the eager path by design: the layer type that keeps them there.
EAGER = {"forks/warpctc_captcha_deploy.prototxt": "ContinuationIndicator"}   # a layer making its own data
# Default spatial size of the nets that are slow at their own size, for both batches (the
# BatchNorm statistics are drawn for it); each builds with every layer at that size, checked
# (BREWNET_ALL_NETS=1: the prototxt's size).
SIZES = {
    "caffe-models/bvlc/examples/net_surgery/bvlc_caffenet_full_conv.prototxt": 224,
    "caffe-models/densenet/DenseNet_121.prototxt": 64,
    "caffe-models/densenet/DenseNet_161.prototxt": 64,
    "caffe-models/densenet/DenseNet_169.prototxt": 64,
    "caffe-models/densenet/DenseNet_201.prototxt": 64,
    "caffe-models/mobilenet-ssd/deploy.prototxt": 160,
    "caffe-models/mobilenet-ssd/voc/MobileNetSSD_deploy.prototxt": 160,
    "caffe-models/mobilenet/mobilenet_v2_deploy.prototxt": 128,
    "caffe-models/squeezenet/SqueezeNet_v1.0/deploy.prototxt": 160,
    "caffe-models/squeezenet/SqueezeNet_v1.1/deploy.prototxt": 160,
    "forks/faceboxes_deploy.prototxt": 256,
    "forks/faster_rcnn_zf_test.prototxt": 96,
    "forks/rfcn_resnet50_test_agnostic.prototxt": 96,
    "forks/textboxes_deploy.prototxt": 160,
    "forks/textboxes_plusplus_deploy.prototxt": 300,
    "forks/yolov2_darknet19_deploy.prototxt": 96,
    "forks/yolov3_lite_mobilenetv2_deploy.prototxt": 96,
}
# Nets that take one image a batch (py-faster-rcnn's Proposal, the YOLO forks' detection
# outputs: their layers check it): their second round of calls is at batch 1 too, on an image
# of this size (another input shape: the same switches again). Calibrated on one image.
SINGLE_IMAGE = {"forks/faster_rcnn_zf_test.prototxt": 128,
                "forks/rfcn_resnet50_test_agnostic.prototxt": 128,
                "forks/warpctc_captcha_deploy.prototxt": 0,     # its indicator fixes batch 1, its size
                "forks/yolov2_darknet19_deploy.prototxt": 128,
                "forks/yolov3_lite_mobilenetv2_deploy.prototxt": 128}
# Build only at their own size (FCN-8s at any: its conv1_1 pads 100, so even a 32 x 32 input is
# a VGG-16 at 232 x 232), and cost more than this file's default budget on 2 cores.
LARGE = {
    "caffe-models/fcn/voc-fcn8s/deploy.prototxt",
    "caffe-models/resnet/prototxt/ResNet-101-deploy.prototxt",
    "caffe-models/resnet/prototxt/ResNet-152-deploy.prototxt",
    "caffe-models/soeaver/cls/inception/deploy_inception-v3.prototxt",
    "caffe-models/soeaver/cls/inception/deploy_inception-v4.prototxt",
    "caffe-models/soeaver/cls/inception/deploy_xception.prototxt",
    "caffe-models/soeaver/cls/vgg/deploy_vgg16-pytorch.prototxt",
    "caffe-models/soeaver/cls/vgg/deploy_vgg16bn-pytorch.prototxt",
    "caffe-models/vgg/model/VGG_ILSVRC_16_layers_deploy.prototxt",
    "caffe-models/vgg/model/VGG_ILSVRC_19_layers_deploy.prototxt",
    "caffe-models/ssd/models/VGGNet/VOC0712/SSD_300x300/deploy.prototxt",
    "forks/pspnet50_ADE20K_473.prototxt"} | {
    # the CI budget: DenseNet-121 stands for its family and py-faster-rcnn's ZF for the nets
    # with a Python Proposal layer (each of these took 40-120 s of a 2-core CI run)
    f"caffe-models/densenet/DenseNet_{n}.prototxt" for n in (161, 169, 201)} | {
    "caffe-models/fcn/voc-fcn8s/deploy.prototxt", "forks/rfcn_resnet50_test_agnostic.prototxt"}
# Known failures at their own size (BREWNET_ALL_NETS=1), each with its cause; strict (a fix
# makes the test pass and the mark must go) unless the failure depends on the thread tuner's
# timing.
XFAIL_ALL_NETS = {
    "forks/pspnet50_ADE20K_473.prototxt":
        "lean binds every oneDNN convolution's weight in NHWC memory (execution/lean.py "
        "_bind/_nhwc_weight) assuming NHWC inputs, but in PSPNet's head upsample_bilinear2d of "
        "the 1x1 pooled map returns NCHW and torch.cat of mixed layouts gives NCHW, so conv5_4 "
        "(3x3, 4096->512) runs as an NHWC convolution in the graph and an NCHW one on the eager "
        "path: other oneDNN kernels, outputs 1.5e-6 apart at one thread count (batch 2), not the "
        "same bits where no kernel was re-chosen",
    "caffe-models/soeaver/cls/inception/deploy_inception-v4.prototxt":
        "the thread tuner (execution/threads.py) runs some calls on another thread count; "
        "oneDNN's sums then run in another order, and 600 layers of random weights carry the "
        "rounding to the prob: call 9 (eager, 1 thread) differs from call 1 (2 threads) by "
        "1.18e-5 of the output's scale (eager at 2 vs 1 threads: 1.2e-5 at batch 1, 1.0e-5 at "
        "batch 2; the lean graph is not involved). Not strict: which calls the tuner runs on "
        "which count follows its timings (7.0e-6 in one benchmarks/every_call.py run)",
}
NOT_STRICT = {"caffe-models/soeaver/cls/inception/deploy_inception-v4.prototxt"}
_DEPLOY = re.compile(r'^\s*(input\s*:|input_shape\s*\{|input_dim\s*:)|type\s*:\s*"Input"', re.M)


def _is_deploy(path: Path) -> bool:
    """A net fed by Input layers or input dims, not a train/test net, solver or label map."""
    if "solver" in path.name or "train_val" in path.name:
        return False
    text = path.read_text(errors="replace")
    return "layer" in text and bool(_DEPLOY.search(text))


def _nets() -> list[str]:
    names = {f"caffe-models/{rel}" for rel in SHARED_ONLY}
    for root, prefix in ((VENDORED / "caffe-models", "caffe-models/"), (VENDORED / "forks", "forks/"),
                         (SHARED / "caffe-models", "caffe-models/")):
        if root.is_dir():
            names |= {prefix + p.relative_to(root).as_posix() for p in root.rglob("*.prototxt")
                      if _is_deploy(p)}
    return sorted(names)


def _param(name: str):
    marks = [pytest.mark.xfail(ALL_NETS, strict=name not in NOT_STRICT, reason=XFAIL_ALL_NETS[name])] \
        if name in XFAIL_ALL_NETS else []
    return pytest.param(name, marks=marks, id=name.removesuffix(".prototxt"))


NETS = _nets()


def _prototxt(name: str) -> Path:
    if name.startswith("forks/"):
        return VENDORED / name
    return need(pick(name))          # skips (one reason) a net only in the absent shared data


def _weights(name: str) -> Path | None:
    rel = WEIGHTS.get(name.removeprefix("caffe-models/"))
    path = SHARED / "caffe-models" / rel if rel else None
    return path if path is not None and have(path) and path.exists() else None


def realistic(net, size: int, images: int = 4, seed: int = 0) -> None:
    """Random weights that compute what a trained net would, drawn on ``images`` random
    calibration inputs of ``size`` (not the test's) in one layer-by-layer pass of the core net
    (no pycaffe call: nothing is counted). A weight the prototxt leaves at Caffe's default
    constant 0 filler is drawn He-scaled (ResNet's deploy prototxts have no fillers); each
    Convolution/InnerProduct is scaled to outputs of unit deviation (LSUV: logits, and SSD's box
    offsets that go through exp(), at a trained net's magnitudes); each BatchNorm (and PSPNet's
    BN) gets its bottom's statistics, the mean moved by N(0, 0.1) - 0.5 deviations, the
    variance (floored at a tenth of the layer's mean) scaled by U(0.5, 1.5), scale factor 1; a
    Scale after it weights in U(0.5, 1.5), a bias of N(0, 0.1). Fixed statistics let random
    deep nets overflow (MobileNetV2-YOLOv3 reached 1e6, its exp() inf); statistics of one small
    image, or every ReLU's input centred exactly, make them chaotic (a 1e-7 change of the input
    moved random ResNet-152's prob by 5.7e-4, trained open_nsfw's by 3e-7): then any change of
    summation order exceeds ``LEAN_RTOL``."""
    feed(net, images, size, seed=100 + seed)
    rng = np.random.default_rng(seed)
    params = net.params                      # (built anew at each access)
    for layer in net.layer_list:
        if layer.blobs and layer.type in ("Convolution", "InnerProduct", "Deconvolution",
                                          "DepthwiseConvolution"):
            w = params[layer.name][0].data
            if w.size and not w.any():
                w[...] = rng.normal(0, np.sqrt(2.0 / w[0].size), w.shape)

    def stats(i: int):
        x = net.blobs[net.bottom_lists[i][0]].tensor.detach().double().cpu().numpy()
        c = x.shape[1] if x.ndim > 1 else 1
        x = np.moveaxis(x.reshape(x.shape[0], c, -1), 1, 0).reshape(c, -1)
        mean, var = x.mean(1), x.var(1)
        if x.shape[1] < 2 or not var.any():
            var = np.full(c, x.var() or 1.0)
        var = np.maximum(var, 0.1 * var.mean())       # a channel few positions reached
        return c, mean + (rng.normal(0, 0.1, c) - 0.5) * np.sqrt(var), var * rng.uniform(0.5, 1.5, c)

    after_bn = False
    with torch.no_grad():
        for i, layer in enumerate(net.layer_list):
            if layer.type == "Input":
                continue
            b = params.get(layer.name)
            if layer.type == "BatchNorm":
                c, mean, var = stats(i)
                for blob, v in zip(b, (mean, var, np.ones(1))):
                    blob.data[...] = v.reshape(blob.data.shape)
            elif layer.type == "BN" and len(b) == 4:       # PSPNet's: slope, bias, mean, var
                c, mean, var = stats(i)
                for blob, v in zip(b, (rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), mean, var)):
                    blob.data[...] = v.reshape(blob.data.shape)
            elif layer.type == "Scale" and after_bn:
                b[0].data[...] = rng.uniform(0.5, 1.5, b[0].data.shape)
                if len(b) > 1:
                    b[1].data[...] = rng.normal(0, 0.1, b[1].data.shape)
            after_bn = layer.type == "BatchNorm"
            net.forward_tensors(start=i, end=i)
            top = net.top_lists[i][0] if net.top_lists[i] else None
            if (layer.type in ("Convolution", "InnerProduct", "DepthwiseConvolution")
                    and top not in net.bottom_lists[i]):
                t = net.blobs[top].tensor.detach().double()
                std = float(t.std()) if t.numel() > 1 else 0.0
                if std > 0:
                    for blob in b:
                        blob.data[...] /= std
                    net.forward_tensors(start=i, end=i)


def feed(net, batch: int, size: int, seed: int) -> None:
    """Reshape the input blobs to ``batch`` (``size``: spatial size, 0 as they are), as pycaffe
    users do, and write one fixed random input (``im_info``: the image's height, width, 1)."""
    image = None
    for name in net.inputs:
        shape = list(net.blobs[name].data.shape)
        shape[0] = batch
        if len(shape) == 4:
            if size:
                shape[2:] = [size, size]
            image = image or shape[2:]
        net.blobs[name].reshape(*shape)
    net.reshape()
    rng = np.random.default_rng(seed)
    for name in net.inputs:
        data = net.blobs[name].data
        if name == "im_info" and image is not None:
            data[...] = [image[0], image[1], 1.0]
        else:
            data[...] = rng.standard_normal(data.shape).astype(np.float32)


def rechosen(gm) -> list[str]:
    """The nodes where the lean graph runs another kernel than the eager path: torch's im2col
    convolution (``lean.small_conv``), BLAS for an inner product the eager path gives oneDNN, a
    convolution with oneDNN post-ops (execution/postops.py: may run another oneDNN algorithm)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is lean.small_conv or str(n.target).startswith("mkldnn._convolution_pointwise"):
            out.append(n.name)
        elif n.target in (torch.addmm, torch.mm, torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            t = n.args[-1]
            if (getattr(t, "op", None) == "call_function" and t.args
                    and getattr(t.args[0], "op", None) == "get_attr"
                    and operator.attrgetter(t.args[0].target)(gm).numel() >= Fn.DNN_MIN_WEIGHT):
                out.append(n.name)
    return out


def same_rows(got: np.ndarray, want: np.ndarray, tol: float, where: str) -> None:
    """The rows (last axis) of a cut net's tail output (detections, proposals) as sets: as many,
    each wanted row matched by its own row of ``got`` within ``tol``: NMS on values a sum in
    another order made may list near-tied boxes in another order."""
    g, w = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    assert len(g) == len(w), f"{where}: {len(g)} rows, call 1 had {len(w)}"
    free = np.ones(len(g), dtype=bool)
    for row in w:
        dev = np.abs(g - row).max(axis=1)
        hit = np.flatnonzero(free & (dev <= tol))
        assert len(hit), (f"{where}: call 1's row {row.tolist()} is missing (nearest "
                          f"{g[dev.argmin()].tolist()}, {dev.min():.3g} off; tolerance {tol:.3g})")
        free[hit[0]] = False


def calls(net, n: int, where: str, as_sets: bool = False) -> tuple[list, dict]:
    """``n`` calls of ``net.forward()``, each checked against the first as it comes (the outputs
    of a segmentation net are large: only the first of each path and thread count are kept;
    ``as_sets``: the outputs' rows compared as sets, ``same_rows``). Returns the (path,
    threads) of each call and {(path, threads): (its first outputs, call)}."""
    modes, first, ref = [], {}, None
    for i in range(1, n + 1):
        o = {k: v.copy() for k, v in net.forward().items()}
        engine = net._lean.engine
        m = ((engine.name, engines.cores()) if engine is not None else
             ("lean" if net._lean.gm is not None else "eager", torch.get_num_threads()))
        modes.append(m)
        rtol = engines.RTOL[torch.float32] if engine is not None else LEAN_RTOL
        ref = ref or o
        assert o.keys() == ref.keys()
        for k in ref:
            assert o[k].shape == ref[k].shape, f"{where} call {i} {m}: '{k}' {o[k].shape} vs {ref[k].shape}"
            assert np.isfinite(ref[k]).all(), f"{where}: '{k}' is not finite in call 1"
            scale = float(np.abs(ref[k]).max()) if ref[k].size else 0.0
            if as_sets and ref[k].ndim > 1:
                same_rows(o[k], ref[k], TAIL_GAIN * rtol * scale, f"{where} call {i} {m}: '{k}'")
                continue
            dev = float(np.abs(o[k].astype(np.float64) - ref[k]).max()) if ref[k].size else 0.0
            assert dev <= rtol * scale, \
                f"{where} call {i} {m}: '{k}' differs from call 1 by {dev:.3g} ({dev / scale:.3g} of its scale)"
        if m in first:     # the same path and thread count: the same bits
            for k in ref:
                np.testing.assert_array_equal(o[k], first[m][0][k], err_msg=f"{where} call {i} vs "
                                              f"call {first[m][1]}, both {m[0]} on {m[1]} thread(s)")
        else:
            first[m] = (o, i)
    return modes, first


def same_bits_as_eager(first: dict, where: str) -> None:
    """The lean graph's calls against the eager path's on the same thread count, bit for bit."""
    for (path, threads), (o, i) in first.items():
        if path == "lean" and ("eager", threads) in first:
            e, j = first[("eager", threads)]
            for k in o:
                np.testing.assert_array_equal(o[k], e[k], err_msg=f"{where}: lean call {i} vs "
                                              f"eager call {j} on {threads} thread(s)")


@pytest.fixture(autouse=True)
def _free_the_net():
    """A Net lives in reference cycles (its layers, its lean forward): free each net's memory
    before the next test builds one, not when the cyclic collector next runs, and hand the heap
    brewnet keeps for reuse (execution/process.py) back, so a large net starts from little."""
    yield
    gc.collect()
    free_heap()


def free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):     # not glibc
        pass


@pytest.mark.parametrize("name", [_param(n) for n in NETS])
def test_call_n_equals_call_1(name, caplog, monkeypatch):
    if name in LARGE and not ALL_NETS:
        pytest.skip("a large net that builds only at its own size: BREWNET_ALL_NETS=1 runs it")
    monkeypatch.delenv("BREWNET_LEAN", raising=False)         # the user's defaults
    proto, weights = _prototxt(name), _weights(name)
    size = 0 if ALL_NETS else SIZES.get(name, 0)
    brewnet.set_random_seed(0)
    net = brewnet.Net(str(proto), brewnet.TEST, weights=str(weights) if weights else None)
    if weights is None:      # one calibration image where it holds enough positions
        side = size or max(net.blobs[net.inputs[0]].data.shape[2:])
        realistic(net, size, 1 if name in SINGLE_IMAGE or side >= 400 else 4)
    feed(net, 1, size, seed=1)
    caplog.clear()
    graph = name not in EAGER
    with caplog.at_level(logging.INFO, logger="brewnet"):
        second = (1, SINGLE_IMAGE[name]) if name in SINGLE_IMAGE else (2, size)
        for (batch, side), seed in zip(((1, size), second), (1, 2)):
            if seed != 1:
                feed(net, batch, side, seed)
            where = f"batch {batch} at {'x'.join(map(str, net.blobs[net.inputs[0]].data.shape))}"
            modes, first = calls(net, CALLS, where, as_sets=name in CUT)
            # (auto's engine, where it switched on: a graph too, checked against eager's outputs)
            paths = ["lean" if m[0] in engines.BUILDERS else m[0] for m in modes]
            if graph:
                assert paths == ["eager"] * lean.AFTER + ["lean"] * (CALLS - lean.AFTER), \
                    f"{where}: the lean graph did not take over at call {lean.AFTER + 1}: {paths}"
                if not rechosen(net._lean.gm):     # no kernel re-chosen: the eager path's bits
                    same_bits_as_eager(first, where)
            else:
                assert paths == ["eager"] * CALLS, f"{where}: {paths}"
            del first
    warnings = [r for r in caplog.records if r.name.startswith("brewnet") and r.levelno >= logging.WARNING]
    assert not warnings, "\n".join(r.getMessage() for r in warnings)
    named = EAGER.get(name) or CUT.get(name)
    if named:
        assert any(f"(type {named})" in r.getMessage() for r in caplog.records), \
            f"no record names the {named} layer that keeps the net eager or cuts it: {caplog.text}"
