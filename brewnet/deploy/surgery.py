"""Net surgery: a classifier made fully convolutional (Caffe's ``examples/net_surgery``).

An InnerProduct on an N x C x H x W bottom is a Convolution with kernel H x W and no padding;
on the (N, K) output of another InnerProduct it is a 1 x 1 Convolution over K channels. The
weights are the same numbers: (N_out, K) reshaped to (N_out, C, H, W), since Caffe flattens a
blob in C, H, W order. At the original input size the new net gives the original numbers (the
score "map" is 1 x 1); on a larger input it slides the classifier, one score per position at
the stride of the last convolution's bottom.
"""
from __future__ import annotations

from ..errors import NetError
from ..proto import caffe_pb2 as pb

__all__ = ["fully_convolutional", "fully_convolutional_param", "after_data"]


def fully_convolutional_param(param: "pb.NetParameter", shapes: dict,
                              input_shapes: dict | None = None) -> tuple["pb.NetParameter", list[str]]:
    """``param`` with every InnerProduct layer a Convolution; returns (new param, the names of
    the converted layers). ``shapes``: blob name -> shape at the original size (``Net.shapes``)
    — a kernel is its bottom's spatial size there. ``input_shapes``: Input tops to resize
    (name -> full N x C x H x W shape). Layer and blob names are kept, so ``--split`` blobs and
    output names stay valid; the rules that chose the layers are dropped (already applied)."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    input_shapes = dict(input_shapes or {})
    converted = []
    for lp in out.layer:
        del lp.include[:], lp.exclude[:]
        if lp.type == "Input" and any(t in input_shapes for t in lp.top):
            del lp.input_param.shape[:]     # one shape per top from here on
            for t in lp.top:
                lp.input_param.shape.add().dim.extend(input_shapes.pop(t, shapes[t]))
        if lp.type != "InnerProduct":
            continue
        ip = lp.inner_product_param
        s = shapes[lp.bottom[0]]
        if ip.axis not in (1, 1 - len(s)) or len(s) not in (2, 4):
            raise NetError(f"fully_convolutional: layer '{lp.name}' (InnerProduct, axis {ip.axis}) "
                           f"reads '{lp.bottom[0]}' of shape {tuple(s)}; only axis 1 over an "
                           "N x C x H x W or N x K bottom maps onto a Convolution")
        kh, kw = (s[2], s[3]) if len(s) == 4 else (1, 1)
        conv = pb.ConvolutionParameter(num_output=ip.num_output, bias_term=ip.bias_term,
                                       kernel_h=kh, kernel_w=kw)
        if ip.HasField("weight_filler"):
            conv.weight_filler.CopyFrom(ip.weight_filler)
        if ip.HasField("bias_filler"):
            conv.bias_filler.CopyFrom(ip.bias_filler)
        lp.ClearField("inner_product_param")
        lp.type = "Convolution"
        lp.convolution_param.CopyFrom(conv)
        converted.append(lp.name)
    if input_shapes:
        inputs = [t for lp in param.layer if lp.type == "Input" for t in lp.top]
        raise NetError(f"fully_convolutional: no Input top named {', '.join(map(repr, input_shapes))}"
                       f"; the net's inputs are {inputs}")
    return out, converted


def fully_convolutional(net, input_shape=None):
    """A fully convolutional copy of ``net`` (a core ``brewnet.net.Net`` or pycaffe's
    ``brewnet.Net``; the copy is of the same class, on the same device) with ``net``'s weights,
    every InnerProduct turned into the equivalent Convolution. ``input_shape``: the new input
    size, a full shape or (H, W) for the first input, or a dict {input: shape}. The copy's
    ``.param`` is its definition: ``brewnet.proto.io.write_text("fc.prototxt", fc.param)`` and
    ``fc.save("fc.caffemodel")`` give a pair Caffe itself loads."""
    import torch

    if isinstance(input_shape, dict):
        shapes_in = {k: tuple(v) for k, v in input_shape.items()}
    elif input_shape is not None:
        if not net.inputs:
            raise NetError(f"fully_convolutional: net '{net.name}' has no Input layer to resize")
        first = net.inputs[0]
        s = tuple(int(v) for v in input_shape)
        shapes_in = {first: net.shapes[first][:len(net.shapes[first]) - len(s)] + s}
    else:
        shapes_in = {}
    param, converted = fully_convolutional_param(net.param, net.shapes, shapes_in)
    try:
        new = type(net)(param, net.phase, device=net.device)
    except NetError as e:
        raise NetError(f"fully_convolutional: the converted net ({', '.join(converted)} now "
                       f"Convolutions) does not build: {e}") from None
    with torch.no_grad():
        for src, dst in zip(net.layer_list, new.layer_list):
            for a, b in zip(src.blobs, dst.blobs):
                if src.type == "InnerProduct" and a.dim() == 2 and src.transpose:
                    a = a.t()
                b.copy_(a.reshape(b.shape))
    return new


def after_data(net, wanted: list[str]) -> tuple["pb.NetParameter", int]:
    """The part of ``net`` after its data layers that computes the blobs ``wanted``, as a deploy
    net: one Input layer holding the data layers' tops (at their shapes), then every later layer
    that writes a blob the wanted ones depend on (in-place layers included). Returns (that net,
    the index of the last data layer), or (None, -1) when the net does not start with data layers
    (so that ``net.forward_tensors(0, last)`` feeds the new net's inputs)."""
    last = -1
    for i, layer in enumerate(net.layer_list):
        if net.bottom_lists[i] or layer.type == "Input":
            break
        last = i
    if last < 0:
        return None, -1
    need, keep = set(wanted), []
    for i in range(len(net.layer_list) - 1, last, -1):
        if need & set(net.top_lists[i]):
            keep.append(i)
            need |= set(net.bottom_lists[i])
    sources = [t for i in range(last + 1) for t in net.top_lists[i] if t in need]
    out = pb.NetParameter(name=net.name)
    data = out.layer.add(name="data_tops", type="Input")
    for t in sources:
        data.top.append(t)
        data.input_param.shape.add(dim=list(net.shapes[t]))
    for i in reversed(keep):
        lp = out.layer.add()
        lp.CopyFrom(net.layer_list[i].param)
        del lp.blobs[:], lp.include[:], lp.exclude[:]
    return out, last
