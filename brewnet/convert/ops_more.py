"""Writers of the elementwise arithmetic (with broadcasting), slicing, softmax, upsampling and
padding ops; registered into ``ops.HANDLERS``."""
from __future__ import annotations

import numpy as np

from .graph import Unsupported
from .ops import _in, handles


def _scalar(w, v):
    if isinstance(v, (int, float, bool)):
        return float(v)
    if w.g.is_const(v) and w.g.consts[v].size == 1:
        return float(w.g.consts[v].reshape(()))
    return None


def _const_param(w, c, out_shape):
    """A constant operand as a Scale/Bias blob: (axis, blob) over the span of its non-1 axes."""
    r = len(out_shape)
    c = np.asarray(c, np.float32).reshape((1,) * (r - c.ndim) + c.shape)
    big = [i for i in range(r) if c.shape[i] != 1]
    if big and big[0] == 0 and out_shape[0] != 1:
        raise Unsupported("with a constant that varies along the batch has no Caffe mapping")
    lo, hi = big[0], big[-1] + 1
    blob = np.broadcast_to(c.reshape(c.shape[lo:hi]), out_shape[lo:hi]).copy()
    return lo, blob


@handles("add", "sub", "mul", "div", "rsub")
def binary(w, n):
    a = n.attrs
    op, x, y = n.op, a["self"], a["other"]
    alpha = float(a.get("alpha", 1) or 1)
    name = w.base()
    out_shape = w.shp(n.outs[0])
    if op == "rsub":              # other - alpha * self
        op, x, y, alpha = "sub", y, x, alpha
        if _scalar(w, x) is not None:
            return w.bind(n.outs[0], w.power(w.x(y), name, scale=-alpha, shift=_scalar(w, x)))
    sx, sy = _scalar(w, x), _scalar(w, y)
    if sx is not None and sy is None and op in ("add", "mul"):
        x, y, sx, sy = y, x, sy, sx
    if sy is not None and sx is None:
        k = {"add": dict(shift=sy * alpha), "sub": dict(shift=-sy * alpha), "mul": dict(scale=sy),
             "div": dict(scale=1.0 / sy)}[op]
        xt = w.x(x)
        if w.shape[xt] != out_shape:
            raise Unsupported("broadcasting a scalar to a larger shape has no mapping")
        return w.bind(n.outs[0], w.power(xt, name, **k))
    if sx is not None:
        raise Unsupported("of a scalar by a tensor has no mapping")
    for cx, cy in ((x, y), (y, x)):     # a constant tensor operand: Scale or Bias with a blob
        if w.g.is_const(cy) and not w.g.is_const(cx):
            c = w.g.consts[cy]
            if op == "sub":
                c = -alpha * c if cy == y else c
            elif op == "add":
                c = alpha * c if cy == y else c
            elif op == "div":
                if cy != y:
                    raise Unsupported("of a constant by a tensor has no mapping")
                c = 1.0 / c
            xt = w.x(cx)
            if op == "sub" and cy == x:         # c - alpha * t
                xt = w.power(xt, f"{name}/neg", scale=-alpha)
            axis, blob = _const_param(w, c, out_shape)
            if op in ("mul", "div"):
                top = w.layer("Scale", [xt], name, blobs=[blob], shape=out_shape,
                              scale_param={"axis": axis, "num_axes": blob.ndim})
            else:
                top = w.layer("Bias", [xt], name, blobs=[blob], shape=out_shape,
                              bias_param={"axis": axis, "num_axes": blob.ndim})
            return w.bind(n.outs[0], top)
    xt, yt = w.x(x), w.x(y)
    if op == "sub" or (op == "add" and alpha != 1):
        yt = w.power(yt, f"{name}/scaled", scale=-alpha if op == "sub" else alpha) \
            if w.shape[yt] != out_shape else yt
    if op == "div":
        yt = w.power(yt, f"{name}/inv", power=-1.0)
    if w.shape[xt] == w.shape[yt] == out_shape:
        if op in ("mul", "div"):
            return w.bind(n.outs[0], w.eltwise([xt, yt], name, "PROD"))
        coeff = None if op == "add" and alpha == 1 else [1, -alpha if op == "sub" else alpha]
        return w.bind(n.outs[0], w.eltwise([xt, yt], name, "SUM", coeff))
    if w.shape[xt] != out_shape:
        xt, yt = yt, xt
    if w.shape[xt] != out_shape:
        raise Unsupported("with both operands broadcast has no mapping")
    r = len(out_shape)
    b = (1,) * (r - len(w.shape[yt])) + tuple(w.shape[yt])
    j = next((i for i in range(r + 1) if all(d == 1 for d in b[i:])), r)
    if b[:j] == out_shape[:j] and j >= 1:         # (N, C, 1, 1): Scale/Bias with a 2nd bottom
        yt = w.reshape(yt, out_shape[:j], f"{name}/operand")
        typ = "Scale" if op in ("mul", "div") else "Bias"
        prm = {"scale_param" if typ == "Scale" else "bias_param": {"axis": 0}}
        return w.bind(n.outs[0], w.layer(typ, [xt, yt], name, shape=out_shape, **prm))
    yt = w.reshape(yt, b, f"{name}/operand")
    for i in range(r):                            # repeat along the broadcast axes, then Eltwise
        if b[i] == 1 and out_shape[i] != 1:
            s = list(w.shape[yt])
            s[i] = out_shape[i]
            yt = w.layer("Tile", [yt], f"{name}/tile{i}", shape=s,
                         tile_param={"axis": i, "tiles": int(out_shape[i])})
    w.bind(n.outs[0], w.eltwise([xt, yt], name, "PROD" if op in ("mul", "div") else "SUM"))


