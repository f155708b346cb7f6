"""One writer per canonical op: the Caffe layers (and weights) that compute it exactly in the
chosen dialect, or ``Unsupported`` naming the dialects that could."""
from __future__ import annotations

import numpy as np

from ..proto import caffe_pb2 as pb
from .graph import Unsupported

HANDLERS: dict = {}


def handles(*ops):
    def deco(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn
    return deco


def _in(n):
    a = n.attrs
    return a["input"] if "input" in a else a["self"]


def _pair(v, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    if isinstance(v, int):
        return (v, v)
    return tuple(int(x) for x in v) * (2 if len(v) == 1 else 1)


def _pads4(padding, kernel=None, dilation=(1, 1)):
    """(top, left, bottom, right) from torch's (ph, pw), ONNX's 4 pads, or 'same'/'valid'."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        tot = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return (tot[0] // 2, tot[1] // 2, tot[0] - tot[0] // 2, tot[1] - tot[1] // 2)
    p = list(padding) if isinstance(padding, (list, tuple)) else [padding]
    if len(p) == 4:
        return tuple(p)
    p = _pair(p, (0, 0))
    return (p[0], p[1], p[0], p[1])


def _sym(w, x, pads, name, value=0.0):
    """Symmetric part of ``pads`` for the layer's own pad; the rest padded explicitly."""
    t, left, b, r = pads
    ph, pw = min(t, b), min(left, r)
    if (t, left) != (b, r):
        x = w.pad(x, (t - ph, left - pw, b - ph, r - pw), value, f"{name}/pad")
    return x, (ph, pw)


def _hw(prefix, v):
    one = "kernel_size" if prefix == "kernel" else prefix
    return {f"{prefix}_h": int(v[0]), f"{prefix}_w": int(v[1])} if v[0] != v[1] else {one: int(v[0])}


@handles("conv2d", "conv_transpose2d")
def conv(w, n):
    a = n.attrs
    wt = w.g.consts.get(a["weight"]) if isinstance(a["weight"], str) else None
    if wt is None or wt.ndim != 4:
        raise Unsupported("needs a 4-D constant weight (2-D convolution)")
    transposed = n.op == "conv_transpose2d" or a.get("transposed", False)
    k = wt.shape[2:]
    stride, dil = _pair(a.get("stride"), (1, 1)), _pair(a.get("dilation"), (1, 1))
    groups = int(a.get("groups") or 1)
    name = w.base()
    x = w.x(_in(n))
    p = {"group": groups} if groups != 1 else {}
    if transposed:
        if any(_pair(a.get("output_padding"), (0, 0))):
            raise Unsupported("with output_padding has no Caffe Deconvolution equivalent")
        pads = _pads4(a.get("padding") or 0)
        if pads[:2] != pads[2:]:
            raise Unsupported("with asymmetric padding has no Caffe Deconvolution equivalent")
        pad, num = pads[:2], wt.shape[1] * groups
    else:
        x, pad = _sym(w, x, _pads4(a.get("padding") or 0, k, dil), name)
        num = wt.shape[0]
        taps = [p_ // d for p_, d in zip(pad, dil)]
        if tuple(w.shape[x][2:]) == (1, 1) == tuple(w.shp(n.outs[0])[2:]) and max(k) > 1 and \
                all(p_ % d == 0 and t < kk for p_, d, t, kk in zip(pad, dil, taps, k)):
            # a 1x1 map: only the taps at the padding's offset read the input, every other one
            # reads padding (zeros), so the kernel is those taps alone: the same sums, and no
            # reliance on a framework's padded small-map path (OpenCV's depthwise 3x3 on a 1x1
            # map is wrong)
            wt = wt[:, :, taps[0]:taps[0] + 1, taps[1]:taps[1] + 1]
            k, pad, stride, dil = (1, 1), (0, 0), (1, 1), (1, 1)
    bias = a.get("bias")
    blobs = [wt] + ([w.g.consts[bias]] if bias is not None else [])
    p.update(num_output=int(num), bias_term=bias is not None, **_hw("kernel", k))
    if any(s != 1 for s in stride):
        p.update(_hw("stride", stride))
    if any(pad):
        p.update(_hw("pad", pad))
    if any(d != 1 for d in dil):
        if dil[0] != dil[1]:
            raise Unsupported("with unequal dilations has no Caffe 1.0 equivalent")
        p["dilation"] = [int(dil[0])]
    top = w.layer("Deconvolution" if transposed else "Convolution", [x], name, blobs=blobs,
                  shape=w.shp(n.outs[0]), convolution_param=p)
    w.bind(n.outs[0], top)


@handles("linear", "addmm", "matmul", "mm")
def linear(w, n):
    a = n.attrs
    if n.op == "linear":
        x, wt, bias = a["input"], a["weight"], a.get("bias")
        wt = w.g.consts.get(wt) if isinstance(wt, str) else None
    elif n.op == "addmm":
        if a.get("beta", 1) != 1 or a.get("alpha", 1) != 1:
            raise Unsupported("with beta/alpha other than 1 has no mapping")
        x, m2, bias = a["mat1"], a["mat2"], a["self"]
        wt = w.g.consts[m2].T if w.g.is_const(m2) else None
    else:
        x, m2, bias = a["self"], a.get("other", a.get("mat2")), None
        wt = w.g.consts[m2].T if w.g.is_const(m2) and w.g.consts[m2].ndim == 2 else None
    if wt is None:
        raise Unsupported("between two computed tensors has no BVLC layer")
    b = w.g.consts[bias].reshape(-1) if bias is not None else None
    rank = len(w.shp(x))
    p = {"num_output": int(wt.shape[0]), "bias_term": b is not None}
    if rank != 2:
        p["axis"] = rank - 1
    top = w.layer("InnerProduct", [w.x(x)], w.base(), blobs=[wt] + ([b] if b is not None else []),
                  shape=w.shp(n.outs[0]), inner_product_param=p)
    w.bind(n.outs[0], top)


@handles("batch_norm")
def batch_norm(w, n):
    a = n.attrs
    c = w.g.consts
    mean, var = c[a["running_mean"]], c[a["running_var"]]
    gamma = c[a["weight"]] if a.get("weight") is not None else np.ones_like(mean)
    beta = c[a["bias"]] if a.get("bias") is not None else np.zeros_like(mean)
    eps = float(a.get("eps", 1e-5))
    x = w.x(_in(n))
    name = w.base()
    prod = w.producer.get(x)
    if w.fold_bn and prod is not None and prod.type in ("Convolution", "InnerProduct") \
            and len(w.use.get(_in(n), [])) == 1:
        from ..proto.io import array_to_blob, blob_to_array

        k = gamma / np.sqrt(var + eps)
        wt = blob_to_array(prod.blobs[0])
        b = blob_to_array(prod.blobs[1]) if len(prod.blobs) > 1 else np.zeros_like(mean)
        wt = wt * k.reshape((-1,) + (1,) * (wt.ndim - 1))
        b = (b - mean) * k + beta
        del prod.blobs[:]
        prod.blobs.extend([array_to_blob(wt.astype(np.float32)), array_to_blob(b.astype(np.float32))])
        param = prod.convolution_param if prod.type == "Convolution" else prod.inner_product_param
        param.bias_term = True
        w.bind(n.outs[0], x)
        return
    bn = w.layer("BatchNorm", [x], f"{name}" if a.get("weight") is None else f"{name}/bn",
                 blobs=[mean, var, np.ones(1)], shape=w.shp(n.outs[0]),
                 batch_norm_param={"use_global_stats": True, "eps": eps})
    if a.get("weight") is not None or a.get("bias") is not None:
        bn = w.layer("Scale", [bn], name, blobs=[gamma, beta], shape=w.shp(n.outs[0]),
                     scale_param={"bias_term": True})
    w.bind(n.outs[0], bn)


def _act(fn):
    def handler(w, n):
        top = fn(w, n, w.x(_in(n)), w.base())
        w.bind(n.outs[0], top)
    return handler


HANDLERS["relu"] = _act(lambda w, n, x, nm: w.relu(x, nm))
HANDLERS["leaky_relu"] = _act(lambda w, n, x, nm: w.relu(x, nm, n.attrs.get("negative_slope", 0.01)))
HANDLERS["relu6"] = _act(lambda w, n, x, nm: w.clip(x, nm, 0.0, 6.0))
HANDLERS["hardtanh"] = _act(lambda w, n, x, nm: w.clip(x, nm, float(n.attrs.get("min_val", -1)),
                                                       float(n.attrs.get("max_val", 1))))


def _num(w, v):
    """A bound given as a number or as a one-element constant tensor; None when absent."""
    if v is None:
        return None
    if isinstance(v, str):
        if not w.g.is_const(v) or w.g.consts[v].size != 1:
            raise Unsupported("with a computed bound has no Caffe mapping")
        return float(w.g.consts[v].reshape(()))
    return float(v)


HANDLERS["clamp"] = _act(lambda w, n, x, nm: w.clip(x, nm, _num(w, n.attrs.get("min")),
                                                    _num(w, n.attrs.get("max"))))
HANDLERS["abs"] = _act(lambda w, n, x, nm: w.layer("AbsVal", [x], nm, shape=w.shape[x]))
HANDLERS["exp"] = _act(lambda w, n, x, nm: w.layer("Exp", [x], nm, shape=w.shape[x]))
HANDLERS["log"] = _act(lambda w, n, x, nm: w.layer("Log", [x], nm, shape=w.shape[x]))
HANDLERS["sigmoid"] = _act(lambda w, n, x, nm: w.layer("Sigmoid", [x], nm, shape=w.shape[x]))
HANDLERS["tanh"] = _act(lambda w, n, x, nm: w.layer("TanH", [x], nm, shape=w.shape[x]))


@handles("elu")
def elu(w, n):
    a = n.attrs
    if a.get("scale", 1) != 1 or a.get("input_scale", 1) != 1:
        raise Unsupported("with scale (SELU) has no exact Caffe 1.0 composition")
    x = w.x(_in(n))
    w.bind(n.outs[0], w.layer("ELU", [x], w.base(), shape=w.shape[x],
                              elu_param={"alpha": float(a.get("alpha", 1.0))}))


@handles("prelu")
def prelu(w, n):
    wt = w.g.consts[n.attrs["weight"]].reshape(-1)
    x = w.x(_in(n))
    p = {"channel_shared": True} if wt.size == 1 and w.shape[x][1] != 1 else {}
    if p:
        wt = wt.reshape(())          # Caffe's shared slope is a 0-axis blob
    w.bind(n.outs[0], w.layer("PReLU", [x], w.base(), blobs=[wt], shape=w.shape[x],
                              **({"prelu_param": p} if p else {})))


@handles("silu", "hardswish", "hardsigmoid")
def gated(w, n):
    """SiLU = x * sigmoid(x), Hardswish = x * hardsigmoid(x), hardsigmoid = clip(x/6 + 1/2, 0, 1)."""
    x, name = w.x(_in(n)), w.base()
    if n.op == "silu" and w.dialect == "forks":
        return w.bind(n.outs[0], w.layer("Swish", [x], name, shape=w.shape[x]))
    if n.op == "silu":
        gate = w.layer("Sigmoid", [x], f"{name}/sigmoid", shape=w.shape[x])
    else:
        t = w.power(x, f"{name}/affine" if n.op == "hardswish" else f"{name}/affine",
                    scale=1.0 / 6.0, shift=0.5)
        gate = w.clip(t, name if n.op == "hardsigmoid" else f"{name}/gate", 0.0, 1.0)
        if n.op == "hardsigmoid":
            return w.bind(n.outs[0], gate)
    w.bind(n.outs[0], w.eltwise([x, gate], name, "PROD"))


@handles("max_pool2d", "avg_pool2d")
def pool(w, n):
    """Caffe rounds the pooled size up, PyTorch (ceil_mode=False) down: the extra last row or
    column Caffe computes is sliced off, so the written net has PyTorch's size."""
    a = n.attrs
    k = _pair(a["kernel_size"])
    s = _pair(a.get("stride"), k)
    pads = _pads4(a.get("padding") or 0)
    if pads[:2] != pads[2:]:
        raise Unsupported("with asymmetric padding has no Caffe Pooling equivalent")
    p = pads[:2]
    if _pair(a.get("dilation"), (1, 1)) != (1, 1):
        raise Unsupported("with dilation has no Caffe Pooling equivalent")
    avg = n.op == "avg_pool2d"
    if avg and any(p) and not a.get("count_include_pad", True):
        raise Unsupported("with count_include_pad=False and padding divides border windows by "
                          "fewer elements than Caffe's AVE pooling")
    if avg and a.get("divisor_override") is not None:
        raise Unsupported("with divisor_override has no Caffe Pooling equivalent")
    x, name = w.x(_in(n)), w.base()
    shape = list(w.shape[x])
    for i in (0, 1):
        size = shape[2 + i]
        out = -(-(size + 2 * p[i] - k[i]) // s[i]) + 1
        if p[i] and (out - 1) * s[i] >= size + p[i]:
            out -= 1
        shape[2 + i] = out
    prm = {"pool": pb.PoolingParameter.AVE if avg else pb.PoolingParameter.MAX}
    prm.update(_hw("kernel", k))
    prm.update(_hw("stride", s))
    if any(p):
        prm.update(_hw("pad", p))
    want = w.shp(n.outs[0])
    top = w.layer("Pooling", [x], name if tuple(shape) == want else f"{name}/ceil", shape=shape,
                  pooling_param=prm)
    if tuple(shape) != want:
        if any(c < t for c, t in zip(shape, want)):
            raise Unsupported(f"pools to {want[2:]}, Caffe's rounding gives {tuple(shape[2:])}")
        top = w.crop_to(top, want, name)
    w.bind(n.outs[0], top)


@handles("adaptive_avg_pool2d", "adaptive_max_pool2d", "mean")
def adaptive(w, n):
    x, name = w.x(_in(n)), w.base()
    shape = w.shape[x]
    want = w.shp(n.outs[0])
    avg = n.op != "adaptive_max_pool2d"
    method = pb.PoolingParameter.AVE if avg else pb.PoolingParameter.MAX
    if n.op == "mean":
        dims = sorted(d % len(shape) for d in (n.attrs.get("dim") or range(len(shape))))
        if len(shape) == 4 and dims == [2, 3]:
            top = w.layer("Pooling", [x], name if n.attrs.get("keepdim") else f"{name}/pool",
                          shape=shape[:2] + (1, 1),
                          pooling_param={"pool": method, "global_pooling": True})
            return w.bind(n.outs[0], w.reshape(top, want, name))
        if len(shape) == 4 and dims == [1]:       # over channels: a 1x1 convolution by 1/C
            wt = np.full((1, shape[1], 1, 1), 1.0 / shape[1], np.float32)
            top = w.layer("Convolution", [x], name if n.attrs.get("keepdim") else f"{name}/conv",
                          blobs=[wt], shape=(shape[0], 1) + shape[2:],
                          convolution_param={"num_output": 1, "bias_term": False, "kernel_size": 1})
            return w.bind(n.outs[0], w.reshape(top, want, name))
        if dims == list(range(dims[0], len(shape))) and not n.attrs.get("keepdim"):
            top = w.layer("Reduction", [x], name, shape=want, reduction_param={
                "operation": pb.ReductionParameter.MEAN, "axis": dims[0]})
            return w.bind(n.outs[0], top)
        raise Unsupported(f"over dims {dims} of a {len(shape)}-D tensor has no Caffe equivalent")
    oh, ow = want[2:]
    h, wd = shape[2:]
    if (oh, ow) == (h, wd):
        return w.bind(n.outs[0], x)
    if (oh, ow) == (1, 1):
        prm = {"pool": method, "global_pooling": True}
    elif h % oh == 0 and wd % ow == 0:
        prm = {"pool": method, **_hw("kernel", (h // oh, wd // ow)), **_hw("stride", (h // oh, wd // ow))}
    else:
        raise Unsupported(f"from {h}x{wd} to {oh}x{ow} (not a divisor) has no Caffe Pooling equivalent")
    w.bind(n.outs[0], w.layer("Pooling", [x], name, shape=want, pooling_param=prm))


@handles("cat", "concat")
def cat(w, n):
    vs = n.attrs["tensors"]
    axis = n.attrs.get("dim", 0) % len(w.shp(n.outs[0]))
    top = w.layer("Concat", [w.x(v) for v in vs], w.base(), shape=w.shp(n.outs[0]),
                  concat_param={"axis": axis})
    w.bind(n.outs[0], top)


@handles("flatten")
def flatten(w, n):
    x, name = w.x(_in(n)), w.base()
    r = len(w.shape[x])
    s, e = n.attrs.get("start_dim", 0) % max(r, 1), n.attrs.get("end_dim", -1) % max(r, 1)
    if s == e:
        return w.bind(n.outs[0], x)
    p = {"axis": s} if e == r - 1 else {"axis": s, "end_axis": e}
    w.bind(n.outs[0], w.layer("Flatten", [x], name, shape=w.shp(n.outs[0]), flatten_param=p))


@handles("reshape", "squeeze", "unsqueeze", "expand")
def reshape(w, n):
    x, name = w.x(_in(n)), w.base()
    want = w.shp(n.outs[0])
    if n.op == "expand" and int(np.prod(want)) != int(np.prod(w.shape[x])):
        s = (1,) * (len(want) - len(w.shape[x])) + tuple(w.shape[x])
        x = w.reshape(x, s, f"{name}/rank")
        for i in range(len(want)):              # repeat along the expanded axes
            if s[i] == 1 and want[i] != 1:
                t = list(w.shape[x])
                t[i] = want[i]
                x = w.layer("Tile", [x], f"{name}/tile{i}", shape=t, tile_param={"axis": i, "tiles": want[i]})
        return w.bind(n.outs[0], x)
    w.bind(n.outs[0], w.reshape(x, want, name))


@handles("permute")
def permute(w, n):
    x = w.x(_in(n))
    r = len(w.shape[x])
    dims = [d % r for d in n.attrs["dims"]]
    if dims == list(range(r)):
        return w.bind(n.outs[0], x)
    if w.dialect == "bvlc":
        raise Unsupported("(a general axis permutation) has no BVLC layer", ("ssd", "forks"))
    w.bind(n.outs[0], w.layer("Permute", [x], w.base(), shape=w.shp(n.outs[0]),
                              permute_param={"order": dims}))


@handles("channel_permute")
def channel_permute(w, n):
    """A channel shuffle: ShuffleChannel in forks, else a 1x1 convolution by a permutation
    matrix (exact: each output is one input times 1 plus zeros)."""
    x, name = w.x(_in(n)), w.base()
    perm = n.attrs["perm"]
    c = len(perm)
    if w.dialect == "forks":
        for g in range(2, c):
            if c % g == 0 and perm == [(j % g) * (c // g) + j // g for j in range(c)]:
                return w.bind(n.outs[0], w.layer("ShuffleChannel", [x], name, shape=w.shape[x],
                                                 shuffle_channel_param={"group": g}))
    wt = np.zeros((c, c, 1, 1), np.float32)
    wt[np.arange(c), perm, 0, 0] = 1.0
    w.bind(n.outs[0], w.layer("Convolution", [x], name, blobs=[wt], shape=w.shape[x],
                              convolution_param={"num_output": c, "bias_term": False, "kernel_size": 1}))


__all__ = ["HANDLERS"]
