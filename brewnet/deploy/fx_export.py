"""``to_torch``: a Caffe net as one torch.fx graph of plain torch ops.

The net's layers are traced once with ``torch.export`` (non-strict: each layer's Python runs on
fake tensors, so shape arithmetic and Caffe's pooling rules become constants of the graph); the
exported graph is then re-rooted on a plain module whose submodules are named after the layers
(``conv1.weight``, ``bn1.running_mean``). The result is a ``torch.fx.GraphModule``: no layer
objects, no per-layer dispatch; ``state_dict``, ``.to``, ``.half``, ``torch.export`` and
``torch.compile`` work on it as on any module. Spatial sizes are those of the prototxt (Caffe's
deploy nets are built for one input size); the batch axis stays dynamic where the net allows.
"""
from __future__ import annotations

import copy
import logging
import re

import torch

from ..errors import NetError
from ..execution.fast_path import Declined
from ..execution.folding import Folder
from ..layers import functional as Fn
from ..layers.base import traced
from ..net import Net
from ..proto import caffe_pb2 as pb

log = logging.getLogger("brewnet")
__all__ = ["to_torch", "traced_program"]

# Caffe's blob order -> torch's names; other layers' blobs are called blob0, blob1...
PARAM_NAMES = {"Convolution": ("weight", "bias"), "Deconvolution": ("weight", "bias"),
               "InnerProduct": ("weight", "bias"), "Scale": ("weight", "bias"),
               "Bias": ("bias",), "PReLU": ("weight",), "Embed": ("weight", "bias"),
               "BatchNorm": ("running_mean", "running_var", "scale_factor")}
BUFFER_TYPES = {"BatchNorm"}      # statistics, not learnable: buffers, as torch's BatchNorm
# Layers whose work is not a function of their bottoms: no graph can hold them.
NO_GRAPH = {"Python": "runs arbitrary Python (pycaffe's caffe.Layer)",
            "DetectionOutput": "runs non-maximum suppression in Python, with data-dependent sizes",
            "YoloDetectionOutput": "runs non-maximum suppression in Python, with data-dependent sizes",
            "Yolov3DetectionOutput": "runs non-maximum suppression in Python, with data-dependent sizes",
            "Proposal": "runs non-maximum suppression in Python, with data-dependent sizes",
            "ROIPooling": "reads its regions' coordinates into Python",
            "PSROIPooling": "reads its regions' coordinates into Python",
            "DetectionEvaluate": "scores detections in Python",
            "CTCGreedyDecoder": "merges repeats and drops blanks in Python: its output's length is data",
            "HDF5Output": "writes files"}


def _attr(name: str, taken: set) -> str:
    base = re.sub(r"\W", "_", name) or "layer"
    base = "_" + base if base[0].isdigit() else base
    out, k = base, 1
    while out in taken:
        k, out = k + 1, f"{base}_{k}"
    taken.add(out)
    return out