@handles("slice", "select", "narrow")
def slice_(w, n):
    a = n.attrs
    x, name = w.x(_in(n)), w.base()
    shape = w.shape[x]
    dim = int(a.get("dim", 0)) % len(shape)
    size = shape[dim]
    if n.op == "select":
        start = int(a["index"]) % size
        end = start + 1
    elif n.op == "narrow":
        start = int(a["start"]) % size
        end = start + int(a["length"])
    else:
        if int(a.get("step") or 1) != 1:
            raise Unsupported("with a step other than 1 has no Caffe Slice equivalent")
        start = int(a.get("start") or 0)
        end = size if a.get("end") is None else int(a["end"])
        start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
        start, end = max(0, min(start, size)), max(0, min(end, size))
    if start == 0 and end == size:
        return w.bind(n.outs[0], x)
    points = [p for p in (start, end) if 0 < p < size]
    tops = w.slice(x, dim, points, name if n.op != "select" else f"{name}/slice")
    top = tops[1 if start > 0 else 0]
    if n.op == "select":
        top = w.reshape(top, w.shp(n.outs[0]), name)
    w.bind(n.outs[0], top)


@handles("split", "split_with_sizes", "chunk", "unbind", "unsafe_split", "tensor_split")
def split(w, n):
    x, name = w.x(_in(n)), w.base()
    shape = w.shape[x]
    dim = int(n.attrs.get("dim", 0)) % len(shape)
    outs = [o for o in n.outs]
    sizes = [w.g.shapes[o][dim] if n.op != "unbind" else 1 for o in outs]
    points = list(np.cumsum(sizes)[:-1])
    tops = w.slice(x, dim, [int(p) for p in points], name)
    for o, t in zip(outs, tops):
        if n.op == "unbind":
            t = w.reshape(t, w.g.shapes[o], f"{name}/squeeze")
        w.bind(o, t)


@handles("softmax", "log_softmax")
def softmax(w, n):
    x, name = w.x(_in(n)), w.base()
    axis = int(n.attrs.get("dim", 1)) % len(w.shape[x])
    p = {"softmax_param": {"axis": axis}} if axis != 1 else {}
    top = w.layer("Softmax", [x], name if n.op == "softmax" else f"{name}/softmax", shape=w.shape[x], **p)
    if n.op == "log_softmax":
        top = w.layer("Log", [top], name, shape=w.shape[x])
    w.bind(n.outs[0], top)


