"""Net semantics: state filtering, in-place blobs, fan-out, loss weights, sharing, ranges, reshape."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet import Net, NetError
from brewnet.passes import filter_net, make_state
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text

TINY = """
name: "tiny"
force_backward: true
layer { name: "in" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 5 dim: 5 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" LOSS_WEIGHT }
"""


def tiny(loss_weight=None, **kw) -> Net:
    text = TINY.replace("LOSS_WEIGHT", f"loss_weight: {loss_weight}" if loss_weight is not None else "")
    return Net(text, caffe.TRAIN, **kw)


def feed(net, seed=0):
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 3, 4)


def rule(text):
    return parse_text(text, pb.NetStateRule())


@pytest.mark.parametrize("state,text,met", [
    (dict(phase=pb.TRAIN), "phase: TRAIN", True),
    (dict(phase=pb.TEST), "phase: TRAIN", False),
    (dict(level=2), "min_level: 2", True),
    (dict(level=1), "min_level: 2", False),
    (dict(level=3), "max_level: 2", False),
    (dict(stages=["a", "b"]), "stage: 'a' stage: 'b'", True),
    (dict(stages=["a"]), "stage: 'a' stage: 'b'", False),
    (dict(stages=["a"]), "not_stage: 'a'", False),
    (dict(stages=["b"]), "not_stage: 'a'", True),
])
def test_state_rules(state, text, met):
    from brewnet.passes import rule_met

    assert rule_met(make_state(**state), rule(text)) is met


def test_filter_include_any_exclude_any():
    net = parse_text("""
      layer { name: "a" type: "Input" include { phase: TRAIN } include { stage: "s" } }
      layer { name: "b" type: "Input" exclude { phase: TEST } }
      layer { name: "c" type: "Input" }""", pb.NetParameter())
    names = lambda st: [l.name for l in filter_net(net, st).layer]  # noqa: E731
    assert names(make_state(pb.TRAIN)) == ["a", "b", "c"]
    assert names(make_state(pb.TEST)) == ["c"]
    assert names(make_state(pb.TEST, stages=["s"])) == ["a", "c"]


def test_lenet_train_test_phases():
    from brewnet.proto.io import read_net
    from helpers import MODELS, swap_data_layers

    p = swap_data_layers(read_net(str(MODELS / "bvlc/examples/mnist/lenet_train_test.prototxt")),
                         [[[64, 1, 28, 28], [64]], [[100, 1, 28, 28], [100]]])
    train, test = Net(p, caffe.TRAIN), Net(p, caffe.TEST)
    assert "accuracy" not in train.blobs and "accuracy" in test.blobs
    assert train.blobs["data"].shape == (64, 1, 28, 28) and test.blobs["data"].shape == (100, 1, 28, 28)


def test_in_place_blob_data_is_last_value_diff_is_first_grad():
    net = tiny()
    feed(net)
    net.forward()
    assert (net.blobs["conv"].data >= 0).all()          # after the in-place ReLU
    net.backward()
    conv_pre = net.forward(end="conv")["conv"].copy()    # the value before ReLU
    d = net.blobs["conv"].diff
    assert np.all(d[conv_pre < 0] == 0)                    # ReLU's backward already applied
    assert np.abs(d).sum() > 0


def test_loss_weight_scales_loss_and_every_diff():
    torch.manual_seed(0)
    a = tiny()
    torch.manual_seed(0)
    b = tiny(loss_weight=2.5)
    for n in (a, b):
        feed(n)
    la, lb = a.forward_tensors(), b.forward_tensors()
    assert float(lb) == pytest.approx(2.5 * float(la), rel=1e-6)
    a.backward(), b.backward()
    np.testing.assert_allclose(b.blobs["data"].diff, 2.5 * a.blobs["data"].diff, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(b.params["conv"][0].diff, 2.5 * a.params["conv"][0].diff, rtol=1e-5, atol=1e-8)


def test_param_diffs_accumulate_until_cleared():
    net = tiny()
    feed(net)
    net.forward(), net.backward()
    once = net.params["ip"][0].diff.copy()
    net.forward(), net.backward()
    np.testing.assert_allclose(net.params["ip"][0].diff, 2 * once, rtol=1e-6)
    net.clear_param_diffs()
    assert not net.params["ip"][0].diff.any()


def test_fan_out_accumulates_and_shared_params():
    text = """
    force_backward: true
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 } } }
    layer { name: "a" type: "InnerProduct" bottom: "x" top: "a"
            param { name: "w" } inner_product_param { num_output: 4 bias_term: false
            weight_filler { type: "gaussian" std: 0.5 } } }
    layer { name: "b" type: "InnerProduct" bottom: "x" top: "b"
            param { name: "w" } inner_product_param { num_output: 4 bias_term: false } }
    layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
    layer { name: "l" type: "EuclideanLoss" bottom: "s" bottom: "x" top: "l" }"""
    net = Net(text, caffe.TRAIN)
    assert net.layer_by_name["a"].blobs[0] is net.layer_by_name["b"].blobs[0]
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    net.forward(x=x)
    net.backward()
    w = torch.tensor(net.params["a"][0].data, dtype=torch.float64, requires_grad=True)
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    s = 2 * xt @ w.T
    loss = ((s - xt) ** 2).sum() / (2 * 2)
    loss.backward()
    np.testing.assert_allclose(net.params["a"][0].diff, w.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.blobs["x"].diff, xt.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_propagate_down_false_blocks_bottom_diff():
    text = TINY.replace('layer { name: "ip" type: "InnerProduct" bottom: "conv"',
                        'layer { name: "ip" type: "InnerProduct" propagate_down: false bottom: "conv"')
    net = Net(text.replace("LOSS_WEIGHT", ""), caffe.TRAIN)
    feed(net)
    net.forward(), net.backward()
    assert not net.blobs["data"].diff.any()
    assert net.params["ip"][0].diff.any() and not net.params["conv"][0].diff.any()


def test_lr_mult_zero_gets_no_diff():
    text = TINY.replace('layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"',
                        'layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" param { lr_mult: 0 }')
    net = Net(text.replace("LOSS_WEIGHT", ""), caffe.TRAIN)
    feed(net)
    net.forward(), net.backward()
    assert not net.params["ip"][0].diff.any() and net.params["ip"][1].diff.any()


def test_forward_range_and_reshape():
    net = tiny()
    feed(net)
    full = net.forward()["loss"].copy()
    net.forward(end="relu")
    out = net.forward(start="ip")
    np.testing.assert_allclose(out["loss"], full, rtol=1e-6)
    net.blobs["data"].reshape(2, 3, 5, 5)
    net.blobs["label"].reshape(2)
    net.reshape()
    assert net.blobs["conv"].shape == (2, 2, 3, 3) and net.blobs["ip"].shape == (2, 3)
    net.blobs["data"].reshape(2, 3, 7, 7)           # the inner product no longer fits
    with pytest.raises(ValueError, match=r"Layer 'ip'.*\(2, 2, 5, 5\)"):
        net.reshape()
    with pytest.raises(NetError, match="no layer named"):
        net.forward(end="nope")


def test_blob_loss_weights_and_outputs():
    net = tiny(loss_weight=3)
    assert net.blob_loss_weights["loss"] == 3 and net.blob_loss_weights["ip"] == 0
    assert net.inputs == ["data", "label"] and net.outputs == ["loss"]
    assert list(net.params) == ["conv", "ip"]
    assert [b.shape for b in net.params["conv"]] == [(2, 3, 3, 3), (2,)]


def test_deploy_net_runs_without_autograd():
    text = TINY.replace("force_backward: true", "").split('layer { name: "loss"')[0]
    net = Net(text, caffe.TEST)
    net.forward()
    assert not net.blobs["ip"].tensor.requires_grad


def test_backward_from_a_middle_layer_like_deepdream():
    net = tiny()
    feed(net)
    net.forward(end="ip")
    net.blobs["ip"].diff[...] = net.blobs["ip"].data       # gradient of 0.5 * ||ip||^2
    diffs = net.backward(start="ip")
    x = torch.tensor(net.blobs["data"].data, dtype=torch.float64, requires_grad=True)
    w, b = (torch.tensor(p.data, dtype=torch.float64) for p in net.params["conv"])
    w2, b2 = (torch.tensor(p.data, dtype=torch.float64) for p in net.params["ip"])
    ip = torch.relu(torch.nn.functional.conv2d(x, w, b)).flatten(1) @ w2.T + b2
    (0.5 * (ip ** 2).sum()).backward()
    np.testing.assert_allclose(diffs["data"], x.grad.numpy(), rtol=1e-4, atol=1e-6)
    # only the range's layers get parameter diffs; the loss layer did not run backward
    net2 = tiny()
    feed(net2)
    net2.forward()
    net2.blobs["conv"].diff[...] = 1
    net2.backward(start="relu", end="conv")
    assert net2.params["conv"][0].diff.any() and not net2.params["ip"][0].diff.any()


def test_learnable_params_as_caffe_lists_them():
    # BatchNorm's statistics are learnable params with lr_mult 0 (Caffe adds those specs), so a
    # solver keeps history for them as Caffe does; a shared blob takes the lr_mult another layer
    # gives when its owner gives none, and mismatched multipliers are an error.
    text = """
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" }
    layer { name: "a" type: "InnerProduct" bottom: "y" top: "a" param { name: "w" }
            inner_product_param { num_output: 2 bias_term: false } }
    layer { name: "b" type: "InnerProduct" bottom: "y" top: "b" param { name: "w" lr_mult: 3 }
            inner_product_param { num_output: 2 bias_term: false } }"""
    net = Net(text, caffe.TRAIN)
    assert len(net.learnable) == 4 and net.lr_mults == [0, 0, 0, 3]
    assert net.learnable[3].requires_grad and not net.learnable[0].requires_grad
    with pytest.raises(NetError, match="mismatched lr_mult"):
        Net(text.replace('param { name: "w" }', 'param { name: "w" lr_mult: 2 }'), caffe.TRAIN)


@pytest.mark.parametrize("channels", [1, 3])
def test_a_data_layers_batch_runs_as_an_inputs_bit_for_bit(tmp_path, channels):
    """A batch from a Data layer reaches the convolutions as an Input's does (NHWC on the CPU):
    the same tops and gradients, bit for bit, on the whole pass and layer by layer. An NCHW
    batch kept every convolution and pooling of a LMDB-fed LeNet in NCHW (its step 20-30%
    slower than the same net timed on an Input)."""
    from brewnet.data.db import open_writer
    from brewnet.data.transform import chw_to_datum

    rng = np.random.default_rng(0)
    with open_writer(str(tmp_path / "db")) as w:
        for i in range(8):
            w.put(f"{i:08d}", chw_to_datum(rng.integers(0, 256, (channels, 12, 12), dtype=np.uint8),
                                           i % 3).SerializeToString())
    body = TINY.split('layer { name: "conv"', 1)[1].replace("LOSS_WEIGHT", "").replace(
        "force_backward: true", "")
    data = (f'layer {{ name: "d" type: "Data" top: "data" top: "label" transform_param {{ scale: '
            f'0.0039 }} data_param {{ source: "{tmp_path / "db"}" batch_size: 4 backend: LMDB }} }}')
    inp = (f'layer {{ name: "in" type: "Input" top: "data" top: "label" input_param {{ shape {{ '
           f'dim: 4 dim: {channels} dim: 12 dim: 12 }} shape {{ dim: 4 }} }} }}')
    a = Net(f'name: "a"\n{data}\nlayer {{ name: "conv"{body}', caffe.TRAIN)
    b = Net(f'name: "b"\n{inp}\nlayer {{ name: "conv"{body}', caffe.TRAIN)
    with torch.no_grad():
        for x, y in zip(a.learnable, b.learnable):
            y.copy_(x)
    for by_layer in (False, True):
        a.clear_param_diffs()
        if by_layer:
            tops = [a.forward_layer(i) for i in range(len(a.layer_list))]
            assert tops[1][0].is_contiguous(memory_format=torch.channels_last)
        else:
            a.forward_tensors()
            assert a.blobs["conv"].tensor.is_contiguous(memory_format=torch.channels_last)
        a.backward_tensors()
        ga = [p.grad.clone() for p in a.learnable]
        b.blobs["data"].tensor.copy_(a.blobs["data"].tensor)
        b.blobs["label"].tensor.copy_(a.blobs["label"].tensor)
        b.clear_param_diffs()
        b.forward_tensors()
        b.backward_tensors()
        assert torch.equal(a.blobs["ip"].tensor, b.blobs["ip"].tensor)
        assert all(torch.equal(x, p.grad) for x, p in zip(ga, b.learnable))
