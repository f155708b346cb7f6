"""Inference cost of the built-in layers: each layer's forward under ``torch.no_grad`` against the
same forward with the formula it used before its inference form patched back in (the old
formulas are kept here as the reference), at batch 1 and 16.

    python benchmarks/layer_passes.py [--threads 1] [--repeats 30] [--batches 1,16] [--nchw]

Inputs are NHWC (channels_last), the layout brewnet's CPU nets run convolution nets in (``--nchw``:
plain NCHW). Each round calls every variant of a case once, in turn (the machine is shared and
noisy); the table shows medians in microseconds. Layers whose forward did not change are timed
once and shown as unchanged. "Before" for MAX pooling is the old no-mask path, which skipped the
clamp to -FLT_MAX (and so gave -inf, not Caffe's -FLT_MAX, for a window of -inf only).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import brewnet.layers.common as common
import brewnet.layers.functional as Fn
import brewnet.layers.neuron as neuron
import brewnet.layers.pooling as Pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import make_layer  # noqa: E402

_new_max_pool2d = Pool.max_pool2d


# -- the formulas before the inference forms ---------------------------------------------------
def prelu_before(x, slope):
    if slope.dim() == 1:
        slope = slope.view((1, -1) + (1,) * (x.dim() - 2))
    return torch.where(x > 0, x, x * slope)


def max_pool2d_before(x, kernel, stride, pad, ceil_mode=True, return_mask=False):
    """The old no-mask path where torch's windows are Caffe's: no clamp to -FLT_MAX."""
    in_hw = tuple(x.shape[-2:])
    out_hw = Pool.pool_out_shape(in_hw, kernel, stride, pad, ceil_mode)
    if not return_mask and Pool._native_pool_ok(in_hw, out_hw, kernel, stride, pad, ceil_mode):
        return F.max_pool2d(x, tuple(kernel), tuple(stride), tuple(pad), ceil_mode=ceil_mode), None
    return _new_max_pool2d(x, kernel, stride, pad, ceil_mode, return_mask)


def eltwise_sum_before(xs, coeffs):
    top = None
    for c, x in zip(coeffs, xs):
        term = x if c == 1 else x * c
        top = term if top is None else top + term
    return top


def eltwise_max_before(xs):
    top = torch.where(xs[0] > xs[1], xs[0], xs[1])
    for x in xs[2:]:
        top = torch.where(x > top, x, top)
    return top


def lrn_across_before(x, size, alpha, beta, k):
    n, c = x.shape[:2]
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        sq = (x * x).permute(0, 2, 3, 1).reshape(-1, 1, c)
        mean = F.avg_pool1d(sq, size, stride=1, padding=(size - 1) // 2, count_include_pad=True)
        mean = mean.view(n, x.shape[2], x.shape[3], c).permute(0, 3, 1, 2)
    else:
        sq = (x * x).reshape(n, 1, c, -1)
        mean = F.avg_pool2d(sq, (size, 1), stride=1, padding=((size - 1) // 2, 0),
                            count_include_pad=True).view_as(x)
    return x * (k + alpha * mean).pow(-beta)


def lrn_within_before(x, size, alpha, beta):
    mean = F.avg_pool2d(x * x, size, stride=1, padding=(size - 1) // 2, count_include_pad=True)
    return x * (1 + alpha * mean).pow(-beta)


PRELU = [(neuron, "prelu", prelu_before)]
MAXPOOL = [(Fn, "max_pool2d", max_pool2d_before)]
SUM = [(common, "eltwise_sum", eltwise_sum_before)]
PROD = [(Fn, "grad_needed", lambda *ts: True)]        # the old, out-of-place chain
MAX = [(common, "eltwise_max", eltwise_max_before)]
LRN = [(Fn, "lrn_across_channels", lrn_across_before), (Fn, "lrn_within_channel", lrn_within_before)]


def patched(patches, fn):
    """``fn`` run with the old formulas in place of the new ones."""
    def run():
        saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
        for m, name, old in patches:
            setattr(m, name, old)
        try:
            return fn()
        finally:
            for m, name, new in saved:
                setattr(m, name, new)
    return run


# -- cases: (name, layer text, bottom shapes at batch n, the old formulas or None) --------------
def cases(n: int):
    s = (n, 32, 56, 56)
    return [
        ("ReLU slope 0.1", 'type: "ReLU" relu_param { negative_slope: 0.1 }', [s], None),
        ("PReLU", 'type: "PReLU"', [s], PRELU),
        ("PReLU (MTCNN det3 conv1)", 'type: "PReLU"', [(n, 32, 46, 46)], PRELU),
        ("MAX pool 3x3 s2", 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }',
         [s], MAXPOOL),
        ("MAX pool 2x2 s2", 'type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }',
         [s], MAXPOOL),
        ("Eltwise SUM coeff 1,-1", 'type: "Eltwise" eltwise_param { coeff: 1 coeff: -1 }', [s, s], SUM),
        ("Eltwise SUM coeff .5,2,3", 'type: "Eltwise" eltwise_param { coeff: 0.5 coeff: 2 coeff: 3 }',
         [s, s, s], SUM),
        ("Eltwise SUM", 'type: "Eltwise"', [s, s], None),
        ("Eltwise PROD x3", 'type: "Eltwise" eltwise_param { operation: PROD }', [s, s, s], PROD),
        ("Eltwise MAX", 'type: "Eltwise" eltwise_param { operation: MAX }', [s, s], MAX),
        ("Eltwise MAX x3", 'type: "Eltwise" eltwise_param { operation: MAX }', [s, s, s], MAX),
        ("Scale + bias", 'type: "Scale" scale_param { bias_term: true }', [s], None),
        ("Bias", 'type: "Bias"', [s], None),
        ("Concat", 'type: "Concat"', [s, s], None),
        ("Softmax (axis 1)", 'type: "Softmax"', [s], None),
        ("LRN across 5", 'type: "LRN" lrn_param { local_size: 5 alpha: 1e-4 beta: 0.75 }', [s], LRN),
        ("LRN within 5", 'type: "LRN" lrn_param { local_size: 5 alpha: 1e-4 beta: 0.75 '
         'norm_region: WITHIN_CHANNEL }', [s], LRN),
        ("Deconv 4x4 s2 group=C", 'type: "Deconvolution" convolution_param { num_output: 32 '
         'kernel_size: 4 stride: 2 pad: 1 group: 32 bias_term: false weight_filler { type: '
         '"bilinear" } }', [(n, 32, 28, 28)], None),
        ("Conv 3x3 depthwise", 'type: "Convolution" convolution_param { num_output: 32 group: 32 '
         'kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } }', [s], None),
        ("BatchNorm global", 'type: "BatchNorm" batch_norm_param { use_global_stats: true }', [s],
         None),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--nchw", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"{'NCHW' if args.nchw else 'NHWC'}, median of {args.repeats} interleaved rounds, us")
    print(f"{'layer':28s} {'shape':20s} {'before':>9s} {'after':>9s} {'after/before':>12s}")
    for n in (int(b) for b in args.batches.split(",")):
        for name, text, shapes, before in cases(n):
            bottoms = " ".join(f'bottom: "b{i}"' for i in range(len(shapes)))
            layer, _ = make_layer(f'name: "l" {text} {bottoms} top: "t"', shapes)
            if name.startswith("BatchNorm"):
                with torch.no_grad():
                    layer.blobs[0].normal_()
                    layer.blobs[1].uniform_(0.5, 2)
                    layer.blobs[2].fill_(1)
            xs = [torch.randn(s) for s in shapes]
            if not args.nchw:
                xs = [x.contiguous(memory_format=torch.channels_last) for x in xs]
            variants = {"after": lambda: layer.forward(xs)}
            if before is not None:
                variants["before"] = patched(before, variants["after"])
            times = {k: [] for k in variants}
            with torch.no_grad():
                outs = [f() for f in variants.values()]     # warm-up, and the same numbers
                for a, b in zip(outs[0], outs[-1]):
                    torch.testing.assert_close(a, b)
                for _ in range(args.repeats):
                    for k, f in variants.items():
                        t = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            shape = "x".join(map(str, shapes[0])) + (f" x{len(shapes)}" if len(shapes) > 1 else "")
            if "before" in med:
                print(f"{name:28s} {shape:20s} {med['before']:9.0f} {med['after']:9.0f} "
                      f"{med['after'] / med['before']:12.2f}")
            else:
                print(f"{name:28s} {shape:20s} {'unchanged':>9s} {med['after']:9.0f}")


if __name__ == "__main__":
    main()
