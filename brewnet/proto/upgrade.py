"""Every legacy-format upgrade, in one place (the counterpart of Caffe's upgrade_proto.cpp).

``upgrade_net`` applies, in Caffe's order: V0 layers (with padding layers folded into the next
conv/pool) -> V1; data-layer transform fields -> ``transform_param``; V1 ``layers`` -> V2
``layer``; ``input``/``input_shape``/``input_dim`` -> an ``Input`` layer; old BatchNorm param
specs -> lr_mult/decay_mult 0. brewnet adds one step: PoolingParameter ``ceil_mode`` (a
fork field) -> ``round_mode``, and fork layer messages stored at a fork's own field number in binary
files -> brewnet's field (``upgrade_fork_fields``). ``upgrade_solver`` turns the ``solver_type`` enum into ``type``.
Problems Caffe treats as fatal raise ProtoError; those it tolerates are logged and skipped.
"""
from __future__ import annotations

import logging

from . import caffe_pb2 as pb
from .errors import ProtoError
from .prior_layouts import needs_prior_box_layout_upgrade, upgrade_prior_box_layouts

log = logging.getLogger("brewnet")

V1 = pb.V1LayerParameter

# V1 enum -> V2 type string (Caffe's UpgradeV1LayerType).
V1_TYPE_NAMES = {
    V1.NONE: "", V1.ABSVAL: "AbsVal", V1.ACCURACY: "Accuracy", V1.ARGMAX: "ArgMax",
    V1.BNLL: "BNLL", V1.CONCAT: "Concat", V1.CONTRASTIVE_LOSS: "ContrastiveLoss",
    V1.CONVOLUTION: "Convolution", V1.DECONVOLUTION: "Deconvolution", V1.DATA: "Data",
    V1.DROPOUT: "Dropout", V1.DUMMY_DATA: "DummyData", V1.EUCLIDEAN_LOSS: "EuclideanLoss",
    V1.ELTWISE: "Eltwise", V1.EXP: "Exp", V1.FLATTEN: "Flatten", V1.HDF5_DATA: "HDF5Data",
    V1.HDF5_OUTPUT: "HDF5Output", V1.HINGE_LOSS: "HingeLoss", V1.IM2COL: "Im2col",
    V1.IMAGE_DATA: "ImageData", V1.INFOGAIN_LOSS: "InfogainLoss",
    V1.INNER_PRODUCT: "InnerProduct", V1.LRN: "LRN", V1.MEMORY_DATA: "MemoryData",
    V1.MULTINOMIAL_LOGISTIC_LOSS: "MultinomialLogisticLoss", V1.MVN: "MVN",
    V1.POOLING: "Pooling", V1.POWER: "Power", V1.RELU: "ReLU", V1.SIGMOID: "Sigmoid",
    V1.SIGMOID_CROSS_ENTROPY_LOSS: "SigmoidCrossEntropyLoss", V1.SILENCE: "Silence",
    V1.SOFTMAX: "Softmax", V1.SOFTMAX_LOSS: "SoftmaxWithLoss", V1.SPLIT: "Split",
    V1.SLICE: "Slice", V1.TANH: "TanH", V1.WINDOW_DATA: "WindowData",
    V1.THRESHOLD: "Threshold",
    # Forks' values: longjon's crop (BVLC PR 1639, the crop of V1 FCN and DeconvNet nets) finds
    # its offsets from the net's coordinate maps, as RCF's AutoCrop; DeconvNet's caffe's two.
    V1.CROP: "AutoCrop", V1.UNPOOLING: "Unpooling", V1.BN: "BN",
}