class _Tracee(torch.nn.Module):
    """What gets traced: the layers in prototxt order, reading their blobs from this module's
    parameters (export swaps those for fake tensors while tracing)."""

    def __init__(self, net: Net, fold: bool, cut=None):
        super().__init__()
        self.net, self.steps = net, []
        # ``cut`` (execution/cut.py): only its trunk, returning the blobs the rest reads
        self.outputs = list(cut.outputs if cut is not None else net.outputs)
        keep = set(cut.trunk) if cut is not None else None
        self.layer_names: dict[str, str] = {}      # module attribute -> Caffe layer name
        folder = Folder(net) if fold else None
        chains = folder.chains if folder else {}
        taken, shared = set(), {}
        skip_until = -1
        for i, layer in enumerate(net.layer_list):
            if i <= skip_until or layer.type == "Input" or (keep is not None and i not in keep):
                continue
            if layer.type in NO_GRAPH:
                raise Declined(f"Layer '{layer.name}' (type {layer.type}) cannot be part of a "
                               f"graph: it {NO_GRAPH[layer.type]}")
            if not net.bottom_lists[i] and net.top_lists[i]:
                raise Declined(f"Layer '{layer.name}' (type {layer.type}) makes its own data; "
                               "export a deploy net whose inputs are Input layers")
            blobs = [b.detach() for b in layer.blobs]
            end = chains.get(i, i)
            if end != i:                       # Conv -> BatchNorm -> Scale as one convolution
                try:
                    blobs = list(folder.weights(i))
                except Exception as e:
                    raise NetError(f"Layer '{layer.name}' (type {layer.type}): its BatchNorm/Scale "
                                   f"cannot be folded into it: {type(e).__name__}: {e}") from e
                skip_until = end
            attr = _attr(layer.name, taken) if blobs else None
            pnames = []
            if attr:
                self.layer_names[attr] = layer.name
                sub = torch.nn.Module()
                names = PARAM_NAMES.get("Convolution" if end != i else layer.type, ())
                for j, b in enumerate(blobs):
                    pname = names[j] if j < len(names) else f"blob{j}"
                    pnames.append(pname)
                    # A folded chain's (weight, bias) are its own tensors, a bias included where
                    # the convolution has none: never one of the layer's blobs, never shared.
                    source = id(layer.blobs[j]) if end == i else None
                    if source in shared:                       # Caffe's shared params
                        setattr(sub, pname, shared[source])
                    elif layer.type in BUFFER_TYPES and end == i:
                        sub.register_buffer(pname, b.clone())
                    else:
                        p = torch.nn.Parameter(b.clone(), requires_grad=b.is_floating_point())
                        setattr(sub, pname, p)
                        if source is not None:
                            shared[source] = p
                self.add_module(attr, sub)
            self.steps.append((i, end, attr, pnames))
        if not net.inputs:
            raise Declined(f"Net '{net.name}' has no Input layer: to_torch needs a deploy net")

    def forward(self, *inputs):
        with traced():
            return self._forward(inputs)

    def _forward(self, inputs):
        net = self.net
        cur = dict(zip(net.inputs, inputs))
        for i, end, attr, pnames in self.steps:
            layer = net.layer_list[i]
            bottoms = [cur[b] for b in net.bottom_lists[i]]
            blobs = [getattr(getattr(self, attr), n) for n in pnames]
            try:
                if end != i:
                    tops = [Fn.conv_nd(bottoms[0], blobs[0], blobs[1], layer.stride, layer.pad,
                                       layer.dilation, layer.group)]
                else:
                    saved, layer.blobs = layer.blobs, blobs
                    try:
                        tops = layer.forward(bottoms)
                    finally:
                        layer.blobs = saved
            except NetError:
                raise
            except Exception as e:
                raise NetError(f"Layer '{layer.name}' (type {layer.type}) cannot be traced into "
                               f"a graph: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
            for name, t in zip(net.top_lists[i], tops):
                cur[name] = t
        return tuple(cur[o] for o in self.outputs)


def _example_inputs(net: Net, channels_last: bool = False) -> list[torch.Tensor]:
    from ..blob import nhwc

    out = []
    for name in net.inputs:
        s = tuple(net.shapes[name])
        if not s or 0 in s:
            raise NetError(f"Input '{name}' has no shape ({s}); give the Input layer its shape")
        # A batch of 1 would be specialised by export: trace at 2, any batch runs afterwards.
        x = torch.randn((max(s[0], 2),) + s[1:])
        out.append(nhwc(x) if channels_last and x.dim() == 4 else x)
    return out


def traced_program(net: Net, fold: bool = False, dynamic_batch: bool = True,
                   channels_last: bool = False, cut=None):
    """(ExportedProgram, tracee, whether the batch is dynamic) of ``net``'s TEST forward;
    ``channels_last``: traced on NHWC inputs, as the CPU path runs (layers that branch on the
    layout take the branch that path takes); ``cut``: its trunk only (execution/cut.py)."""
    from ..blob import nhwc

    tracee = _Tracee(net, fold, cut)
    xs = _example_inputs(net, channels_last)
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1)
        dyn = (tuple({0: batch} for _ in xs),)      # forward(*inputs): one varargs entry
        try:
            return torch.export.export(tracee, tuple(xs), dynamic_shapes=dyn, strict=False), tracee, True
        except NetError:
            raise
        except Exception as e:   # a layer fixes the batch (Reshape with explicit dims...)
            log.warning("Net '%s': the batch size stays %d (not dynamic): %s", net.name,
                        net.shapes[net.inputs[0]][0], str(e).splitlines()[0][:200])
    xs = [torch.randn(net.shapes[n]) for n in net.inputs]
    xs = [nhwc(x) if channels_last and x.dim() == 4 else x for x in xs]
    return torch.export.export(tracee, tuple(xs), strict=False), tracee, False


