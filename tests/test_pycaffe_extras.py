"""pycaffe beyond the Net basics, after pycaffe's own tests: Python layers, NetSpec, share_with,
forward_all, HDF5 weights."""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from brewnet import layers as L
from brewnet import params as P
from helpers import tol


class SimpleLayer(caffe.Layer):
    """Multiplies by 10 (or by param_str), forward and backward."""

    def setup(self, bottom, top):
        self.k = float(self.param_str) if self.param_str else 10.0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = self.k * top[0].diff


class ExceptionLayer(caffe.Layer):
    def setup(self, bottom, top):
        raise RuntimeError("setup failed on purpose")


class ParameterLayer(caffe.Layer):
    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs[0].data[0] = 0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[0] = 1


class PhaseLayer(caffe.Layer):
    def reshape(self, bottom, top):
        top[0].reshape()

    def forward(self, bottom, top):
        top[0].data[()] = self.phase


def python_net(layer: str, n: int = 1, param_str: str = "", extra: str = "") -> str:
    body = ('force_backward: true\n'
            'layer { name: "in" type: "Input" top: "data" '
            'input_param { shape { dim: 10 dim: 9 dim: 8 } } }\n')
    bottom = "data"
    for i in range(n):
        body += (f'layer {{ type: "Python" name: "l{i}" bottom: "{bottom}" top: "t{i}" {extra} '
                 f'python_param {{ module: "{__name__}" layer: "{layer}" param_str: "{param_str}" }} }}\n')
        bottom = f"t{i}"
    return body


def test_python_layers_chain_forward_backward():
    net = caffe.Net(python_net("SimpleLayer", 3), caffe.TRAIN)
    x = 8
    net.blobs["data"].data[...] = x
    net.forward()
    assert (net.blobs["t2"].data == 1000 * x).all()
    net.blobs["t2"].diff[...] = 7
    net.backward()
    assert (net.blobs["data"].diff == 1000 * 7).all()
    net.blobs["data"].reshape(4, 4, 4, 4)
    net.forward()
    assert all(b.data.shape == (4, 4, 4, 4) for b in net.blobs.values())


def test_python_layer_param_str():
    net = caffe.Net(python_net("SimpleLayer", 2, param_str="2"), caffe.TRAIN)
    net.blobs["data"].data[...] = 3
    net.forward()
    assert (net.blobs["t1"].data == 12).all()


def test_python_layer_exception_propagates():
    with pytest.raises(RuntimeError, match="on purpose"):
        caffe.Net(python_net("ExceptionLayer"), caffe.TEST)


def test_python_layer_parameters_train_save_load(tmp_path):
    net = caffe.Net(python_net("ParameterLayer", extra='loss_weight: 1'), caffe.TRAIN)
    net.blobs["data"].data[...] = 1
    net.forward()
    net.backward()
    assert net.params["l0"][0].diff[0] == 1
    net.params["l0"][0].data[0] = 5
    path = tmp_path / "p.caffemodel"
    net.save(str(path))
    other = caffe.Net(python_net("ParameterLayer"), caffe.TRAIN, weights=str(path))
    assert other.params["l0"][0].data[0] == 5


def test_python_layer_phase():
    text = ('layer { name: "p" type: "Python" top: "phase" '
            'python_param { module: "%s" layer: "PhaseLayer" } }' % __name__)
    assert caffe.Net(text, caffe.TRAIN).forward()["phase"] == caffe.TRAIN
    assert caffe.Net(text, caffe.TEST).forward()["phase"] == caffe.TEST


def lenet_spec(anonymous: bool = False):
    n = caffe.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[50, 1, 28, 28]), dict(dim=[50, 1, 1, 1])],
                                  transform_param=dict(scale=1.0 / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    ip2 = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    if anonymous:
        return caffe.to_proto(L.SoftmaxWithLoss(ip2, n.label))
    n.ip2 = ip2
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    return n.to_proto()


def test_net_spec_lenet():
    for anonymous in (False, True):
        proto = lenet_spec(anonymous)
        assert proto.layer[6].bottom == proto.layer[6].top          # the in-place ReLU
        assert proto.layer[1].convolution_param.weight_filler.type == "xavier"
        assert proto.layer[0].transform_param.scale == pytest.approx(1 / 255)
        net = caffe.Net(str(proto), caffe.TRAIN)
        assert len(net.layers) == 9
        assert np.isfinite(net.forward()["loss" if not anonymous else net.outputs[0]])
    assert [l.name for l in lenet_spec(True).layer][-2:] == ["InnerProduct2", "SoftmaxWithLoss1"]


def test_net_spec_silence_and_type_errors():
    n = caffe.NetSpec()
    n.data = L.DummyData(shape=dict(dim=[2, 3]))
    n.silence = L.Silence(n.data, ntop=0)
    assert caffe.Net(str(n.to_proto()), caffe.TEST).forward() == {}
    with pytest.raises(TypeError, match=r"Silence input 0 is not a Top \(type is <class 'tuple'>\)"):
        L.Silence((1, 2), ntop=0)


def test_share_with_and_hdf5(tmp_path):
    proto = str(lenet_spec())
    caffe.set_random_seed(1)
    a = caffe.Net(proto, caffe.TEST)
    caffe.set_random_seed(2)
    b = caffe.Net(proto, caffe.TEST)
    assert not np.array_equal(a.params["conv1"][0].data, b.params["conv1"][0].data)
    b.share_with(a)
    assert b.layer_by_name["conv1"].blobs[0] is a.layer_by_name["conv1"].blobs[0]
    a.save_hdf5(str(tmp_path / "w.h5"))
    c = caffe.Net(proto, caffe.TEST)
    c.load_hdf5(str(tmp_path / "w.h5"))
    np.testing.assert_array_equal(c.params["ip2"][0].data, a.params["ip2"][0].data)


def test_forward_all_pads_and_strips():
    net = caffe.Net(python_net("SimpleLayer").replace("force_backward: true", ""), caffe.TEST)
    x = np.random.default_rng(1).random((23, 9, 8), dtype=np.float32)
    out = net.forward_all(data=x)
    assert out["t0"].shape == (23, 9, 8)
    np.testing.assert_allclose(out["t0"], 10 * x, **tol("elementwise", 1e-6, 0))


def test_classifier_centre_crop_matches_caffe_predictions():
    import json

    from helpers import GOLDEN, MODELS, need

    z = np.load(need(GOLDEN / "models" / "lenet_mnist.npz"), allow_pickle=False)
    m = json.loads(str(z["meta"]))["models"]["lenet_ethereon"]
    clf = caffe.Classifier(str(MODELS / m["prototxt"]), str(need(MODELS / m["caffemodel"])), image_dims=(28, 28))
    images = [im.transpose(1, 2, 0) for im in z["input"][:20]]          # H x W x 1
    scores = clf.predict(images, oversample=False)
    assert scores.shape == (20, 10)
    np.testing.assert_array_equal(scores.argmax(1), z["lenet_ethereon/pred_10000"][:20])
    np.testing.assert_allclose(scores, z["lenet_ethereon/prob"][:20], **tol("blas", 1e-7, 1e-5))
    assert clf.predict(images[:3]).shape == (3, 10)                     # 10 crops averaged


def test_python_layer_missing_module_names_the_layer():
    text = python_net("SimpleLayer").replace(f'module: "{__name__}"', 'module: "no_such_module_xyz"')
    with pytest.raises(ValueError, match=r"Layer 'l0'.*no_such_module_xyz\.SimpleLayer"):
        caffe.Net(text, caffe.TEST)