# V0 type string -> V1 enum (Caffe's UpgradeV0LayerType).
V0_TYPES = {
    "accuracy": V1.ACCURACY, "bnll": V1.BNLL, "concat": V1.CONCAT, "conv": V1.CONVOLUTION,
    "data": V1.DATA, "dropout": V1.DROPOUT, "euclidean_loss": V1.EUCLIDEAN_LOSS,
    "flatten": V1.FLATTEN, "hdf5_data": V1.HDF5_DATA, "hdf5_output": V1.HDF5_OUTPUT,
    "im2col": V1.IM2COL, "images": V1.IMAGE_DATA, "infogain_loss": V1.INFOGAIN_LOSS,
    "innerproduct": V1.INNER_PRODUCT, "lrn": V1.LRN,
    "multinomial_logistic_loss": V1.MULTINOMIAL_LOGISTIC_LOSS, "pool": V1.POOLING,
    "relu": V1.RELU, "sigmoid": V1.SIGMOID, "softmax": V1.SOFTMAX,
    "softmax_loss": V1.SOFTMAX_LOSS, "split": V1.SPLIT, "tanh": V1.TANH,
    "window_data": V1.WINDOW_DATA,
}

# V0 field -> {V0 type: (V1 sub-message, field)}; "transform" rows apply to every type.
# `repeated` marks ConvolutionParameter's list-valued fields.
_V0_FIELDS = {
    "num_output": {"conv": ("convolution_param", "num_output"),
                   "innerproduct": ("inner_product_param", "num_output")},
    "biasterm": {"conv": ("convolution_param", "bias_term"),
                 "innerproduct": ("inner_product_param", "bias_term")},
    "weight_filler": {"conv": ("convolution_param", "weight_filler"),
                      "innerproduct": ("inner_product_param", "weight_filler")},
    "bias_filler": {"conv": ("convolution_param", "bias_filler"),
                    "innerproduct": ("inner_product_param", "bias_filler")},
    "pad": {"conv": ("convolution_param", "pad"), "pool": ("pooling_param", "pad")},
    "kernelsize": {"conv": ("convolution_param", "kernel_size"),
                   "pool": ("pooling_param", "kernel_size")},
    "group": {"conv": ("convolution_param", "group")},
    "stride": {"conv": ("convolution_param", "stride"), "pool": ("pooling_param", "stride")},
    "pool": {"pool": ("pooling_param", "pool")},
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio")},
    "local_size": {"lrn": ("lrn_param", "local_size")},
    "alpha": {"lrn": ("lrn_param", "alpha")},
    "beta": {"lrn": ("lrn_param", "beta")},
    "k": {"lrn": ("lrn_param", "k")},
    "source": {"data": ("data_param", "source"), "hdf5_data": ("hdf5_data_param", "source"),
               "images": ("image_data_param", "source"),
               "window_data": ("window_data_param", "source"),
               "infogain_loss": ("infogain_loss_param", "source")},
    "scale": {"*": ("transform_param", "scale")},
    "meanfile": {"*": ("transform_param", "mean_file")},
    "batchsize": {"data": ("data_param", "batch_size"),
                  "hdf5_data": ("hdf5_data_param", "batch_size"),
                  "images": ("image_data_param", "batch_size"),
                  "window_data": ("window_data_param", "batch_size")},
    "cropsize": {"*": ("transform_param", "crop_size")},
    "mirror": {"*": ("transform_param", "mirror")},
    "rand_skip": {"data": ("data_param", "rand_skip"),
                  "images": ("image_data_param", "rand_skip")},
    "shuffle_images": {"images": ("image_data_param", "shuffle")},
    "new_height": {"images": ("image_data_param", "new_height")},
    "new_width": {"images": ("image_data_param", "new_width")},
    "concat_dim": {"concat": ("concat_param", "concat_dim")},
    "det_fg_threshold": {"window_data": ("window_data_param", "fg_threshold")},
    "det_bg_threshold": {"window_data": ("window_data_param", "bg_threshold")},
    "det_fg_fraction": {"window_data": ("window_data_param", "fg_fraction")},
    "det_context_pad": {"window_data": ("window_data_param", "context_pad")},
    "det_crop_mode": {"window_data": ("window_data_param", "crop_mode")},
    "hdf5_output_param": {"hdf5_output": (None, "hdf5_output_param")},
}

