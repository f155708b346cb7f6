"""Bad input gets a clear error that names what is wrong, and loses nothing."""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from brewnet import Net
from helpers import MODELS, need

LENET = MODELS / "trained/lenet_mnist_ethereon/examples/mnist"


def test_malformed_prototxt_names_file_line_and_field(tmp_path):
    p = tmp_path / "bad.prototxt"
    p.write_text('name: "x"\nlayer {\n  name: "a"\n  type: "Input"\n  bogus_field: 3\n}\n')
    with pytest.raises(ValueError) as e:
        Net(str(p), caffe.TEST)
    msg = str(e.value)
    assert "bad.prototxt" in msg and ":5" in msg and "bogus_field" in msg


def test_unknown_layer_type_names_layer_and_the_ways_forward():
    with pytest.raises(ValueError) as e:
        Net('layer { name: "mystery" type: "Frobnicate" top: "x" }', caffe.TEST)
    msg = str(e.value)
    assert "mystery" in msg and "Frobnicate" in msg and "register_layer" in msg
    assert "Python layer" in msg and "layer_type_list()" in msg


def test_bottom_that_no_layer_produces():
    text = """layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
              layer { name: "ip" type: "InnerProduct" bottom: "dta" top: "ip"
                      inner_product_param { num_output: 2 } }"""
    with pytest.raises(ValueError, match=r"Layer 'ip'.*unknown bottom blob 'dta'"):
        Net(text, caffe.TEST)


def test_layer_shape_error_names_layer_and_shapes():
    text = """layer { name: "in" type: "Input" top: "a" top: "b"
                      input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 4 } } }
              layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }"""
    with pytest.raises(ValueError) as e:
        Net(text, caffe.TEST)
    msg = str(e.value)
    assert "sum" in msg and "(2, 3)" in msg.replace("[", "(").replace("]", ")") or "2, 3" in msg


def test_caffemodel_shape_mismatch_names_layer_and_both_shapes(tmp_path):
    text = (LENET / "lenet.prototxt").read_text().replace("num_output: 500", "num_output: 400")
    p = tmp_path / "lenet400.prototxt"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        Net(str(p), caffe.TEST, weights=str(need(LENET / "lenet_iter_10000.caffemodel")))
    msg = str(e.value)
    assert "ip1" in msg and "(500, 800)" in msg and "(400, 800)" in msg


def test_truncated_caffemodel(tmp_path):
    data = need(LENET / "lenet_iter_10000.caffemodel").read_bytes()
    p = tmp_path / "cut.caffemodel"
    p.write_bytes(data[: len(data) // 2])
    net = Net(str(LENET / "lenet.prototxt"), caffe.TEST)
    before = net.params["conv1"][0].data.copy()
    with pytest.raises(ValueError) as e:
        net.copy_from(str(p))
    assert "cut.caffemodel" in str(e.value) and ("truncated" in str(e.value) or "corrupt" in str(e.value))
    np.testing.assert_array_equal(net.params["conv1"][0].data, before)   # nothing half-loaded


def test_missing_weights_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.caffemodel"):
        Net(str(LENET / "lenet.prototxt"), caffe.TEST, weights=str(tmp_path / "nope.caffemodel"))


def test_wrong_inputs_to_forward():
    net = Net(str(LENET / "lenet.prototxt"), caffe.TEST)
    with pytest.raises(ValueError, match=r"do not match the net's inputs \['data'\]"):
        net.forward(data=np.zeros((1, 1, 28, 28), np.float32), extra=np.zeros(1))
    with pytest.raises(ValueError, match="do not match"):
        net.forward(image=np.zeros((1, 1, 28, 28), np.float32))
