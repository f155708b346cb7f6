"""An ONNX model as a ``Graph``: each ONNX op translated into the canonical (ATen-named) op the
Caffe writer maps, initializers and Constant nodes as constants. Shapes and the reference
values of the proof come from one onnxruntime run with every intermediate exposed."""
from __future__ import annotations

import numpy as np

from .graph import ConversionError, Graph, Node

SEED = 0


def load(path, batch: int | None = None):
    """The ONNX model; with ``batch``, its inputs' (and outputs') first axis set to it and the
    stored intermediate shapes dropped, so shapes are inferred at that batch."""
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001  (a file that is not ONNX: one line)
        raise ConversionError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None
    if batch is None:
        return model
    if int(batch) < 1:
        raise ConversionError(f"batch {batch}: expected a positive number")
    inits = {i.name for i in model.graph.initializer}
    for v in list(model.graph.input) + list(model.graph.output):
        dims = v.type.tensor_type.shape.dim
        if v.name not in inits and len(dims):
            dims[0].Clear()
            dims[0].dim_value = int(batch)
    del model.graph.value_info[:]
    try:
        _run(model, {name: np.zeros(s, np.float32) for name, s in _static_inputs(model)}, [])
    except Exception as e:  # noqa: BLE001  (a graph with the batch built in)
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{path}: does not run at batch {batch} (the graph fixes another "
                              f"batch?): {msg}") from None
    return model


def _attrs(node) -> dict:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _static_inputs(model) -> list:
    inits = {i.name for i in model.graph.initializer}
    out = []
    for v in model.graph.input:
        if v.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in v.type.tensor_type.shape.dim]
        out.append((v.name, tuple(dims)))
    return out


def example_inputs(g: Graph) -> list:
    rng = np.random.default_rng(SEED)
    return [rng.standard_normal(g.shapes[v]).astype(np.float32) for v in g.inputs]


def _run(model, feeds: dict, names: list) -> dict:
    """Every value in ``names`` on ``feeds``, by onnxruntime (intermediates made outputs)."""
    import onnx
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(m)
    except Exception:  # noqa: BLE001
        inferred = m
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)}
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have and types.get(n):
            m.graph.output.append(onnx.helper.make_tensor_value_info(n, types[n], None))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    return dict(zip(outs, sess.run(outs, feeds)))


def reference(model, g: Graph, xs: list, every: bool = True) -> dict:
    names = [o for n in g.nodes for o in n.outs] if every else list(g.outputs)
    return {k: np.asarray(v, np.float32) for k, v in
            _run(model, dict(zip(g.inputs, xs)), names).items() if np.asarray(v).dtype.kind == "f"}


def to_graph(model) -> Graph:
    from onnx import numpy_helper

    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    inputs = _static_inputs(model)
    shapes = {name: s for name, s in inputs}
    for n in model.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(_raw_attr(n, "value"))
    rng = np.random.default_rng(SEED)
    feeds = {name: rng.standard_normal(s).astype(np.float32) for name, s in inputs}
    values = _run(model, feeds, [o for n in model.graph.node for o in n.output])
    for k, v in values.items():
        shapes[k] = tuple(np.asarray(v).shape)
    for k, v in consts.items():
        shapes[k] = tuple(v.shape)
    nodes = []
    for n in model.graph.node:
        if n.op_type == "Constant":
            continue
        if n.op_type in _SHAPE_OPS and all(o in values for o in n.output):
            for o in n.output:                      # shape arithmetic: its (static) result
                consts[o] = np.asarray(values[o])
            continue
        if all(i in consts or i == "" for i in n.input) and all(o in values for o in n.output):
            for o in n.output:                      # folded: every input is a constant
                consts[o] = np.asarray(values[o])
            continue
        op, attrs = _translate(n, consts, shapes)
        ins = [i for i in n.input if i and i in shapes]
        nodes.append(Node(op=op, ins=ins, attrs=attrs, outs=list(n.output), path=n.name.strip("/"),
                          source=f"ONNX node '{n.name}' ({n.op_type})", target=n.op_type))
    return Graph(inputs=[name for name, _ in inputs], outputs=[o.name for o in model.graph.output],
                 nodes=nodes, shapes=shapes, consts=consts)


_SHAPE_OPS = {"Shape", "Gather", "Cast", "ConstantOfShape", "Range", "Size"}


def _raw_attr(node, name):
    return next(a.t for a in node.attribute if a.name == name)


def _c(consts, name, default=None):
    if not name or name not in consts:
        return default
    return consts[name]


