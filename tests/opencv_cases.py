"""The table of tests/test_opencv_oracle.py: one net per row, drawn by seeded per-layer generators.

Where OpenCV departs from Caffe, the configuration is not drawn; each exclusion comment names
the Caffe fact (BVLC/caffe or the SSD fork's source, or the golden README's "Caffe behaviours
worth knowing") that makes brewnet right there.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

# max |brewnet - OpenCV| <= tol * max(1, max |OpenCV|); both sides compute in float32.
ATOL_ELEMENTWISE = 2e-6   # copies, max, elementwise math: a few ulps (libm vs torch exp/log/pow)
ATOL_REDUCE = 2e-5        # sums of up to ~1000 products in another order (GEMM vs oneDNN/Winograd)


# -- rows ---------------------------------------------------------------------------------------
class Case:
    """One net: its layers (text after the Input layers), input shapes, outputs to compare.

    ``data``: how inputs are drawn, one kind or {input name: kind} ("normal", "positive",
    "unit", "large"). ``fill``: fill(layer type, param blobs, rng) after the standard-normal fill.
    ``detections``: outputs are DetectionOutput blobs (compared as Caffe orders them).
    """

    def __init__(self, id, layers, inputs, outputs, tol=ATOL_REDUCE, data="normal", fill=None,
                 detections=()):
        self.id, self.layers, self.inputs, self.outputs = id, layers, inputs, outputs
        self.tol, self.data, self.fill, self.detections = tol, data, fill, set(detections)

    def __repr__(self):
        return self.id


def layer(name, type, bottoms, tops=None, params=""):
    bottoms = [bottoms] if isinstance(bottoms, str) else bottoms
    tops = [name] if tops is None else tops
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    return f'layer {{ name: "{name}" type: "{type}" {b} {t} {params} }}\n'


def seed_of(text):
    return zlib.crc32(text.encode())


def gen_rng(name):
    return np.random.default_rng(seed_of(name))


def tf(flag):
    return "true" if flag else "false"


# -- vision layers ------------------------------------------------------------------------------
def conv_cases(n=30):
    r = gen_rng("Convolution")
    out = []
    while len(out) < n:
        cin = int(r.choice([1, 2, 3, 4, 6]))
        group = int(r.choice([1] + ([2] if cin % 2 == 0 else []) + ([cin] if cin > 2 else [])))
        cout = group * int(r.choice([1, 2, 3]))
        H, W = (int(v) for v in r.integers(5, 14, size=2))
        rect = r.random() < 0.35
        k = r.integers(1, 6, size=2) if rect else np.repeat(r.integers(1, 6), 2)
        s = r.integers(1, 4, size=2) if rect else np.repeat(r.integers(1, 4), 2)
        p = r.integers(0, 3, size=2) if rect else np.repeat(r.integers(0, 3), 2)
        if rect and r.random() < 0.5:
            d = r.integers(1, 4, size=2)
        else:
            d = np.repeat(r.integers(1, 4) if r.random() < 0.4 else 1, 2)
        if (d * (k - 1) + 1 > np.array([H, W]) + 2 * p).any():
            continue
        bias = bool(r.random() < 0.7)
        if rect and r.random() < 0.5:   # the repeated-field spelling of a rectangle
            spec = f"kernel_size: {k[0]} kernel_size: {k[1]} stride: {s[0]} stride: {s[1]} pad: {p[0]} pad: {p[1]}"
        elif rect:
            spec = (f"kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} stride_w: {s[1]} "
                    f"pad_h: {p[0]} pad_w: {p[1]}")
        else:
            spec = f"kernel_size: {k[0]} stride: {s[0]} pad: {p[0]}"
        if (d != 1).any():
            spec += f" dilation: {d[0]}" + (f" dilation: {d[1]}" if d[1] != d[0] else "")
        params = f"convolution_param {{ num_output: {cout} {spec} group: {group} bias_term: {tf(bias)} }}"
        N = int(r.integers(1, 3))
        cid = (f"conv{len(out)}_{N}x{cin}x{H}x{W}_o{cout}g{group}_k{k[0]}x{k[1]}s{s[0]}x{s[1]}"
               f"p{p[0]}x{p[1]}d{d[0]}x{d[1]}{'' if bias else '_nobias'}")
        out.append(Case(cid, layer("y", "Convolution", "x", params=params), {"x": (N, cin, H, W)}, ["y"]))
    return out


def deconv_cases(n=15):
    # No dilation: OpenCV's deconvolution ignores it in the output size, while Caffe's
    # DeconvolutionLayer::compute_output_shape uses stride*(in-1) + dilation*(k-1)+1 - 2*pad.
    r = gen_rng("Deconvolution")
    out = []
    while len(out) < n:
        cin = int(r.choice([1, 2, 4, 6]))
        group = int(r.choice([1] + ([2] if cin % 2 == 0 else []) + ([cin] if cin > 2 else [])))
        cout = group * int(r.choice([1, 2]))
        H, W = (int(v) for v in r.integers(3, 9, size=2))
        rect = r.random() < 0.3
        k = r.integers(1, 5, size=2) if rect else np.repeat(r.integers(1, 5), 2)
        s = r.integers(1, 4, size=2) if rect else np.repeat(r.integers(1, 4), 2)
        p = r.integers(0, 3, size=2) if rect else np.repeat(r.integers(0, 3), 2)
        if (s * (np.array([H, W]) - 1) + k - 2 * p < 1).any():
            continue
        # A padded 1x1 stride-1 deconvolution: OpenCV ignores the pad and writes past its output
        # (heap corruption); Caffe's col2im crops the pad, giving w * x[pad:-pad].
        if ((k == 1) & (s == 1) & (p > 0)).any():
            continue
        bias = bool(r.random() < 0.7)
        spec = (f"kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]}"
                if rect else f"kernel_size: {k[0]} stride: {s[0]} pad: {p[0]}")
        params = f"convolution_param {{ num_output: {cout} {spec} group: {group} bias_term: {tf(bias)} }}"
        cid = (f"deconv{len(out)}_c{cin}x{H}x{W}_o{cout}g{group}_k{k[0]}x{k[1]}s{s[0]}x{s[1]}"
               f"p{p[0]}x{p[1]}{'' if bias else '_nobias'}")
        out.append(Case(cid, layer("y", "Deconvolution", "x", params=params), {"x": (2, cin, H, W)}, ["y"]))
    return out


def caffe_pooled(size, k, s, p, any_pad):
    """Caffe's pooled size: ceil rule, minus one when padded and the last window starts at or
    beyond size + pad; the clip is applied to both axes as soon as either has a pad."""
    n = int(math.ceil((size + 2 * p - k) / s)) + 1
    return n - 1 if any_pad and (n - 1) * s >= size + p else n


def opencv_pools_like_caffe(H, W, k, s, p):
    """False where OpenCV's pooling departs from Caffe's (pooling_layer.cpp):
    - no pad and a last window that starts at or beyond the input (stride > kernel): Caffe keeps
      the empty window (MAX: -FLT_MAX, AVE: 0/0), OpenCV writes 0 or fails;
    - only one axis padded: Caffe clips the last window on both axes as soon as either
      has a pad, OpenCV only on the padded axis."""
    any_pad = bool(p[0] or p[1])
    for size, kk, ss, pp in ((H, k[0], s[0], p[0]), (W, k[1], s[1], p[1])):
        n = caffe_pooled(size, kk, ss, pp, any_pad)
        if (n - 1) * ss - pp >= size:
            return False
        if any_pad and pp == 0 and n != caffe_pooled(size, kk, ss, pp, False):
            return False
    return True


def pool_cases(n=40):
    r = gen_rng("Pooling")
    out = []
    while len(out) < n:
        method = ["MAX", "AVE"][len(out) % 2]
        C = int(r.integers(1, 4))
        H, W = (int(v) for v in r.integers(3, 14, size=2))
        if r.random() < 0.12:
            cid = f"pool{len(out)}_{method}_global_{H}x{W}"
            params = f"pooling_param {{ pool: {method} global_pooling: true }}"
        else:
            rect = r.random() < 0.35
            k = r.integers(1, 5, size=2) if rect else np.repeat(r.integers(1, 5), 2)
            s = r.integers(1, 5, size=2) if rect else np.repeat(r.integers(1, 5), 2)
            # Caffe CHECKs pad < kernel.
            p = np.array([r.integers(0, k[0]), r.integers(0, k[1])]) if rect else np.repeat(r.integers(0, k[0]), 2)
            if k[0] > H + 2 * p[0] or k[1] > W + 2 * p[1] or not opencv_pools_like_caffe(H, W, k, s, p):
                continue
            spec = (f"kernel_h: {k[0]} kernel_w: {k[1]} stride_h: {s[0]} stride_w: {s[1]} pad_h: {p[0]} pad_w: {p[1]}"
                    if rect else f"kernel_size: {k[0]} stride: {s[0]} pad: {p[0]}")
            params = f"pooling_param {{ pool: {method} {spec} }}"
            cid = f"pool{len(out)}_{method}_{H}x{W}_k{k[0]}x{k[1]}s{s[0]}x{s[1]}p{p[0]}x{p[1]}"
        tol = ATOL_ELEMENTWISE if method == "MAX" else ATOL_REDUCE
        tops = ["y", "mask"] if method == "MAX" and len(out) % 4 == 0 else ["y"]   # argmax h * W + w
        out.append(Case(cid + ("_mask" if len(tops) == 2 else ""), layer("pool", "Pooling", "x", tops, params),
                        {"x": (2, C, H, W)}, tops, tol=tol))
    return out


def lrn_cases(n=14):
    # ACROSS_CHANNELS keeps k = 1: OpenCV ignores Caffe's `k` there (its bias stays 1), while
    # Caffe's LRNLayer fills the scale with k_ before adding alpha/n * sum x^2 (golden
    # lrn_across, k 2). WITHIN_CHANNEL ignores k in Caffe (golden README), so k is drawn there.
    r = gen_rng("LRN")
    out = []
    for i in range(n):
        region = ["ACROSS_CHANNELS", "WITHIN_CHANNEL"][i % 2]
        size = int(r.choice([1, 3, 5, 7]))
        alpha, beta = float(r.uniform(0.1, 3.0)), float(r.uniform(0.3, 1.0))
        k = 1.0 if region == "ACROSS_CHANNELS" else float(r.uniform(0.5, 3.0))
        C, H, W = int(r.integers(1, 9)), int(r.integers(3, 9)), int(r.integers(3, 9))
        params = f"lrn_param {{ norm_region: {region} local_size: {size} alpha: {alpha:.4f} beta: {beta:.4f} k: {k:.4f} }}"
        cid = f"lrn{i}_{region}_n{size}_c{C}x{H}x{W}"
        out.append(Case(cid, layer("y", "LRN", "x", params=params), {"x": (2, C, H, W)}, ["y"]))
    return out


def ip_cases(n=12):
    # No `transpose: true`: OpenCV reads the (K, N) weight blob as if it were (N, K); Caffe's
    # InnerProductLayer stores it transposed and multiplies x W (golden ip_transpose).
    r = gen_rng("InnerProduct")
    out = []
    for i in range(n):
        shape = tuple(int(v) for v in r.integers(1, 6, size=int(r.choice([2, 3, 4]))))
        axis = int(r.integers(-len(shape) + 1, len(shape)))
        bias = bool(r.random() < 0.7)
        params = f"inner_product_param {{ num_output: {int(r.integers(1, 8))} axis: {axis} bias_term: {tf(bias)} }}"
        cid = f"ip{i}_{'x'.join(map(str, shape))}_axis{axis}{'' if bias else '_nobias'}"
        out.append(Case(cid, layer("y", "InnerProduct", "x", params=params), {"x": shape}, ["y"]))
    return out


def softmax_cases():
    rows = [((2, 5, 3, 4), 1), ((2, 5, 3, 4), 0), ((2, 5, 3, 4), 2), ((2, 5, 3, 4), 3),
            ((2, 5, 3, 4), -1), ((3, 7), 1), ((3, 7), 0), ((2, 4, 6), -2)]
    return [Case(f"softmax{i}_{'x'.join(map(str, s))}_axis{a}",
                 layer("y", "Softmax", "x", params=f"softmax_param {{ axis: {a} }}"), {"x": s}, ["y"])
            for i, (s, a) in enumerate(rows)]


# -- neurons, elementwise -----------------------------------------------------------------------
def _positive_params(type, blobs, rng):
    for b in blobs:
        b.data[...] = rng.uniform(0.1, 1.0, b.data.shape).astype(np.float32)


def neuron_cases():
    # Not drawn: PReLU channel_shared (and any 0-axis param blob, e.g. Scale num_axes 0): Caffe
    # stores that param as a blob with no axes (shape {}), which OpenCV's reader cannot create.
    # Log with base/scale/shift: OpenCV computes ln(x) and ignores log_param, Caffe's LogLayer
    # computes log(shift + scale x) / ln(base) (golden log_base10).
    X, E = {"x": (2, 3, 4, 5)}, ATOL_ELEMENTWISE
    rows = [
        ("relu", "ReLU", ""), ("relu_leaky", "ReLU", "relu_param { negative_slope: 0.1 }"),
        ("relu_slope_neg", "ReLU", "relu_param { negative_slope: -1.5 }"),
        ("prelu", "PReLU", ""), ("elu", "ELU", ""), ("elu_alpha", "ELU", "elu_param { alpha: 0.3 }"),
        ("elu_alpha_big", "ELU", "elu_param { alpha: 2.5 }"),
        ("sigmoid", "Sigmoid", ""), ("tanh", "TanH", ""), ("absval", "AbsVal", ""), ("bnll", "BNLL", ""),
        ("power_sq", "Power", "power_param { power: 2 scale: 0.5 shift: 1 }"),
        ("power_lin", "Power", "power_param { power: 1 scale: -2 shift: 0.5 }"),
        ("power_cube", "Power", "power_param { power: 3 scale: 1.5 shift: -0.2 }"),
        ("power_zero", "Power", "power_param { power: 0 scale: 3 shift: 1 }"),
        ("power_default", "Power", ""),
        ("exp", "Exp", ""), ("exp_base2", "Exp", "exp_param { base: 2 scale: 0.5 shift: 0.3 }"),
        ("exp_base10", "Exp", "exp_param { base: 10 scale: -0.7 }"),
        ("exp_shift", "Exp", "exp_param { shift: -1 scale: 2 }"),
        ("dropout", "Dropout", "dropout_param { dropout_ratio: 0.3 }"),
        ("dropout_default", "Dropout", ""),
    ]
    out = [Case(i, layer("y", t, "x", params=p), X, ["y"], tol=E) for i, t, p in rows]
    positive = [
        ("power_sqrt", "Power", "power_param { power: 0.5 scale: 2 shift: 0.1 }"),
        ("power_inv", "Power", "power_param { power: -1 scale: 1 shift: 0.2 }"),
        ("power_frac", "Power", "power_param { power: 2.5 scale: 0.7 }"),
        ("log", "Log", ""),
    ]
    out += [Case(i, layer("y", t, "x", params=p), X, ["y"], tol=E, data="positive") for i, t, p in positive]
    out.append(Case("prelu_positive_slopes", layer("y", "PReLU", "x"), X, ["y"], tol=E, fill=_positive_params))
    out.append(Case("prelu_2d", layer("y", "PReLU", "x"), {"x": (4, 6)}, ["y"], tol=E))
    # In place on an input blob, then a convolution: the convolution must read the scaled input
    # (brewnet once kept feeding later layers its channels_last copy of the original).
    out.append(Case("power_inplace_on_input_then_conv",
                    layer("p", "Power", "x", ["x"], "power_param { scale: 2 shift: 0.5 }")
                    + layer("c", "Convolution", "x", params="convolution_param { num_output: 3 kernel_size: 3 }"),
                    X, ["c"]))
    out.append(Case("relu_inplace_after_conv",
                    layer("c", "Convolution", "x", params="convolution_param { num_output: 4 kernel_size: 3 }")
                    + layer("r", "ReLU", "c", ["c"]), X, ["c"]))
    return out


def eltwise_cases():
    out = []
    S = (2, 3, 4, 5)
    for i, (op, nb, extra) in enumerate([("SUM", 2, ""), ("SUM", 3, "coeff: 0.5 coeff: -1 coeff: 2"),
                                          ("SUM", 2, "coeff: -1 coeff: 1"), ("SUM", 4, "coeff: 1 coeff: 2 coeff: 3 coeff: 4"),
                                          ("PROD", 2, ""), ("PROD", 3, ""), ("MAX", 2, ""), ("MAX", 3, "")]):
        names = [f"x{j}" for j in range(nb)]
        out.append(Case(f"eltwise{i}_{op}{nb}", layer("y", "Eltwise", names, params=f"eltwise_param {{ operation: {op} {extra} }}"),
                        {n: S for n in names}, ["y"], tol=ATOL_ELEMENTWISE))
    out.append(Case("eltwise_sum_2d", layer("y", "Eltwise", ["a", "b"], params="eltwise_param { coeff: 2 coeff: -0.5 }"),
                    {"a": (3, 7), "b": (3, 7)}, ["y"], tol=ATOL_ELEMENTWISE))
    return out


# -- routing and shape --------------------------------------------------------------------------
def routing_cases():
    # Not drawn (OpenCV departs, Caffe's source decides):
    # - Concat's legacy concat_dim and Slice's slice_dim: OpenCV ignores them and uses axis 1;
    #   Caffe's ConcatLayer/SliceLayer use them when they are set.
    # - Slice without slice_point: OpenCV's shape inference fails on it; Caffe splits evenly
    #   into as many tops as given.
    # - Reshape that appends axes (axis -1, num_axes 0): OpenCV rejects the empty axis range;
    #   Caffe inserts the dims after the last axis (golden README: axis -1 = append).
    # - Permute with fewer orders than axes: OpenCV asserts; the SSD fork's PermuteLayer
    #   appends the missing axes in their order.
    out, E = [], ATOL_ELEMENTWISE
    for axis, sizes in [(1, (2, 3, 1)), (0, (1, 2)), (2, (3, 4)), (3, (2, 2, 5)), (-1, (1, 3)), (-3, (1, 2))]:
        names = [f"x{j}" for j in range(len(sizes))]
        shapes = {}
        for n, s in zip(names, sizes):
            shape = [2, 3, 4, 5]
            shape[axis] = s
            shapes[n] = tuple(shape)
        out.append(Case(f"concat_axis{axis}_{'-'.join(map(str, sizes))}",
                        layer("y", "Concat", names, params=f"concat_param {{ axis: {axis} }}"), shapes, ["y"], tol=E))
    for i, (axis, points, dim) in enumerate([(1, (1, 4), 6), (2, (2,), 5), (0, (1,), 3), (3, (1, 2, 4), 6),
                                             (-1, (3,), 6), (-3, (2, 3), 6)]):
        tops = [f"s{j}" for j in range(len(points) + 1)]
        shape = [3, 6, 5, 6]
        shape[axis] = dim
        sp = " ".join(f"slice_point: {p}" for p in points)
        out.append(Case(f"slice{i}_axis{axis}_{'-'.join(map(str, points))}",
                        layer("sl", "Slice", "x", tops, f"slice_param {{ axis: {axis} {sp} }}"),
                        {"x": tuple(shape)}, tops, tol=E))
    for i, (axis, offsets, big, small) in enumerate([
            (2, (1,), (2, 3, 8, 9), (1, 1, 5, 6)), (2, (2, 0), (2, 3, 8, 9), (1, 1, 5, 9)),
            (1, (1, 2, 3), (2, 4, 8, 9), (1, 2, 5, 6)), (3, (2,), (2, 3, 8, 9), (1, 1, 1, 4)),
            (2, (), (2, 3, 8, 9), (2, 3, 3, 3)), (-2, (1,), (2, 3, 8, 9), (1, 1, 2, 3)),
            (0, (1, 0, 2, 3), (3, 3, 8, 9), (2, 3, 5, 6))]):
        off = " ".join(f"offset: {o}" for o in offsets)
        out.append(Case(f"crop{i}_axis{axis}_{'-'.join(map(str, offsets)) or 'nooffset'}",
                        layer("y", "Crop", ["a", "b"], params=f"crop_param {{ axis: {axis} {off} }}"),
                        {"a": big, "b": small}, ["y"], tol=E))
    for axis, end in [(1, -1), (2, -1), (1, 2), (0, 1), (2, 3), (-3, -2)]:
        out.append(Case(f"flatten_axis{axis}_end{end}",
                        layer("y", "Flatten", "x", params=f"flatten_param {{ axis: {axis} end_axis: {end} }}"),
                        {"x": (2, 3, 4, 5)}, ["y"], tol=E))
    for i, (dims, extra) in enumerate([((0, -1), ""), ((2, 3, 20), ""), ((0, 0, -1, 2), ""), ((-1,), "axis: 1"),
                                        ((2, 2), "axis: 2 num_axes: 1"), ((6, -1), "axis: 0 num_axes: 2"),
                                        ((0, 4, -1), "axis: 1"), ((1, -1, 1), "axis: 1 num_axes: 1")]):
        d = " ".join(f"dim: {v}" for v in dims)
        tag = "_" + extra.replace(" ", "").replace(":", "") if extra else ""
        out.append(Case(f"reshape{i}_{'_'.join(map(str, dims))}{tag}",
                        layer("y", "Reshape", "x", params=f"reshape_param {{ shape {{ {d} }} {extra} }}"),
                        {"x": (2, 3, 4, 5)}, ["y"], tol=E))
    for order in [(0, 2, 3, 1), (0, 3, 1, 2), (0, 1, 3, 2), (1, 0, 2, 3), (3, 2, 1, 0), (0, 1, 2, 3)]:
        o = " ".join(f"order: {v}" for v in order)
        out.append(Case(f"permute_{''.join(map(str, order))}", layer("y", "Permute", "x", params=f"permute_param {{ {o} }}"),
                        {"x": (2, 3, 4, 5)}, ["y"], tol=E))
    return out


# -- normalization ------------------------------------------------------------------------------
def _stats_fill(type, blobs, rng):
    """BatchNorm: mean, positive variance, scale factor (Caffe stores unnormalised running
    sums: mean = blob0 / factor). Normalize/PReLU: positive scales."""
    if type == "BatchNorm":
        C = blobs[0].data.shape[0]
        factor = float(rng.choice([1.0, 4.0, 0.37]))
        blobs[0].data[...] = rng.standard_normal(C).astype(np.float32) * factor
        blobs[1].data[...] = rng.uniform(0.5, 3.0, C).astype(np.float32) * factor
        blobs[2].data[...] = factor
    elif type in ("Normalize", "PReLU"):
        _positive_params(type, blobs, rng)


def _zero_factor(type, blobs, rng):
    if type == "BatchNorm":
        blobs[2].data[...] = 0.0   # Caffe then uses 0 for mean and variance


def norm_cases():
    # Normalize: only across_spatial false with a per-channel scale. OpenCV asserts on
    # across_spatial true with per-channel scales, and channel_shared stores a 0-axis blob
    # (see neuron_cases). MVN: eps tiny only: Caffe adds eps to the standard deviation (golden
    # README), OpenCV to the variance.
    out = []
    for i, eps in enumerate([1e-10, 0.5, 1e-3]):
        params = f'norm_param {{ across_spatial: false channel_shared: false eps: {eps} }}'
        out.append(Case(f"normalize{i}_eps{eps}", layer("y", "Normalize", "x", params=params),
                        {"x": (2, 5, 4, 3)}, ["y"], fill=_stats_fill))
    for i, (eps, bias, inplace) in enumerate([(1e-5, True, False), (1e-3, False, False), (0.5, True, True),
                                              (1e-5, False, True)]):
        t = ["x", "x"] if inplace else ["bn", "sc"]
        layers = (layer("bn", "BatchNorm", "x", [t[0]], f"batch_norm_param {{ use_global_stats: true eps: {eps} }}")
                  + layer("sc", "Scale", t[0], [t[1]], f"scale_param {{ bias_term: {tf(bias)} }}"))
        out.append(Case(f"batchnorm_scale{i}_eps{eps}{'_bias' if bias else ''}{'_inplace' if inplace else ''}",
                        layers, {"x": (2, 4, 3, 5)}, [t[1]], fill=_stats_fill))
    out.append(Case("batchnorm_test_default_stats", layer("bn", "BatchNorm", "x"), {"x": (2, 3, 4, 5)}, ["bn"],
                    fill=_stats_fill))
    out.append(Case("batchnorm_factor0", layer("bn", "BatchNorm", "x", params="batch_norm_param { use_global_stats: true }"),
                    {"x": (2, 3, 4, 5)}, ["bn"], fill=_zero_factor))
    out.append(Case("batchnorm_2d", layer("bn", "BatchNorm", "x"), {"x": (5, 3)}, ["bn"], fill=_stats_fill))
    for i, (nv, ac, eps) in enumerate([(True, False, 1e-9), (False, False, 1e-9), (True, True, 1e-9),
                                       (False, True, 1e-9), (True, False, 1e-12)]):
        params = f"mvn_param {{ normalize_variance: {tf(nv)} across_channels: {tf(ac)} eps: {eps} }}"
        out.append(Case(f"mvn{i}_var{int(nv)}_across{int(ac)}_eps{eps}", layer("y", "MVN", "x", params=params),
                        {"x": (2, 3, 4, 5)}, ["y"]))
    out.append(Case("scale_two_bottoms_axis1", layer("y", "Scale", ["x", "s"], params="scale_param { axis: 1 }"),
                    {"x": (2, 3, 4, 5), "s": (3, 4)}, ["y"], tol=ATOL_ELEMENTWISE))
    out.append(Case("scale_two_bottoms_axis0", layer("y", "Scale", ["x", "s"], params="scale_param { axis: 0 }"),
                    {"x": (2, 3, 4, 5), "s": (2, 3)}, ["y"], tol=ATOL_ELEMENTWISE))
    # Non-negative axes only: OpenCV's Scale fails on a negative axis, which Caffe's ScaleLayer
    # canonicalises (CanonicalAxisIndex).
    for axis, num_axes in [(1, 2), (2, 2), (0, -1), (3, 1)]:
        out.append(Case(f"scale_param_axis{axis}_num_axes{num_axes}_bias",
                        layer("y", "Scale", "x", params=f"scale_param {{ axis: {axis} num_axes: {num_axes} bias_term: true }}"),
                        {"x": (2, 3, 4, 5)}, ["y"], tol=ATOL_ELEMENTWISE))
    return out


def fold_cases(n=10):
    """Convolution -> BatchNorm -> Scale (-> ReLU) chains: brewnet folds them at inference."""
    r = gen_rng("fold")
    out = []
    for i in range(n):
        cin = int(r.choice([2, 3, 4]))
        group = int(r.choice([1, cin])) if i % 3 == 2 else 1
        cout = group * int(r.choice([1, 2, 3]))
        k, s, p = int(r.integers(1, 4)), int(r.integers(1, 3)), int(r.integers(0, 2))
        cbias, sbias, inplace, relu = (bool(v) for v in r.random(4) < 0.5)
        eps = float(r.choice([1e-5, 1e-3, 0.1]))
        t = ["c"] * 3 if inplace else ["c", "bn", "sc"]
        layers = (layer("c", "Convolution", "x", params=f"convolution_param {{ num_output: {cout} kernel_size: {k} "
                        f"stride: {s} pad: {p} group: {group} bias_term: {tf(cbias)} }}")
                  + layer("bn", "BatchNorm", t[0], [t[1]], f"batch_norm_param {{ use_global_stats: true eps: {eps} }}")
                  + layer("sc", "Scale", t[1], [t[2]], f"scale_param {{ bias_term: {tf(sbias)} }}"))
        if relu:
            layers += layer("r", "ReLU", t[2], [t[2]])
        cid = (f"fold{i}_c{cin}o{cout}g{group}k{k}s{s}p{p}_eps{eps}{'_cbias' if cbias else ''}"
               f"{'_sbias' if sbias else ''}{'_inplace' if inplace else ''}{'_relu' if relu else ''}")
        out.append(Case(cid, layers, {"x": (2, cin, 7, 6)}, [t[2]], fill=_stats_fill))
    out.append(Case("fold_deconv_bn_scale",
                    layer("d", "Deconvolution", "x", params="convolution_param { num_output: 3 kernel_size: 3 stride: 2 }")
                    + layer("bn", "BatchNorm", "d", ["d"], "batch_norm_param { use_global_stats: true }")
                    + layer("sc", "Scale", "d", ["d"], "scale_param { bias_term: true }"),
                    {"x": (2, 2, 4, 5)}, ["d"], fill=_stats_fill))
    return out


# -- SSD: PriorBox, DetectionOutput -------------------------------------------------------------
def priorbox_cases():
    # `clip` is always written: OpenCV defaults it to true, the SSD fork's proto to false.
    # `variance` is always written: OpenCV requires it, the fork defaults to 0.1.
    # No img_size / img_h / img_w: OpenCV ignores them and uses the image bottom's size, the
    # fork's PriorBoxLayer uses them for both the step and the normalisation.
    # Whole-number min_size/max_size only: the fork's PriorBoxLayer truncates them to int,
    # OpenCV keeps the fraction.
    rows = [
        "min_size: 30 max_size: 60 aspect_ratio: 2 flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2",
        "min_size: 30 aspect_ratio: 2 aspect_ratio: 3 flip: true clip: true variance: 0.1",
        "min_size: 20 max_size: 50 flip: false clip: false variance: 0.2",
        "min_size: 60 max_size: 110 aspect_ratio: 2 aspect_ratio: 3 flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 step: 16 offset: 0.5",
        "min_size: 15 min_size: 35 max_size: 40 max_size: 70 aspect_ratio: 2 flip: true clip: true variance: 0.1 variance: 0.2 variance: 0.3 variance: 0.4",
        "min_size: 32 aspect_ratio: 0.5 flip: false clip: false step_h: 8 step_w: 12 offset: 0.25 variance: 0.2",
        "min_size: 25 aspect_ratio: 2 aspect_ratio: 2 aspect_ratio: 0.5 flip: true clip: false offset: 0 variance: 0.1",
        "min_size: 10 min_size: 50 aspect_ratio: 3 flip: true clip: false step: 30 variance: 0.1",
    ]
    return [Case(f"priorbox{i}", layer("y", "PriorBox", ["f", "img"], params=f"prior_box_param {{ {p} }}"),
                 {"f": (1, 2, 5, 7), "img": (1, 3, 150, 210)}, ["y"], tol=ATOL_ELEMENTWISE)
            for i, p in enumerate(rows)]


def detection_cases():
    # OpenCV needs background_label_id and keep_top_k written out (the fork defaults them to 0
    # and -1; it crashes on keep_top_k -1, so 1000 stands for "keep all") and its proto has no
    # CORNER_SIZE code type, so that one is not drawn. variance_encoded_in_target: OpenCV then
    # wants a prior blob without the variance channel; the fork's layer takes the same (1, 2, P*4)
    # PriorBox top and just skips the variances.
    # No row without any detection: the fork then writes one [image, -1, -1, -1, -1, -1, -1] row
    # per image, OpenCV zero rows.
    prior = ("min_size: 30 max_size: 60 aspect_ratio: 2 flip: true clip: false "
             "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2")
    P, C = 4 * 5 * 4, 5    # priors: 4x5 cells x 4 boxes; classes incl. background
    rows = [
        ("center_size", "code_type: CENTER_SIZE background_label_id: 0 keep_top_k: 30 confidence_threshold: 0.3", "nms_threshold: 0.45 top_k: 20"),
        ("corner", "code_type: CORNER background_label_id: 0 keep_top_k: 1000 confidence_threshold: 0.5", "nms_threshold: 0.3"),
        ("corner_keep10", "code_type: CORNER background_label_id: 0 confidence_threshold: 0.6 keep_top_k: 10", "nms_threshold: 0.5 top_k: 50"),
        ("center_size_loose", "code_type: CENTER_SIZE background_label_id: 0 keep_top_k: 1000 confidence_threshold: 0.4", "nms_threshold: 0.6 top_k: 5"),
        ("background2", "code_type: CENTER_SIZE background_label_id: 2 confidence_threshold: 0.5 keep_top_k: 25", "nms_threshold: 0.45 top_k: 10"),
        ("no_threshold_topk", "code_type: CENTER_SIZE background_label_id: 0 keep_top_k: 40", "nms_threshold: 0.45 top_k: 15"),
    ]
    out = []
    for name, params, nms in rows:
        layers = (layer("pb", "PriorBox", ["f", "img"], params=f"prior_box_param {{ {prior} }}")
                  + layer("det", "DetectionOutput", ["loc", "conf", "pb"],
                          params=f"detection_output_param {{ num_classes: {C} share_location: true {params} nms_param {{ {nms} }} }}"))
        out.append(Case(f"detection_{name}", layers,
                        {"f": (2, 1, 4, 5), "img": (2, 3, 100, 120), "loc": (2, P * 4), "conf": (2, P * C)},
                        ["det"], data={"conf": "unit"}, tol=ATOL_REDUCE, detections=["det"]))
    return out


def nhwc_variant(case):
    """The same row in a net that also has a Pooling layer: brewnet then feeds every 4-D input
    to the layers in channels_last memory (net.py), a layout the layer must not misread."""
    if any(f'type: "{t}"' in case.layers for t in ("Convolution", "Deconvolution", "Pooling")):
        return None
    four_d = [n for n, s in case.inputs.items() if len(s) == 4]
    if not four_d:
        return None
    probe = layer("nhwc_probe", "Pooling", four_d[0], params="pooling_param { pool: MAX kernel_size: 1 }")
    return Case(case.id + "_nhwc", case.layers + probe, case.inputs, case.outputs, case.tol, case.data,
                case.fill, case.detections)


def large_input_cases():
    """Inputs of magnitude ~40: saturation and overflow guards (Caffe's softmax subtracts the max,
    BNLL and sigmoid stay finite)."""
    rows = [("Softmax", ""), ("Sigmoid", ""), ("TanH", ""), ("ELU", ""), ("BNLL", ""), ("Exp", "exp_param { scale: 0.1 }"),
            ("LRN", "lrn_param { local_size: 3 alpha: 2 }"), ("LRN", "lrn_param { local_size: 3 alpha: 2 norm_region: WITHIN_CHANNEL }"),
            ("MVN", ""), ("Power", "power_param { power: 3 scale: 0.1 }")]
    return [Case(f"large_{t.lower()}{i}", layer("y", t, "x", params=p), {"x": (2, 3, 5, 6)}, ["y"], data="large")
            for i, (t, p) in enumerate(rows)] + [
        Case("ip_k3000", layer("y", "InnerProduct", "x", params="inner_product_param { num_output: 30 }"), {"x": (4, 3000)}, ["y"]),
        Case("conv_c64_k3", layer("y", "Convolution", "x", params="convolution_param { num_output: 32 kernel_size: 3 pad: 1 }"),
             {"x": (2, 64, 12, 12)}, ["y"]),
        Case("conv_depthwise_c64", layer("y", "Convolution", "x", params="convolution_param { num_output: 64 kernel_size: 3 pad: 1 group: 64 }"),
             {"x": (2, 64, 12, 12)}, ["y"]),
        Case("deconv_c32_k4s2", layer("y", "Deconvolution", "x", params="convolution_param { num_output: 16 kernel_size: 4 stride: 2 pad: 1 }"),
             {"x": (2, 32, 10, 10)}, ["y"]),
        Case("prelu_3d", layer("y", "PReLU", "x"), {"x": (2, 3, 7)}, ["y"], tol=ATOL_ELEMENTWISE),
    ]


BASE_CASES = (conv_cases() + deconv_cases() + pool_cases() + lrn_cases() + ip_cases() + softmax_cases()
              + neuron_cases() + eltwise_cases() + routing_cases() + norm_cases() + fold_cases()
              + priorbox_cases() + detection_cases() + large_input_cases())
UNIT_CASES = BASE_CASES + [v for v in map(nhwc_variant, BASE_CASES) if v is not None]