def _graph_module(ep, tracee: _Tracee) -> torch.fx.GraphModule:
    """The exported graph on a plain root: parameter and buffer placeholders become attribute
    reads of the root (named as the layers), constants become non-persistent buffers (so
    ``.to``/``.half`` move them), user inputs keep the net's input names."""
    name = re.sub(r"\W", "_", tracee.net.name or "CaffeNet")
    gm = torch.fx.GraphModule(torch.nn.Module(), copy.deepcopy(ep.graph_module.graph), class_name=name)
    for attr in tracee.layer_names:     # before the graph reads them
        gm.add_module(attr, getattr(tracee, attr))
    g, sig = gm.graph, ep.graph_signature
    kinds = torch.export.graph_signature.InputKind
    inputs, taken = iter(tracee.net.inputs), set()
    for node, spec in zip([n for n in g.nodes if n.op == "placeholder"], sig.input_specs):
        if spec.kind == kinds.USER_INPUT:
            node.name = node.target = _attr(next(inputs), taken)
            continue
        if spec.kind in (kinds.PARAMETER, kinds.BUFFER):
            target = spec.target
        else:    # a tensor the trace made (a divisor map, a constant): keep it as a buffer
            target = _attr(f"const_{spec.target}", taken)
            gm.register_buffer(target, ep.constants[spec.target].detach().clone(), persistent=False)
        with g.inserting_before(node):
            get = g.get_attr(target)
        node.replace_all_uses_with(get)
        g.erase_node(node)
    out = next(n for n in g.nodes if n.op == "output")
    vals = out.args[0]
    out.args = (vals[0] if len(vals) == 1 else tuple(vals),)
    g.eliminate_dead_code()
    gm.recompile()
    gm.input_names, gm.output_names = list(tracee.net.inputs), list(tracee.outputs)
    gm.input_shapes = [tuple(tracee.net.shapes[n]) for n in tracee.net.inputs]
    gm.layer_names, gm.net_name = dict(tracee.layer_names), tracee.net.name
    return gm


def to_torch(prototxt, weights=None, phase=pb.TEST, fold: bool = False,
             dynamic_batch: bool = True, cut=None) -> torch.fx.GraphModule:
    """A Caffe net as a ``torch.fx.GraphModule`` of plain torch ops (see the module docstring).

    ``prototxt``: a path, prototxt text, a NetParameter or a core ``brewnet.net.Net`` (its
    current weights are copied). ``weights``: a ``.caffemodel``/``.h5`` (None: the fillers').
    ``fold``: Convolution -> BatchNorm -> Scale chains become one convolution. Takes the net's
    inputs positionally (``gm.input_names``); returns the one output, or a tuple in
    ``gm.output_names`` order (Caffe's: sorted by name). ``cut`` (brewnet/execution/cut.py):
    the trunk of a net cut before its layers with no graph form, returning ``cut.outputs``.
    """
    net = prototxt if isinstance(prototxt, Net) else Net(prototxt, phase, weights=weights)
    if isinstance(prototxt, Net) and weights:
        net.copy_from(weights)
    if net.device.type != "cpu":
        raise NetError(f"to_torch traces on the CPU; build Net '{net.name}' there and move the "
                       "module with .to(device)")
    with torch.no_grad():
        ep, tracee, dynamic = traced_program(net, fold, dynamic_batch, cut=cut)
    gm = _graph_module(ep, tracee)
    gm.dynamic_batch = dynamic
    return gm