def _scales(w, x, out):
    """The integer factors (H, W) of an upsampling, or None when either is not an integer."""
    h, wd = w.shape[x][2:]
    oh, ow = out[2:]
    if oh % h or ow % wd:
        return None
    return oh // h, ow // wd


def _given_scales(n) -> tuple:
    """The scale factors the op was called with (None where it was given a size): PyTorch maps
    output positions back by 1/scale when a scale is given, not by in/out."""
    a = n.attrs
    sf = a.get("scale_factors")
    if sf:
        return float(sf[0]), float(sf[-1])
    return tuple(None if a.get(k) is None else float(a[k]) for k in ("scales_h", "scales_w"))


def _integer_factors(w, n, x, out):
    """(sh, sw) when the resize is an exact integer upsampling (given scales equal to the sizes'
    ratio), else None."""
    s = _scales(w, x, out)
    if s is None:
        return None
    given = _given_scales(n)
    return s if all(g is None or g == f for g, f in zip(given, s)) else None


def _axis_matrix(mode: str, size: int, out: int, scale, corners: bool) -> np.ndarray:
    """The (out, size) matrix of PyTorch's own 1-D resize along one axis: its op run in float64
    on the identity, so the sample positions and weights are PyTorch's exactly."""
    import torch

    eye = torch.eye(size, dtype=torch.float64).reshape(size, 1, size, 1)
    if mode == "bilinear":
        y = torch.ops.aten.upsample_bilinear2d.default(eye, [out, 1], bool(corners), scale, None)
    else:
        y = torch.ops.aten.upsample_nearest2d.default(eye, [out, 1], scale, None)
    return y[:, 0, :, 0].T.numpy()


def resize_by_matrices(w, n, mode: str, corners: bool = False) -> None:
    """Any resize that is separable along H and W (bilinear with or without aligned corners, to
    any size or by any scale; nearest by any scale) as its two fixed linear maps in BVLC layers:
    along W an InnerProduct with axis 3 (weights (W', W)), along H a per-channel Convolution
    whose kernel spans the whole height (C groups of H' outputs, kernel H x 1, giving
    (N, C*H', 1, W')), reshaped to (N, C, H', W'). Each output is PyTorch's weighted sum of the
    same input samples (W first, then H, as PyTorch's kernel)."""
    x, name = w.x(_in(n)), w.base()
    nb, c, h, wd = w.shape[x]
    oh, ow = w.shp(n.outs[0])[2:]
    s_h, s_w = _given_scales(n)
    a_h = _axis_matrix(mode, h, oh, s_h, corners)
    a_w = _axis_matrix(mode, wd, ow, s_w, corners)
    do_h = a_h.shape != (h, h) or not np.array_equal(a_h, np.eye(h))
    if a_w.shape != (wd, wd) or not np.array_equal(a_w, np.eye(wd)):
        x = w.layer("InnerProduct", [x], f"{name}/w" if do_h else name, blobs=[a_w], shape=(nb, c, h, ow),
                    inner_product_param={"num_output": ow, "bias_term": False, "axis": 3})
    if do_h:
        wt = np.broadcast_to(a_h[None, :, :, None], (c, oh, h, 1)).reshape(c * oh, 1, h, 1)
        p = {"num_output": c * oh, "bias_term": False}
        p.update({"group": c} if c != 1 else {})
        p.update({"kernel_h": h, "kernel_w": 1} if h != 1 else {"kernel_size": 1})
        t = w.layer("Convolution", [x], f"{name}/h", blobs=[wt], shape=(nb, c * oh, 1, ow),
                    convolution_param=p)
        x = w.reshape(t, (nb, c, oh, ow), name)
    w.bind(n.outs[0], x)


