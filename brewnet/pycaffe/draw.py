"""pycaffe's ``caffe.draw``: a NetParameter as a Graphviz graph (``get_pydot_graph``,
``draw_net``, ``draw_net_to_file``), with pycaffe's look: layers as records coloured by type
(convolutions red, pooling orange, inner products purple, in-place neurons green), blobs as grey
octagons, edges labelled with the output count. Unlike pycaffe, nodes are keyed by layer and blob
name (not by their label), so in-place layers and duplicate labels draw as they are wired, and
``phase`` filters with Caffe's full NetState rules. Rendering needs Graphviz's ``dot`` program.
"""
from __future__ import annotations

import os

import pydot

from ..proto import caffe_pb2 as pb
from ..proto.filter import filter_net, make_state

LAYER_STYLE = {"shape": "record", "style": "filled", "fillcolor": "#6495ED"}
NEURON_STYLE = {"shape": "record", "style": "filled", "fillcolor": "#90EE90"}
BLOB_STYLE = {"shape": "octagon", "style": "filled", "fillcolor": "#E0E0E0"}
COLOURS = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
           "InnerProduct": "#CC33FF"}


class DrawError(RuntimeError):
    """The graph cannot be rendered (Graphviz missing, unknown format)."""


def _first(values, default):
    return values[0] if len(values) else default


def get_edge_label(layer) -> str:
    """The label of a layer's output edges: the batch size of a Data layer, the output count of
    a convolution or inner product, else empty."""
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return ""


def get_layer_lr_mult(layer) -> tuple[float, float]:
    """(weights, bias) lr_mult of a Convolution/Deconvolution/InnerProduct layer (1 when unset)."""
    if layer.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    mults = [p.lr_mult for p in layer.param][:2]
    return tuple(mults + [1.0] * (2 - len(mults)))


def get_layer_label(layer, rankdir: str, display_lrm: bool = False) -> str:
    """A layer node's label, quoted: name, type (and pooling method), kernel/stride/pad, and
    with ``display_lrm`` the lr multipliers; ``rankdir`` picks the separator."""
    sep = " " if rankdir in ("TB", "BT") else "\\n"    # vertical layouts have room across
    kind = layer.type
    if kind == "Pooling":
        kind += " " + pb.PoolingParameter.PoolMethod.Name(layer.pooling_param.pool)
    parts = [layer.name, f"({kind})"]
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        if layer.type == "Pooling":
            p = layer.pooling_param
            k, s, pad = p.kernel_size, p.stride, p.pad
        else:
            c = layer.convolution_param
            k, s, pad = _first(c.kernel_size, 1), _first(c.stride, 1), _first(c.pad, 0)
        parts.append(sep.join([f"kernel size: {k}", f"stride: {s}", f"pad: {pad}"]))
    if display_lrm and layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
        w, b = get_layer_lr_mult(layer)
        if w or b:
            parts.append(f"lr mult: {w:.1f}, {b:.1f}")
    return '"' + sep.join(parts) + '"'      # quoted: colons would not parse


def get_pydot_graph(caffe_net, rankdir: str = "LR", label_edges: bool = True, phase=None,
                    display_lrm: bool = False) -> "pydot.Dot":
    """The net (a NetParameter) as a pydot graph; ``phase`` keeps that phase's layers only."""
    if phase is not None:
        caffe_net = filter_net(caffe_net, make_state(phase, 0, (), caffe_net.state))
    graph = pydot.Dot(caffe_net.name or "Net", graph_type="digraph", rankdir=rankdir)
    current: dict[str, str] = {}          # blob name -> node of its latest value
    for i, layer in enumerate(caffe_net.layer):
        node = f"layer{i}"
        in_place = len(layer.bottom) == 1 and list(layer.bottom) == list(layer.top)
        style = NEURON_STYLE if in_place else dict(LAYER_STYLE, fillcolor=COLOURS.get(layer.type, "#6495ED"))
        graph.add_node(pydot.Node(node, label=get_layer_label(layer, rankdir, display_lrm), **style))
        for b in layer.bottom:
            if b not in current:
                current[b] = f"input_{b}"
                graph.add_node(pydot.Node(f'"{current[b]}"', label=f'"{b}"', **BLOB_STYLE))
            graph.add_edge(pydot.Edge(f'"{current[b]}"', node))
        for t in layer.top:
            if in_place:      # the blob keeps its node: the layer sits on a loop back to it
                graph.add_edge(pydot.Edge(node, f'"{current[t]}"'))
                continue
            current[t] = f"blob_{i}_{t}"
            graph.add_node(pydot.Node(f'"{current[t]}"', label=f'"{t}"', **BLOB_STYLE))
            label = get_edge_label(layer) if label_edges else ""
            graph.add_edge(pydot.Edge(node, f'"{current[t]}"', label=f'"{label}"'))
    return graph


def draw_net(caffe_net, rankdir: str = "LR", ext: str = "png", phase=None, display_lrm: bool = False) -> bytes:
    """The drawing encoded as ``ext`` (png, svg, pdf, dot...)."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    if ext in ("dot", "gv"):
        return graph.to_string().encode()
    try:
        return graph.create(format=ext)
    except FileNotFoundError:
        raise DrawError("Graphviz's 'dot' program is not installed (it renders the drawing): "
                        "apt-get install graphviz, brew install graphviz or conda install graphviz; "
                        "or write a .dot file, which needs no Graphviz") from None
    except AssertionError as e:               # pydot's check of the format name
        raise DrawError(f"cannot draw to '.{ext}': {e}") from None


def draw_net_to_file(caffe_net, filename, rankdir: str = "LR", phase=None, display_lrm: bool = False) -> None:
    """Draw to ``filename``; its extension picks the format."""
    ext = os.path.splitext(os.fspath(filename))[1][1:] or "png"
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as f:
        f.write(data)
