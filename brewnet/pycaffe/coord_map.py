"""pycaffe's ``caffe.coord_map``: relate the coordinates of two NetSpec tops (to crop and align
feature maps, as FCN does), with pycaffe's functions, results and exceptions.

A map is ``(axis, scale, shift)``: top coordinate = scale x bottom coordinate + shift, on the
spatial axes from ``axis`` + 1 on (``axis`` None: any). A window layer's map comes from the same
per-unit geometry as the receptive fields (``brewnet.analysis.geometry.unit``): scale = 1 /
stride of the unit, shift = -(centre of the unit's window) / stride.
"""
from __future__ import annotations

import numpy as np

from ..analysis.geometry import unit
from .net_spec import layer_fn

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log",
                       "LRN", "Exp", "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split",
                       "TanH", "Threshold"]


class UndefinedMapException(Exception):
    """A layer without a defined coordinate mapping (InnerProduct, Reshape...)."""


class AxisMismatchException(Exception):
    """Two maps over different axes cannot be composed."""


def conv_params(fn):
    """(axis, stride, effective kernel size, pad) of a Convolution/Deconvolution/Im2col/Pooling
    Function; the legacy *_h/*_w fields are refused, as in pycaffe."""
    params = fn.params.get("convolution_param", fn.params)
    axis = params.get("axis", 1)
    ks = np.array(params["kernel_size"], ndmin=1)
    dilation = np.array(params.get("dilation", 1), ndmin=1)
    assert not {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"} & set(fn.params), \
        "cropping does not support legacy _h/_w params"
    return (axis, np.array(params.get("stride", 1), ndmin=1), (ks - 1) * dilation + 1,
            np.array(params.get("pad", 0), ndmin=1))


def crop_params(fn):
    """(axis, offset) of a Crop Function (pycaffe's defaults: axis 2, offset 0)."""
    params = fn.params.get("crop_param", fn.params)
    return params.get("axis", 2), np.array(params.get("offset", 0), ndmin=1)


def coord_map(fn):
    """The map of one Function's top from its (first) bottom."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col", "Deconvolution"):
        axis, stride, ks, pad = conv_params(fn)
        stride, ks, pad = np.broadcast_arrays(stride, ks, pad)
        units = [unit(fn.type_name == "Deconvolution", int(k), int(s), int(p))
                 for k, s, p in zip(ks, stride, pad)]
        scale = np.array([float(1 / u.stride) for u in units])
        shift = np.array([float(-(u.start + (u.size - 1) / 2) / u.stride) for u in units])
        return axis, scale, shift
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset           # -1: the last non-coordinate axis
    raise UndefinedMapException


def compose(base_map, next_map):
    """``next_map`` after ``base_map``: the scales multiply, the shifts scale by the base's."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is None:
        ax = ax2
    elif ax2 is None or ax1 == ax2:
        ax = ax1
    else:
        raise AxisMismatchException
    return ax, a1 * a2, a1 * b2 + b1


def inverse(coord_map):
    """The map that undoes ``coord_map``."""
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _bottoms(top):
    # Crop's second bottom only gives the size: it is not walked.
    return top.fn.inputs[:1] if top.fn.type_name == "Crop" else top.fn.inputs


def coord_map_from_to(top_from, top_to):
    """The map from ``top_from``'s coordinates to ``top_to``'s, through their common ancestor."""
    from_maps, frontier = {top_from: (None, 1, 0)}, {top_from}
    while frontier:
        top = frontier.pop()
        try:
            for bottom in _bottoms(top):
                from_maps[bottom] = compose(from_maps[top], coord_map(top.fn))
                frontier.add(bottom)
        except UndefinedMapException:
            pass
    to_maps, frontier = {top_to: (None, 1, 0)}, {top_to}
    while frontier:
        top = frontier.pop()
        if top in from_maps:
            return compose(to_maps[top], inverse(from_maps[top]))
        try:
            for bottom in _bottoms(top):
                to_maps[bottom] = compose(to_maps[top], coord_map(top.fn))
                frontier.add(bottom)
        except UndefinedMapException:
            continue
    raise RuntimeError("Could not compute map between tops; are they connected by spatial layers?")


def crop(top_from, top_to):
    """A Crop layer (NetSpec) that crops ``top_from`` to ``top_to``'s coordinates."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    assert (np.asarray(a) == 1).all(), f"scale mismatch on crop (a = {a})"
    assert (np.asarray(b) <= 0).all(), f"cannot crop negative offset (b = {b})"
    assert (np.round(b) == b).all(), f"cannot crop noninteger offset (b = {b})"
    return layer_fn("Crop")(top_from, top_to, crop_param=dict(
        axis=ax + 1, offset=list(-np.round(np.asarray(b, dtype=float)).astype(int).reshape(-1))))