# Sub-messages a V1 layer may carry; all are copied verbatim into the V2 layer.
_V1_PARAMS = [f.name for f in V1.DESCRIPTOR.fields
              if f.name.endswith("_param") and f.message_type is not None]

# Data-layer transform fields that moved into transform_param.
_DATA_TRANSFORM = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param",
                   V1.WINDOW_DATA: "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

SOLVER_TYPE_NAMES = {
    pb.SolverParameter.SGD: "SGD", pb.SolverParameter.NESTEROV: "Nesterov",
    pb.SolverParameter.ADAGRAD: "AdaGrad", pb.SolverParameter.RMSPROP: "RMSProp",
    pb.SolverParameter.ADADELTA: "AdaDelta", pb.SolverParameter.ADAM: "Adam",
}


# ----------------------------------------------------------------------------------- checks

def needs_v0_upgrade(net) -> bool:
    return any(l.HasField("layer") for l in net.layers)


def needs_data_upgrade(net) -> bool:
    for l in net.layers:
        sub = _DATA_TRANSFORM.get(l.type)
        if sub and any(getattr(l, sub).HasField(f) for f in _TRANSFORM_FIELDS):
            return True
    return False


def needs_v1_upgrade(net) -> bool:
    return len(net.layers) > 0


def needs_input_upgrade(net) -> bool:
    return len(net.input) > 0


def needs_batchnorm_upgrade(net) -> bool:
    return any(l.type == "BatchNorm" and len(l.param) == 3 for l in net.layer)


def needs_ceil_mode_upgrade(net) -> bool:
    return any(l.pooling_param.HasField("ceil_mode") for l in (*net.layer, *net.layers))


def needs_upgrade(net) -> bool:
    """True if ``net`` uses any legacy form that ``upgrade_net`` rewrites."""
    return (needs_v0_upgrade(net) or needs_data_upgrade(net) or needs_v1_upgrade(net)
            or needs_input_upgrade(net) or needs_batchnorm_upgrade(net)
            or needs_ceil_mode_upgrade(net) or needs_fork_fields_upgrade(net)
            or needs_prior_box_layout_upgrade(net))


# ----------------------------------------------------------------------------------- net

