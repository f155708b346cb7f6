"""brewnet.fully_convolutional (Caffe's net_surgery): the converted net gives the original's
numbers at the original size, slides the classifier on a larger input, and saves as a
prototxt + caffemodel pair that loads back."""
from __future__ import annotations

import pytest
import torch

import brewnet
from brewnet.net import Net, NetError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import write_text
from helpers import MODELS, SHARED, have, need

LENET = MODELS / "bvlc/examples/mnist/lenet.prototxt"
LENET_W = SHARED / "caffe-models/trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel"
CAFFENET = MODELS / "bvlc/models/bvlc_reference_caffenet/deploy.prototxt"


def run(net, x):
    net.blobs[net.inputs[0]].tensor = x.clone()
    with torch.no_grad():
        net.forward_tensors()
    return {n: b.tensor.clone() for n, b in net.blobs.items()}


def small(net, batch):
    name = net.inputs[0]
    net.blobs[name].reshape(batch, *net.shapes[name][1:])
    net.reshape()
    return net


def test_lenet_same_numbers_at_the_original_size():
    torch.manual_seed(0)
    net = Net(LENET, pb.TEST, weights=LENET_W if have(LENET_W) else None)
    x = torch.rand(net.shapes["data"])
    fc = brewnet.fully_convolutional(net)
    assert [l.type for l in fc.layer_list if l.name in ("ip1", "ip2")] == ["Convolution"] * 2
    assert tuple(fc.layer_by_name["ip1"].blobs[0].shape) == (500, 50, 4, 4)
    assert tuple(fc.layer_by_name["ip2"].blobs[0].shape) == (10, 500, 1, 1)
    a, b = run(net, x), run(fc, x)
    assert b["prob"].shape == (64, 10, 1, 1)
    for name in ("ip1", "ip2", "prob"):
        torch.testing.assert_close(b[name].reshape(a[name].shape), a[name], rtol=1e-5, atol=1e-5)


def test_caffenet_same_numbers_at_the_original_size():
    """Random weights (the deploy prototxt has no fillers: N(0, 1/fan_in)); 451 x 451 gives
    the 8 x 8 map of Caffe's net_surgery example."""
    torch.manual_seed(0)
    net = small(Net(CAFFENET, pb.TEST), 1)
    with torch.no_grad():
        for layer in net.layer_list:
            for p in layer.blobs:
                p.normal_(0, p[0].numel() ** -0.5 if p.dim() > 1 else 0.1)
    x = torch.rand(1, 3, 227, 227) * 255 - 120
    fc = brewnet.fully_convolutional(net)
    assert tuple(fc.layer_by_name["fc6"].blobs[0].shape) == (4096, 256, 6, 6)
    a, b = run(net, x), run(fc, x)
    for name in ("fc6", "fc7", "fc8"):
        # fc6 sums 9216 float32 products, in another order in a convolution than in a matrix
        # product: measured 3.4e-6 of the largest value at most; 1e-5 of it allowed.
        scale = a[name].abs().max()
        torch.testing.assert_close(b[name].reshape(a[name].shape) / scale, a[name] / scale,
                                   rtol=0, atol=1e-5)
    big = brewnet.fully_convolutional(net, (451, 451))
    assert big.shapes["fc8"] == (1, 1000, 8, 8) and big.shapes["prob"] == (1, 1000, 8, 8)


def test_lenet_slides_the_classifier_on_a_larger_input():
    """LeNet has no padding: position (i, j) of the 56 x 56 map is the original net on the
    28 x 28 crop at (4 i, 4 j), 4 being the stride of pool2."""
    torch.manual_seed(4)
    net = small(Net(LENET, pb.TEST, weights=LENET_W if have(LENET_W) else None), 1)
    big = brewnet.fully_convolutional(net, (56, 56))
    x = torch.rand(1, 1, 56, 56)
    m = run(big, x)["ip2"]
    assert m.shape == (1, 10, 8, 8)
    for i, j in ((0, 0), (3, 5), (7, 7)):
        want = run(net, x[:, :, 4 * i:4 * i + 28, 4 * j:4 * j + 28].contiguous())["ip2"][0]
        torch.testing.assert_close(m[0, :, i, j], want, rtol=1e-5, atol=1e-5)


def test_saved_prototxt_and_caffemodel_load_back(tmp_path):
    torch.manual_seed(1)
    fc = brewnet.fully_convolutional(Net(LENET, pb.TEST), (1, 1, 56, 56))
    write_text(tmp_path / "fc.prototxt", fc.param)
    fc.save(tmp_path / "fc.caffemodel")
    back = Net(tmp_path / "fc.prototxt", pb.TEST, weights=tmp_path / "fc.caffemodel")
    assert back.shapes["prob"] == (1, 10, 8, 8)
    x = torch.rand(1, 1, 56, 56)
    assert torch.equal(run(back, x)["prob"], run(fc, x)["prob"])


def test_pycaffe_net_stays_pycaffe_and_transposed_weights():
    text = ('name: "t" layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 '
            'dim: 3 dim: 4 dim: 5 } } }\n layer { name: "ip" type: "InnerProduct" bottom: "data" '
            'top: "ip" inner_product_param { num_output: 7 transpose: true weight_filler { type: '
            '"gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } } }')
    torch.manual_seed(2)
    net = brewnet.Net(text, brewnet.TEST)
    fc = brewnet.fully_convolutional(net)
    assert type(fc) is brewnet.Net
    x = torch.randn(2, 3, 4, 5)
    w, b = (t.double() for t in net.layer_list[1].blobs)           # w: (K, N) when transposed
    want = x.double().reshape(2, -1) @ w + b
    torch.testing.assert_close(run(fc, x)["ip"].double().reshape(2, 7), want, rtol=1e-5, atol=1e-5)


def test_inner_product_on_another_axis_is_refused():
    text = ('name: "t" layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 '
            'dim: 3 dim: 4 dim: 5 } } }\n layer { name: "ip" type: "InnerProduct" bottom: "data" '
            'top: "ip" inner_product_param { num_output: 7 axis: 2 } }')
    with pytest.raises(NetError, match=r"layer 'ip' \(InnerProduct, axis 2\)"):
        brewnet.fully_convolutional(Net(text, pb.TEST))
    with pytest.raises(NetError, match=r"no Input top named 'image'"):
        brewnet.fully_convolutional(Net(LENET, pb.TEST), {"image": (1, 1, 28, 28)})


def test_open_nsfw_score_map():
    """The trained open_nsfw ResNet-50 (shared): same probabilities at 224 x 224."""
    proto = need(SHARED / "caffe-models/trained/open_nsfw/deploy.prototxt")
    net = Net(proto, pb.TEST, weights=proto.parent / "resnet_50_1by2_nsfw.caffemodel")
    torch.manual_seed(3)
    x = torch.rand(1, 3, 224, 224) * 255 - 117
    fc = brewnet.fully_convolutional(net)
    torch.testing.assert_close(run(fc, x)["prob"].reshape(1, 2), run(net, x)["prob"], rtol=1e-5, atol=1e-6)
    assert brewnet.fully_convolutional(net, (256, 320)).shapes["prob"] == (1, 2, 2, 4)