@handles("upsample_nearest2d")
def nearest(w, n):
    """Nearest upsampling by an integer factor: a per-channel Deconvolution with a kernel of ones
    and stride = kernel = the factor (exact); Upsample in forks. Other scales: resize_by_matrices."""
    x, name = w.x(_in(n)), w.base()
    out = w.shp(n.outs[0])
    factors = _integer_factors(w, n, x, out)
    if factors is None:
        return resize_by_matrices(w, n, "nearest")
    sh, sw = factors
    c = w.shape[x][1]
    if w.dialect == "forks" and sh == sw:
        return w.bind(n.outs[0], w.layer("Upsample", [x], name, shape=out, upsample_param={"scale": sh}))
    p = {"num_output": c, "group": c, "bias_term": False}
    p.update({"kernel_size": sh, "stride": sh} if sh == sw else
             {"kernel_h": sh, "kernel_w": sw, "stride_h": sh, "stride_w": sw})
    w.bind(n.outs[0], w.layer("Deconvolution", [x], name, blobs=[np.ones((c, 1, sh, sw))], shape=out,
                              convolution_param=p))


def _bilinear_1d(s):
    k = 2 * s - s % 2
    f = s
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    return np.array([1 - abs(t / f - c) for t in range(k)], np.float64)


@handles("upsample_bilinear2d")
def bilinear(w, n):
    """align_corners=False by an integer factor s: the edge rows and columns repeated once (Slice
    and Concat), then a per-channel Deconvolution with Caffe's bilinear kernel (2s - s%2 wide),
    stride s and pad (3s - s%2)/2, which lands exactly on PyTorch's sample positions and crops to
    s times the size. align_corners=True: Interp in forks (DeepLab's Interp aligns corners).
    Any other size or scale, and align_corners=True in bvlc/ssd: resize_by_matrices."""
    x, name = w.x(_in(n)), w.base()
    out = w.shp(n.outs[0])
    if n.attrs.get("align_corners"):
        if w.dialect == "forks":
            return w.bind(n.outs[0], w.layer("Interp", [x], name, shape=out,
                                             interp_param={"height": out[2], "width": out[3]}))
        return resize_by_matrices(w, n, "bilinear", corners=True)
    factors = _integer_factors(w, n, x, out)
    if factors is None:
        return resize_by_matrices(w, n, "bilinear")
    sh, sw = factors
    if (sh, sw) == (1, 1):
        return w.bind(n.outs[0], x)
    c = w.shape[x][1]
    padded = x
    for axis in (2, 3):
        size = w.shape[padded][axis]
        pts = [1, size - 1] if size > 2 else ([1] if size == 2 else [])
        pieces = w.slice(padded, axis, pts, f"{name}/edge{axis}")
        first, last = pieces[0], pieces[-1]
        s = list(w.shape[padded])
        s[axis] += 2
        padded = w.layer("Concat", [first, padded, last], f"{name}/replicate{axis}", shape=s,
                         concat_param={"axis": axis})
    kh, kw = _bilinear_1d(sh), _bilinear_1d(sw)
    wt = np.broadcast_to(np.outer(kh, kw), (c, 1, len(kh), len(kw)))
    ph, pw = (3 * sh - sh % 2) // 2, (3 * sw - sw % 2) // 2
    p = {"num_output": c, "group": c, "bias_term": False}
    p.update({"kernel_size": len(kh), "stride": sh, "pad": ph} if sh == sw else
             {"kernel_h": len(kh), "kernel_w": len(kw), "stride_h": sh, "stride_w": sw,
              "pad_h": ph, "pad_w": pw})
    w.bind(n.outs[0], w.layer("Deconvolution", [padded], name, blobs=[wt], shape=out,
                              convolution_param=p))


@handles("constant_pad_nd", "pad")
def pad(w, n):
    a = n.attrs
    if a.get("mode", "constant") != "constant":
        raise Unsupported(f"in mode '{a.get('mode')}' has no Caffe mapping")
    p = list(a["pad"]) + [0] * (4 - len(a["pad"]))
    if len(a["pad"]) > 4 or min(p) < 0:
        raise Unsupported("beyond the last two axes, or cropping, has no mapping")
    x = w.x(_in(n))
    value = float(a.get("value") or 0.0)
    w.bind(n.outs[0], w.pad(x, (p[2], p[0], p[3], p[1]), value, w.base()))


@handles("gelu")
def gelu(w, n):
    raise Unsupported("(erf) has no exact composition of Caffe layers")


__all__ = ["binary"]