def upgrade_net(net, source: str = "<net>"):
    """A copy of ``net`` in the current format (the input is not modified)."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    if needs_v0_upgrade(out):
        log.info("Attempting to upgrade V0LayerParameter layers in %s", source)
        ok = upgrade_v0_net(out)
        _report(ok, "V0LayerParameter", source)
    if needs_data_upgrade(out):
        log.info("Attempting to upgrade deprecated data-layer transformation fields in %s",
                 source)
        upgrade_data_transformation(out)
        log.info("Moved data-layer transformation fields into transform_param")
    if needs_v1_upgrade(out):
        log.info("Attempting to upgrade V1LayerParameter layers in %s", source)
        ok = upgrade_v1_net(out)
        _report(ok, "V1LayerParameter", source)
    if needs_input_upgrade(out):
        log.info("Attempting to upgrade deprecated input fields in %s", source)
        upgrade_net_input(out, source)
        log.info("Replaced input fields with an Input layer")
    if needs_batchnorm_upgrade(out):
        log.info("Attempting to upgrade BatchNorm param specs in %s", source)
        upgrade_batchnorm(out)
        log.info("Set BatchNorm lr_mult and decay_mult to 0")
    if needs_ceil_mode_upgrade(out):
        log.info("Mapping PoolingParameter ceil_mode to round_mode in %s", source)
        upgrade_ceil_mode(out)
    if needs_fork_fields_upgrade(out):
        log.info("Reading fork layer fields at their forks' numbers in %s", source)
        upgrade_fork_fields(out)
    check_fork_collisions(out, source)
    upgrade_prior_box_layouts(out, source)     # TextBoxes' and FaceBoxes' priors (prior_layouts.py)
    return out


def _report(ok: bool, what: str, source: str) -> None:
    if ok:
        log.info("Successfully upgraded %s in %s", what, source)
    else:
        log.error("Had one or more problems upgrading %s in %s (see above); continuing anyway",
                  what, source)


def upgrade_v0_net(net) -> bool:
    """V0 layers (``layers { layer { type: "conv" ... } }``) -> V1 layers, in place."""
    _fold_padding_layers(net)
    ok = True
    v0 = list(net.layers)
    del net.layers[:]
    for conn in v0:
        ok &= _upgrade_v0_layer(conn, net.layers.add())
    return ok


def _fold_padding_layers(net) -> None:
    # A V0 "padding" layer is dropped and its pad moved into the conv/pool that reads its top.
    old = list(net.layers)
    del net.layers[:]
    producer = {name: -1 for name in net.input}   # blob -> index into `old`; -1 = net input
    for i, conn in enumerate(old):
        kind = conn.layer.type
        if kind != "padding":
            net.layers.add().CopyFrom(conn)
        for j, blob in enumerate(conn.bottom):
            if blob not in producer:
                raise ProtoError(f"V0 upgrade: unknown bottom blob '{blob}' of layer "
                                 f"'{conn.layer.name}'")
            src = producer[blob]
            if src < 0 or old[src].layer.type != "padding":
                continue
            pad_layer = old[src]
            if kind not in ("conv", "pool"):
                raise ProtoError(f"V0 upgrade: padding layer '{pad_layer.layer.name}' feeds "
                                 f"layer '{conn.layer.name}' of type '{kind}'; only conv and "
                                 "pool layers can absorb padding")
            if len(conn.bottom) != 1 or len(pad_layer.bottom) != 1 or len(pad_layer.top) != 1:
                raise ProtoError(f"V0 upgrade: padding layer '{pad_layer.layer.name}' and its "
                                 f"consumer '{conn.layer.name}' must have one bottom/top each")
            new = net.layers[-1]
            new.layer.pad = pad_layer.layer.pad
            new.bottom[j] = pad_layer.bottom[0]
        for blob in conn.top:
            producer[blob] = i


def _upgrade_v0_layer(conn, out) -> bool:
    out.bottom.extend(conn.bottom)
    out.top.extend(conn.top)
    if not conn.HasField("layer"):
        return True
    v0 = conn.layer
    ok = True
    if v0.HasField("name"):
        out.name = v0.name
    kind = v0.type
    if v0.HasField("type"):
        if kind not in V0_TYPES:
            raise ProtoError(f"V0 upgrade: unknown layer type '{kind}' (layer '{v0.name}')")
        out.type = V0_TYPES[kind]
    out.blobs.extend(v0.blobs)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for field, targets in _V0_FIELDS.items():
        if not v0.HasField(field):
            continue
        target = targets.get(kind) or targets.get("*")
        if target is None:
            log.error("V0 upgrade: layer '%s': unknown parameter %s for layer type %s",
                      v0.name, field, kind)
            ok = False
            continue
        sub, name = target
        dest = out if sub is None else getattr(out, sub)
        value = getattr(v0, field)
        fd = dest.DESCRIPTOR.fields_by_name[name]
        if fd.message_type is not None:
            getattr(dest, name).CopyFrom(value)
        elif fd.is_repeated:
            getattr(dest, name).append(value)
        else:
            setattr(dest, name, value)   # V0 and V1 PoolMethod enums share their numbers
    return ok


def upgrade_data_transformation(net) -> None:
    """Move scale/mean_file/crop_size/mirror of V1 data layers into transform_param."""
    for layer in net.layers:
        sub = _DATA_TRANSFORM.get(layer.type)
        if not sub:
            continue
        param = getattr(layer, sub)
        param.SetInParent()              # Caffe's mutable_*() creates both messages
        layer.transform_param.SetInParent()
        for f in _TRANSFORM_FIELDS:
            if param.HasField(f):
                setattr(layer.transform_param, f, getattr(param, f))
                param.ClearField(f)


def upgrade_v1_net(net) -> bool:
    """V1 ``layers`` -> V2 ``layer``, in place."""
    if len(net.layer):
        raise ProtoError("refusing to upgrade a net that has both 'layer' and 'layers' "
                         "entries: rewrite the 'layers { type: ENUM }' entries as "
                         "'layer { type: \"Name\" }'")
    ok = True
    v1 = list(net.layers)
    net.ClearField("layers")
    for i, old in enumerate(v1):
        if not upgrade_v1_layer(old, net.layer.add()):
            log.error("Upgrade of V1 layer %d ('%s') failed", i, old.name)
            ok = False
    return ok


def upgrade_v1_layer(v1, out) -> bool:
    """Fill the LayerParameter ``out`` from the V1LayerParameter ``v1``."""
    out.Clear()
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    if v1.HasField("name"):
        out.name = v1.name
    out.include.extend(v1.include)
    out.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        out.type = V1_TYPE_NAMES[v1.type]
    out.blobs.extend(v1.blobs)

    def spec(i):
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):   # V1 and ParamSpec enums share numbers
        spec(i).share_mode = mode
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for name in _V1_PARAMS:
        if v1.HasField(name):
            getattr(out, name).CopyFrom(getattr(v1, name))
    if v1.HasField("type") and v1.type == V1.BN:
        _deconvnet_bn(out.bn_param)
    if v1.HasField("layer"):
        log.error("V1 layer '%s' still holds a V0 layer; ignoring it", v1.name)
        return False
    return True


def _deconvnet_bn(p) -> None:
    """A V1 BN layer is DeconvNet's (scale, shift; LEARN or INFERENCE). Its binary fields 1-3
    (scale_filler, shift_filler, bn_mode) read as brewnet's slope_filler, bias_filler and an
    unknown field: move them to DeconvNet's names, and write bn_mode, so the BN layer takes the
    DeconvNet/SegNet reading even where the prototxt gave no bn_param."""
    for src, dst in (("slope_filler", "scale_filler"), ("bias_filler", "shift_filler")):
        if p.HasField(src) and not p.HasField(dst):
            getattr(p, dst).CopyFrom(getattr(p, src))
            p.ClearField(src)
    for f in _unknown(p, _SEGNET_BN_MODE):
        p.bn_mode = f.data
    p.DiscardUnknownFields()
    if not p.HasField("bn_mode"):
        p.bn_mode = pb.BNParameter.LEARN


def upgrade_net_input(net, source: str = "<net>") -> None:
    """``input`` + ``input_shape``/``input_dim`` -> an Input layer named "input", placed first.

    Inputs without any shape (old caffemodels) are simply dropped.
    """
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if has_shape or has_dim:
        if has_shape and len(net.input_shape) != len(net.input):
            raise ProtoError(f"{source}: {len(net.input)} inputs but {len(net.input_shape)} "
                             "input_shape entries")
        if not has_shape and len(net.input_dim) != 4 * len(net.input):
            raise ProtoError(f"{source}: {len(net.input)} inputs need {4 * len(net.input)} "
                             f"input_dim values, got {len(net.input_dim)}")
        layer = pb.LayerParameter(name="input", type="Input")
        for i, name in enumerate(net.input):
            layer.top.append(name)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i:4 * i + 4])
        rest = list(net.layer)
        net.ClearField("layer")
        net.layer.add().CopyFrom(layer)
        net.layer.extend(rest)
    for f in ("input", "input_shape", "input_dim"):
        net.ClearField(f)


def upgrade_batchnorm(net) -> None:
    """Old BatchNorm defs listed 3 param specs; the statistics must never be learned."""
    for layer in net.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for p in layer.param:
                p.lr_mult = 0.0
                p.decay_mult = 0.0


def upgrade_ceil_mode(net) -> None:
    """brewnet extension: PoolingParameter ``ceil_mode`` -> ``round_mode``.

    Forks built on BVLC pull request #3057 (e.g. the caffe used for shicai/DenseNet-Caffe)
    added ``ceil_mode``; BVLC later solved the same need with ``round_mode``. true means
    Caffe's usual ceil rounding of the pooled size (CEIL), false means FLOOR (PyTorch's
    default); keeping the field would silently give CEIL shapes for ``ceil_mode: false``.
    """
    for layer in (*net.layer, *net.layers):
        p = layer.pooling_param
        if not p.HasField("ceil_mode"):
            continue
        mode = pb.PoolingParameter.CEIL if p.ceil_mode else pb.PoolingParameter.FLOOR
        if p.HasField("round_mode") and p.round_mode != mode:
            raise ProtoError(f"layer '{layer.name}': ceil_mode: {str(p.ceil_mode).lower()} "
                             f"contradicts round_mode: "
                             f"{pb.PoolingParameter.RoundMode.Name(p.round_mode)}")
        p.round_mode = mode
        p.ClearField("ceil_mode")


# ----------------------------------------------------------------------------- fork numbers

# Binary files of Caffe forks keep some layer messages at a number brewnet's schema gives to
# another field (caffe.proto, "Fork layers"): (layer types, that number, the field brewnet's
# schema has there or None when it is unknown to it, the field the fork meant, the fork).
FORK_NUMBERS = [
    (("Interp",), 143, "input_param", "interp_param", "DeepLab v2 / PSPNet"),
    (("Upsample",), 137, "embed_param", "upsample_param", "SegNet"),
    (("SmoothL1Loss",), 148, "clip_param", "smooth_l1_loss_param", "a Fast R-CNN port"),
    (("Proposal",), 201, "multibox_loss_param", "proposal_param", "OpenCV / C++ Faster R-CNN ports"),
    (("Region",), 149, "reorg_param", "region_param", "YOLOv2 ports"),
    (("PSROIPooling",), 10001, None, "psroi_pooling_param", "R-FCN"),
    (("PSROIPooling",), 10002, None, "psroi_pooling_param", "OpenCV"),
    # py-R-FCN's Caffe (Microsoft/caffe 1a2be8e, the commit its README names): 149, where
    # brewnet has the YOLO ports' reorg_param (lossless there: ReorgParameter.reverse is an enum).
    (("PSROIPooling",), 149, "reorg_param", "psroi_pooling_param", "py-R-FCN (Microsoft/caffe)"),
    (("BN",), 45, None, "bn_param", "SegNet"),
    (("Lstm",), 8266711, "roi_pooling_param", "lstm_param", "caffe_ocr"),
    (("DenseBlock",), 147, "swish_param", "denseblock_param", "caffe_ocr"),
    (("ContinuationIndicator",), 201, "multibox_loss_param", "continuation_indicator_param",
     "warp-ctc caffe"),
    # lmb-freiburg/flownet2 (476d400), PWC-Net's Caffe: correlation_param at 150, the YOLO ports'
    # upsample_param here (lossless there: UpsampleParameter's pad_out_h/w at 4/5 are enums).
    (("Correlation",), 150, "upsample_param", "correlation_param", "FlowNet 2.0 / PWC-Net"),
    (("DenseImageData",), 138, "tile_param", "dense_image_data_param", "SegNet"),
]
_SEGNET_BN_MODE = 3   # SegNet's BNParameter.bn_mode: a varint where PSPNet's momentum is a float


def _unknown(msg, number: int) -> list:
    from google.protobuf.unknown_fields import UnknownFieldSet

    return [f for f in UnknownFieldSet(msg) if f.field_number == number]


def _fork_pending(layer) -> list:
    """(number, bytes, target, fork, field here) for each fork message ``layer`` holds at a fork number."""
    out = []
    for types, number, here, target, fork in FORK_NUMBERS:
        if layer.type not in types:
            continue
        if here is not None and layer.HasField(here):
            out.append((number, getattr(layer, here).SerializePartialToString(), target, fork,
                        here))
        for f in _unknown(layer, number) if here is None else ():
            out.append((number, f.data, target, fork, None))
    return out


def needs_fork_fields_upgrade(net) -> bool:
    return any(_fork_pending(layer) for layer in net.layer)


def upgrade_fork_fields(net) -> None:
    """brewnet extension: move fork layer messages read at a colliding field number (binary
    files only; text names the field) to brewnet's field for them, by layer type (FORK_NUMBERS).
    SegNet's BN keeps its fillers at 1 and 2 (brewnet's slope/bias fillers, the same blobs); its
    bn_mode (3) becomes ``bn_mode``."""
    for layer in net.layer:
        for number, data, target, fork, here in _fork_pending(layer):
            msg = getattr(layer, target)
            msg.MergeFromString(data)
            if here is not None:
                layer.ClearField(here)
            if target == "bn_param":
                for f in _unknown(msg, _SEGNET_BN_MODE):
                    msg.bn_mode = f.data
            if _has_unknown(msg):
                raise ProtoError(f"layer '{layer.name}' (type {layer.type}): field {number} "
                                 f"does not decode as {fork}'s {target} either")
            msg.DiscardUnknownFields()
            log.info("layer '%s' (type %s): field %d read as %s's %s", layer.name, layer.type,
                     number, fork, target)


def _has_unknown(msg) -> bool:
    from google.protobuf.unknown_fields import UnknownFieldSet

    if msg.DESCRIPTOR.name == "BNParameter":
        return any(f.field_number != _SEGNET_BN_MODE for f in UnknownFieldSet(msg))
    return len(UnknownFieldSet(msg)) > 0


def check_fork_collisions(net, source: str = "<net>") -> None:
    """A layer of another type whose field at a colliding number does not decode as brewnet's
    field: the file needs a fork's reading brewnet does not apply to that type. One clear
    error naming the layer, the field and the forks."""
    for layer in net.layer:
        for types, number, here, target, fork in FORK_NUMBERS:
            if here is None or layer.type in types or not layer.HasField(here):
                continue
            if _has_unknown(getattr(layer, here)):
                raise ProtoError(
                    f"{source}: layer '{layer.name}' (type {layer.type}): field {number} does "
                    f"not decode as {here}; {fork} store {target} there, which brewnet reads "
                    f"only for type {' or '.join(types)}")


# ----------------------------------------------------------------------------------- solver

def solver_needs_upgrade(solver) -> bool:
    return solver.HasField("solver_type")


def upgrade_solver(solver, source: str = "<solver>"):
    """A copy of ``solver`` with the ``solver_type`` enum replaced by the ``type`` string.

    Inline nets (net_param, train_net_param, test_net_param) are upgraded too.
    """
    out = pb.SolverParameter()
    out.CopyFrom(solver)
    if solver_needs_upgrade(out):
        if out.HasField("type"):
            raise ProtoError(f"{source}: solver_type (enum) and type (string) cannot both be "
                             "given")
        log.info("Attempting to upgrade deprecated 'solver_type' enum in %s", source)
        out.type = SOLVER_TYPE_NAMES[out.solver_type]
        out.ClearField("solver_type")
        log.info("Upgraded solver_type to type: \"%s\"", out.type)
    for field in ("net_param", "train_net_param"):
        if out.HasField(field) and needs_upgrade(getattr(out, field)):
            getattr(out, field).CopyFrom(upgrade_net(getattr(out, field), f"{source}:{field}"))
    for i, net in enumerate(out.test_net_param):
        if needs_upgrade(net):
            net.CopyFrom(upgrade_net(net, f"{source}:test_net_param[{i}]"))
    return out
