"""pycaffe's Net API, as `import brewnet as caffe` scripts use it; OpenCV's dnn importer is the
independent oracle for a saved .caffemodel."""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from helpers import MODELS, need, tol

LENET = MODELS / "trained/lenet_mnist_ethereon/examples/mnist"
PROTO, WEIGHTS = str(LENET / "lenet.prototxt"), str(LENET / "lenet_iter_10000.caffemodel")
CIFAR_H5 = MODELS / "trained/cifar10_hdf5_siegfriedgreg/examples/cifar10"


def images(n=4, seed=0):
    return np.random.default_rng(seed).random((n, 1, 28, 28), dtype=np.float32)


def test_argument_orders_agree():
    a = caffe.Net(PROTO, caffe.TEST, weights=str(need(WEIGHTS)))
    b = caffe.Net(PROTO, WEIGHTS, caffe.TEST)          # pycaffe's older order
    x = images(64)
    np.testing.assert_array_equal(a.forward(data=x)["prob"], b.forward(data=x)["prob"])


def test_blobs_params_layers_views():
    net = caffe.Net(PROTO, caffe.TEST, weights=str(need(WEIGHTS)))
    assert list(net.blobs)[:3] == ["data", "conv1", "pool1"]
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    assert [l.type for l in net.layers][:3] == ["Input", "Convolution", "Pooling"]
    conv = net.layer_dict["conv1"]
    assert conv.blobs[0].data.shape == (20, 1, 5, 5)
    np.testing.assert_array_equal(conv.blobs[0].data, net.params["conv1"][0].data)
    assert net.top_names["conv1"] == ["conv1"] and net.bottom_names["conv1"] == ["data"]
    b = net.blobs["data"]
    assert (b.num, b.channels, b.height, b.width) == (64, 1, 28, 28) and b.count == 64 * 784
    # Writing through the numpy view changes the weights.
    before = net.forward(data=images(64))["prob"].copy()
    net.params["ip2"][1].data[...] += 100 * np.eye(10, dtype=np.float32)[3]
    after = net.forward(data=images(64))["prob"]
    assert (after.argmax(1) == 3).all() and not (before.argmax(1) == 3).all()


def test_reshape_and_forward_range():
    net = caffe.Net(PROTO, caffe.TEST, weights=str(need(WEIGHTS)))
    net.blobs["data"].reshape(3, 1, 28, 28)
    net.reshape()
    assert net.blobs["ip2"].data.shape == (3, 10)
    net.blobs["data"].data[...] = images(3)
    full = net.forward()["prob"].copy()
    mid = net.forward(end="pool2")
    assert list(mid) == ["pool2"] and mid["pool2"].shape == (3, 50, 4, 4)
    np.testing.assert_allclose(net.forward(start="ip1")["prob"], full, **tol("elementwise", 1e-6, 0))


def test_backward_returns_input_diffs():
    text = "force_backward: true\n" + open(PROTO).read()
    net = caffe.Net(text, caffe.TEST, weights=str(need(WEIGHTS)))
    net.forward(data=images(64))
    diffs = net.backward(prob=np.eye(10, dtype=np.float32)[np.zeros(64, int)])
    assert diffs["data"].shape == (64, 1, 28, 28) and np.abs(diffs["data"]).sum() > 0


def test_save_then_copy_from_round_trip(tmp_path):
    net = caffe.Net(PROTO, caffe.TEST, weights=str(need(WEIGHTS)))
    out = tmp_path / "copy.caffemodel"
    net.save(str(out))
    other = caffe.Net(PROTO, caffe.TEST)
    other.copy_from(str(out))
    for name in net.params:
        for a, b in zip(net.params[name], other.params[name]):
            np.testing.assert_array_equal(a.data, b.data)


def test_saved_caffemodel_reads_in_opencv(tmp_path):
    cv2 = pytest.importorskip("cv2")
    caffe.set_random_seed(3)
    proto = str(MODELS / "bvlc/examples/cifar10/cifar10_quick.prototxt")
    net = caffe.Net(proto, caffe.TEST)      # random (gaussian-filled) weights
    out = tmp_path / "quick.caffemodel"
    net.save(str(out))
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    ours = net.forward(data=x)["prob"]
    cv = cv2.dnn.readNetFromCaffe(proto, str(out))
    cv.setInput(x)
    np.testing.assert_allclose(cv.forward(), ours, **tol("blas", 1e-4, 1e-6))     # OpenCV: the CPU


def test_hdf5_weights(tmp_path):
    from brewnet.weights import save_weights_h5

    net = caffe.Net(str(CIFAR_H5 / "cifar10_quick.prototxt"), caffe.TEST,
                    weights=str(need(CIFAR_H5 / "cifar10_quick_iter_5000.caffemodel.h5")))
    assert np.abs(net.params["conv1"][0].data).sum() > 0
    out = tmp_path / "w.caffemodel.h5"
    save_weights_h5(net, str(out))
    other = caffe.Net(str(CIFAR_H5 / "cifar10_quick.prototxt"), caffe.TEST, weights=str(out))
    np.testing.assert_array_equal(other.params["ip2"][0].data, net.params["ip2"][0].data)


def test_mode_switches_and_layer_list():
    caffe.set_mode_gpu()          # falls back to the CPU where CUDA is missing
    caffe.set_device(0)
    net = caffe.Net(PROTO, caffe.TEST)
    caffe.set_mode_cpu()
    assert net.forward(data=images(64))["prob"].shape == (64, 10)
    assert {"Convolution", "Pooling", "LSTM", "PriorBox"} <= set(caffe.layer_type_list())


def test_set_input_arrays_feeds_memory_data():
    net = caffe.Net("""
      layer { name: "mem" type: "MemoryData" top: "data" top: "label"
              memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 } }
      layer { name: "s" type: "Reduction" bottom: "data" top: "s" reduction_param { axis: 1 } }""", caffe.TEST)
    x = np.arange(16, dtype=np.float32).reshape(4, 1, 2, 2)
    net.set_input_arrays(x, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(net.forward()["s"], x[:2].reshape(2, -1).sum(1))
    np.testing.assert_array_equal(net.forward()["s"], x[2:].reshape(2, -1).sum(1))
    np.testing.assert_array_equal(net.blobs["label"].data, [2, 3])
    with pytest.raises(ValueError, match="MemoryData"):
        caffe.Net(PROTO, caffe.TEST).set_input_arrays(x, np.zeros(4, np.float32))