def _translate(n, consts, shapes) -> tuple[str, dict]:
    t, a, i = n.op_type, _attrs(n), list(n.input) + [""] * 6
    x = {"self": i[0], "input": i[0]}
    if t in ("Conv", "ConvTranspose"):
        k = tuple(a.get("kernel_shape") or consts[i[1]].shape[2:])
        pads = a.get("pads") or [0] * 4
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            pads = "same"
        return ("conv_transpose2d" if t == "ConvTranspose" else "conv2d",
                {"input": i[0], "weight": i[1], "bias": i[2] or None, "stride": a.get("strides", [1, 1]),
                 "padding": pads, "dilation": a.get("dilations", [1, 1]), "groups": a.get("group", 1),
                 "output_padding": a.get("output_padding", [0, 0]), "kernel": k})
    if t == "Gemm":
        w = consts.get(i[1])
        if w is None or a.get("transA", 0) or a.get("alpha", 1.0) != 1 or a.get("beta", 1.0) != 1:
            return "gemm", x
        wname = i[1] + "#T" if not a.get("transB", 0) else i[1]
        consts[wname] = w if a.get("transB", 0) else w.T.copy()
        shapes[wname] = consts[wname].shape
        return "linear", {"input": i[0], "weight": wname, "bias": i[2] or None}
    if t == "MatMul":
        return "matmul", {"self": i[0], "other": i[1]}
    if t == "BatchNormalization":
        return "batch_norm", {"input": i[0], "weight": i[1], "bias": i[2], "running_mean": i[3],
                              "running_var": i[4], "eps": a.get("epsilon", 1e-5)}
    simple = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hardswish",
              "Identity": "identity", "Dropout": "identity", "Softplus": "softplus", "Erf": "erf",
              "Gelu": "gelu"}
    if t in simple:
        return simple[t], x
    if t == "LeakyRelu":
        return "leaky_relu", {**x, "negative_slope": a.get("alpha", 0.01)}
    if t == "Elu":
        return "elu", {**x, "alpha": a.get("alpha", 1.0)}
    if t == "PRelu":
        return "prelu", {**x, "weight": i[1]}
    if t == "HardSigmoid":
        if abs(a.get("alpha", 0.2) - 1 / 6) > 1e-6 or a.get("beta", 0.5) != 0.5:
            return "hardsigmoid(alpha != 1/6)", x
        return "hardsigmoid", x
    if t == "Clip":
        lo, hi = _c(consts, i[1]), _c(consts, i[2])
        return "clamp", {**x, "min": None if lo is None else float(lo), "max": None if hi is None else float(hi)}
    if t in ("MaxPool", "AveragePool"):
        return ("max_pool2d" if t == "MaxPool" else "avg_pool2d",
                {**x, "kernel_size": a["kernel_shape"], "stride": a.get("strides", a["kernel_shape"]),
                 "padding": a.get("pads", [0] * 4), "dilation": a.get("dilations", [1, 1]),
                 "ceil_mode": bool(a.get("ceil_mode", 0)),
                 "count_include_pad": bool(a.get("count_include_pad", 0))})
    if t in ("GlobalAveragePool", "GlobalMaxPool"):
        return ("adaptive_avg_pool2d" if t == "GlobalAveragePool" else "adaptive_max_pool2d"), x
    if t == "ReduceMean":
        axes = a.get("axes")
        if axes is None and i[1]:
            axes = [int(v) for v in consts.get(i[1], [])]
        return "mean", {**x, "dim": axes, "keepdim": bool(a.get("keepdims", 1))}
    if t in ("Add", "Sub", "Mul", "Div"):
        return t.lower(), {"self": i[0], "other": i[1]}
    if t == "Concat":
        return "cat", {"tensors": [v for v in n.input], "dim": a["axis"]}
    if t == "Flatten":
        return ("flatten", {**x, "start_dim": a.get("axis", 1), "end_dim": -1}) if a.get("axis", 1) == 1 \
            else ("reshape", x)
    if t in ("Reshape", "Squeeze", "Unsqueeze", "Expand"):
        return ("expand" if t == "Expand" else "reshape"), x
    if t == "Transpose":
        return "permute", {**x, "dims": list(a["perm"])}
    if t == "Split":
        return "split", {**x, "dim": a.get("axis", 0)}
    if t == "Slice":
        starts, ends = _c(consts, i[1]), _c(consts, i[2])
        axes, steps = _c(consts, i[3], [0]), _c(consts, i[4], [1])
        if starts is None or len(starts) != 1:
            return "Slice(several axes)", x
        return "slice", {**x, "dim": int(axes[0]), "start": int(starts[0]), "end": int(ends[0]),
                         "step": int(steps[0])}
    if t in ("Softmax", "LogSoftmax"):
        return ("softmax" if t == "Softmax" else "log_softmax"), {**x, "dim": a.get("axis", -1)}
    if t == "Resize":
        mode = a.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        ctm = a.get("coordinate_transformation_mode", b"half_pixel")
        ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
        nearest = a.get("nearest_mode", b"round_prefer_floor")
        nearest = nearest.decode() if isinstance(nearest, bytes) else nearest
        scales = _c(consts, i[2])        # given scales: positions map back by 1/scale (PyTorch's rule)
        sf = [float(v) for v in np.asarray(scales).reshape(-1)[-2:]] if scales is not None \
            and np.asarray(scales).size >= 2 else None
        if mode == "nearest" and ctm == "asymmetric" and nearest == "floor":
            return "upsample_nearest2d", {**x, "scale_factors": sf}
        if mode == "linear" and ctm in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            return "upsample_bilinear2d", {**x, "align_corners": ctm == "align_corners", "scale_factors": sf}
        return f"Resize({mode}, {ctm}, {nearest})" if mode == "nearest" else f"Resize({mode}, {ctm})", x
    if t == "Pad":
        mode = a.get("mode", b"constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        pads = [int(p) for p in _c(consts, i[1], a.get("pads", []))]
        r = len(pads) // 2
        torch_order = [v for d in reversed(range(r)) for v in (pads[d], pads[d + r])]
        while torch_order and len(torch_order) > 4 and torch_order[-1] == 0 and torch_order[-2] == 0:
            torch_order = torch_order[:-2]
        value = _c(consts, i[2])
        return "constant_pad_nd", {**x, "pad": torch_order, "mode": mode,
                                   "value": 0.0 if value is None else float(np.asarray(value).reshape(-1)[0])}
    return t, x
