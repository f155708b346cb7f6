"""caffe.draw / brewnet draw: the graph pycaffe's draw_net gives (nodes, colours, edge labels,
in-place layers, phase filtering), the .dot output, and the message when Graphviz is missing."""
from __future__ import annotations

import shutil

import pydot
import pytest

import brewnet as caffe
from brewnet.cli import main
from brewnet.proto.io import read_net
from brewnet.pycaffe import draw
from helpers import pick

LENET = "bvlc/examples/mnist/lenet_train_test.prototxt"


def nodes(graph):
    return {n.get_name().strip('"'): n for n in graph.get_nodes() if n.get_name() not in ("node", "edge", "graph")}


def test_lenet_graph_as_pycaffe_draws_it():
    net = read_net(pick("caffe-models") / LENET)
    g = draw.get_pydot_graph(net, "LR", phase=caffe.TRAIN)
    ns = nodes(g)
    layers = {n.get("label").strip('"').split("\\n")[0]: n for k, n in ns.items() if k.startswith("layer")}
    assert set(layers) == {"mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"}
    colour = {k: n.get("fillcolor").strip('"') for k, n in layers.items()}
    assert (colour["conv1"], colour["pool1"], colour["ip1"], colour["relu1"]) == \
        ("#FF5050", "#FF9900", "#CC33FF", "#90EE90")
    assert "(Pooling MAX)\\nkernel size: 2\\nstride: 2\\npad: 0" in layers["pool1"].get("label")
    labels = {(e.get_source(), e.get_destination()): (e.get("label") or "").strip('"') for e in g.get_edges()}
    conv1 = [k for k, n in ns.items() if n is layers["conv1"]][0]
    assert any(src == conv1 and lab == "20" for (src, _), lab in labels.items())
    assert any(src == "layer0" and lab == "Batch 64" for (src, _), lab in labels.items())
    # relu1 works in place on ip1: one blob node, an edge in and an edge back.
    relu = [k for k, n in ns.items() if n is layers["relu1"]][0]
    ins = [s for s, d in labels if d == relu]
    outs = [d for s, d in labels if s == relu]
    assert ins == outs and len(ins) == 1
    test = draw.get_pydot_graph(net, "TB", phase=caffe.TEST)
    test_layers = [n.get("label") for k, n in nodes(test).items() if k.startswith("layer")]
    assert any(l.startswith('"accuracy (Accuracy)') for l in test_layers)     # TB: spaces
    assert len(nodes(draw.get_pydot_graph(net, "LR"))) > len(ns)             # no phase: all layers


def test_draw_writes_a_dot_file_that_parses(tmp_path):
    out = tmp_path / "lenet.dot"
    assert main(["draw", str(pick("caffe-models") / LENET), str(out), "--phase", "TRAIN", "--rankdir", "TB"]) == 0
    graph = pydot.graph_from_dot_data(out.read_text())[0]
    assert graph.get_rankdir() == "TB" and len(nodes(graph)) == 18


def test_missing_graphviz_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))          # no 'dot' here, installed or not
    assert main(["draw", str(pick("caffe-models") / LENET), str(tmp_path / "n.png")]) == 1
    err = capsys.readouterr().err
    assert "'dot' program is not installed" in err and "apt-get install graphviz" in err
    assert not (tmp_path / "n.png").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot program")
def test_renders_png(tmp_path):
    out = tmp_path / "n.png"
    draw.draw_net_to_file(read_net(pick("caffe-models") / LENET), out, phase=caffe.TEST)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
