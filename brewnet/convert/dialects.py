"""What each dialect may write: the layer types, and for ``bvlc`` the fields of BVLC Caffe 1.0's
``caffe.proto`` (name and number) the converter uses, so a written file parses in BVLC's schema
with no unknown field.

* ``bvlc``: BVLC Caffe 1.0 (April 2017) layers and fields only: what strict vendor SDKs accept.
* ``ssd``: bvlc + Weiliu's SSD fork (Permute, Normalize, PriorBox, DetectionOutput).
* ``forks``: ssd + the common fork layers (ReLU6, Clip, Swish, Interp, Upsample, ShuffleChannel).
"""
from __future__ import annotations

from .graph import ConversionError

BVLC_LAYERS = frozenset({
    "Input", "Convolution", "Deconvolution", "InnerProduct", "BatchNorm", "Scale", "Bias", "ReLU",
    "PReLU", "ELU", "Sigmoid", "TanH", "Power", "Eltwise", "Pooling", "Concat", "Slice", "Silence",
    "Flatten", "Reshape", "Softmax", "Log", "Exp", "AbsVal", "Tile", "Reduction", "Parameter", "Crop",
    "Split"})
SSD_LAYERS = BVLC_LAYERS | {"Permute", "Normalize", "PriorBox", "DetectionOutput"}
FORK_LAYERS = SSD_LAYERS | {"ReLU6", "Clip", "Swish", "Interp", "Upsample", "ShuffleChannel"}
LAYERS = {"bvlc": BVLC_LAYERS, "ssd": SSD_LAYERS, "forks": FORK_LAYERS}

# BVLC Caffe 1.0's caffe.proto: message -> {field: number}, for the messages and fields the
# converter writes (checked against brewnet's caffe.proto in the tests; see bvlc_proto()).
BVLC_FIELDS = {
    "NetParameter": {"name": 1, "input": 3, "input_shape": 8, "input_dim": 4, "layer": 100},
    "BlobShape": {"dim": 1},
    "BlobProto": {"shape": 7, "data": 5, "num": 1, "channels": 2, "height": 3, "width": 4},
    "LayerParameter": {
        "name": 1, "type": 2, "bottom": 3, "top": 4, "blobs": 7, "batch_norm_param": 139,
        "bias_param": 141, "concat_param": 104, "convolution_param": 106, "crop_param": 144,
        "eltwise_param": 110, "elu_param": 140, "exp_param": 111, "flatten_param": 135,
        "inner_product_param": 117, "input_param": 143, "log_param": 134, "parameter_param": 145,
        "pooling_param": 121, "power_param": 122, "prelu_param": 131, "reduction_param": 136,
        "relu_param": 123, "reshape_param": 133, "scale_param": 142, "slice_param": 126,
        "softmax_param": 125, "tile_param": 138},
    "ConvolutionParameter": {"num_output": 1, "bias_term": 2, "pad": 3, "kernel_size": 4, "group": 5,
                             "stride": 6, "pad_h": 9, "pad_w": 10, "kernel_h": 11, "kernel_w": 12,
                             "stride_h": 13, "stride_w": 14, "dilation": 18},
    "PoolingParameter": {"pool": 1, "kernel_size": 2, "stride": 3, "pad": 4, "kernel_h": 5,
                         "kernel_w": 6, "stride_h": 7, "stride_w": 8, "pad_h": 9, "pad_w": 10,
                         "global_pooling": 12},
    "InnerProductParameter": {"num_output": 1, "bias_term": 2, "axis": 5},
    "BatchNormParameter": {"use_global_stats": 1, "eps": 3},
    "ScaleParameter": {"axis": 1, "num_axes": 2, "bias_term": 4},
    "BiasParameter": {"axis": 1, "num_axes": 2},
    "EltwiseParameter": {"operation": 1, "coeff": 2},
    "ConcatParameter": {"axis": 2},
    "SliceParameter": {"slice_point": 2, "axis": 3},
    "FlattenParameter": {"axis": 1, "end_axis": 2},
    "ReshapeParameter": {"shape": 1, "axis": 2, "num_axes": 3},
    "SoftmaxParameter": {"axis": 2},
    "PowerParameter": {"power": 1, "scale": 2, "shift": 3},
    "ReLUParameter": {"negative_slope": 1},
    "PReLUParameter": {"channel_shared": 2},
    "ELUParameter": {"alpha": 1},
    "InputParameter": {"shape": 1},
    "ParameterParameter": {"shape": 1},
    "ReductionParameter": {"operation": 1, "axis": 2, "coeff": 3},
    "TileParameter": {"axis": 1, "tiles": 2},
    "LogParameter": {"base": 1, "scale": 2, "shift": 3},
    "ExpParameter": {"base": 1, "scale": 2, "shift": 3},
    "CropParameter": {"axis": 1, "offset": 2},
}


def check_layer_type(dialect: str, layer_type: str) -> None:
    if layer_type not in LAYERS[dialect]:
        raise ConversionError(f"internal: the {dialect} dialect has no {layer_type} layer")


def foreign_fields(message, dialect: str = "bvlc", where: str = "") -> list[str]:
    """Fields set in ``message`` (recursively) that BVLC Caffe 1.0's schema lacks."""
    if dialect != "bvlc":
        return []
    bad = []
    allowed = BVLC_FIELDS.get(message.DESCRIPTOR.name)
    for fd, value in message.ListFields():
        here = f"{where}.{fd.name}" if where else fd.name
        if allowed is None or allowed.get(fd.name) != fd.number:
            bad.append(f"{message.DESCRIPTOR.name}.{fd.name} ({here})")
            continue
        if fd.message_type is not None:
            for m in (value if fd.is_repeated else [value]):
                bad += foreign_fields(m, dialect, here)
    return bad


def bvlc_proto() -> str:
    """A ``caffe.proto`` of BVLC Caffe 1.0's messages, restricted to BVLC_FIELDS, with the field
    types read from brewnet's schema (whose numbers must agree): compile it with protoc to read
    a written file as BVLC Caffe reads it."""
    from ..proto import caffe_pb2 as pb

    lines = ['syntax = "proto2";', "package caffe;"]
    for msg, fields in BVLC_FIELDS.items():
        desc = getattr(pb, msg).DESCRIPTOR
        lines.append(f"message {msg} {{")
        for e in desc.enum_types:
            if any(desc.fields_by_name[f].enum_type is e for f in fields if f in desc.fields_by_name):
                vals = " ".join(f"{v.name} = {v.number};" for v in e.values)
                lines.append(f"  enum {e.name} {{ {vals} }}")
        for name, number in fields.items():
            fd = desc.fields_by_name[name]
            if fd.number != number:
                raise ConversionError(f"brewnet's {msg}.{name} is {fd.number}, BVLC's {number}")
            label = "repeated" if fd.is_repeated else "optional"
            if fd.message_type is not None:
                typ = fd.message_type.name
            elif fd.enum_type is not None:
                typ = fd.enum_type.name
            else:
                typ = _SCALARS[fd.type]
            packed = " [packed = true]" if fd.is_repeated and fd.message_type is None and \
                msg in ("BlobProto", "BlobShape") else ""
            lines.append(f"  {label} {typ} {name} = {number}{packed};")
        lines.append("}")
    return "\n".join(lines) + "\n"


_SCALARS = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string",
            12: "bytes", 13: "uint32", 17: "sint32", 18: "sint64"}
