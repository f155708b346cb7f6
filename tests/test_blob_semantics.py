"""Caffe's blob and backward semantics in the executor, as pycaffe's own tests and Caffe's
net_surgery notebook rely on them: blob memory is stable (views follow it), and a backward runs
on the blobs' current data and diffs without any forward in this process or over that range."""
from __future__ import annotations

import numpy as np
import torch

import brewnet as caffe
from test_pycaffe_extras import python_net

RNG = np.random.default_rng(7)

# pycaffe's python/caffe/test/test_net.py simple_net_file, with num_output 13.
SIMPLE = """name: 'testnet' force_backward: true
layer { type: 'DummyData' name: 'data' top: 'data' top: 'label'
  dummy_data_param { num: 5 channels: 2 height: 3 width: 4
    num: 5 channels: 1 height: 1 width: 1
    data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' } } }
layer { type: 'Convolution' name: 'conv' bottom: 'data' top: 'conv'
  convolution_param { num_output: 11 kernel_size: 2 pad: 3
    weight_filler { type: 'gaussian' std: 1 } bias_filler { type: 'constant' value: 2 } }
  param { decay_mult: 1 } param { decay_mult: 0 } }
layer { type: 'InnerProduct' name: 'ip' bottom: 'conv' top: 'ip_blob'
  inner_product_param { num_output: 13
    weight_filler { type: 'gaussian' std: 2.5 } bias_filler { type: 'constant' value: -3 } } }
layer { type: 'SoftmaxWithLoss' name: 'loss' bottom: 'ip_blob' bottom: 'label' top: 'loss' }
"""

# A LeNet-shaped net with an in-place ReLU and a fan-out blob, on Input layers.
SMALL = """force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 1 dim: 12 dim: 12 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.2 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "pool1" top: "ip2"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip2" top: "sum" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "sum" bottom: "label" top: "loss" }
"""


def simple_net():
    net = caffe.Net(SIMPLE, caffe.TRAIN)
    net.blobs["label"].data[...] = RNG.integers(13, size=net.blobs["label"].data.shape)
    return net


def small_net(seed=0):
    caffe.set_random_seed(seed)
    net = caffe.Net(SMALL, caffe.TRAIN)
    net.blobs["data"].data[...] = np.random.default_rng(seed).standard_normal((4, 1, 12, 12))
    net.blobs["label"].data[...] = [0, 3, 1, 4]
    return net


# -- backward without forward ------------------------------------------------------------------
def test_backward_start_end_without_forward():
    """pycaffe's test_backward_start_end: the conv diff is W^T . ip_diff, no forward run."""
    net = simple_net()
    sample = RNG.uniform(size=net.blobs["ip_blob"].data.shape).astype(np.float32)
    net.blobs["ip_blob"].diff[:] = sample
    out = net.backward(start="ip", end="ip")
    assert "conv" in out
    w = net.params["ip"][0].data
    manual = np.stack([w.T @ sample[i] for i in range(len(sample))]).reshape(net.blobs["conv"].data.shape)
    np.testing.assert_allclose(net.blobs["conv"].diff, manual, rtol=1e-3, atol=1e-5)
    # The ip layer's param gradients come from the blobs' current data (conv is all zeros).
    np.testing.assert_allclose(net.params["ip"][1].diff, sample.sum(0), rtol=1e-5)
    assert not net.params["ip"][0].diff.any()
    assert not net.params["conv"][0].diff.any()          # outside the range: untouched


def test_python_layer_backward_after_hand_set_diffs():
    """pycaffe's test_python_layer test_backward: three x10 layers, top diff set by hand."""
    net = caffe.Net(python_net("SimpleLayer", 3), caffe.TRAIN)
    net.blobs["t2"].diff[...] = 7
    net.backward()
    assert (net.blobs["data"].diff == 1000 * 7).all()
    assert (net.blobs["t0"].diff == 100 * 7).all()


def test_backward_of_a_never_forwarded_net_equals_the_recorded_one():
    """A net whose blobs hold a forward's values (copied in, no forward run) backpropagates to
    the same diffs and param gradients as the net that ran that forward - through an in-place
    ReLU and a fan-out blob."""
    ran = small_net()
    ran.forward()
    ran.backward()
    fresh = small_net()
    for name, blob in ran.blobs.items():
        fresh.blobs[name].data[...] = blob.data
    fresh.backward()
    for name in ("conv1", "pool1", "ip1", "ip2", "sum", "data"):
        np.testing.assert_allclose(fresh.blobs[name].diff, ran.blobs[name].diff, rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    for name in ("conv1", "ip1", "ip2"):
        for a, b in zip(fresh.params[name], ran.params[name]):
            np.testing.assert_allclose(a.diff, b.diff, rtol=1e-5, atol=1e-7, err_msg=name)
    # The tops were left as they were (the re-run forward writes nothing).
    np.testing.assert_array_equal(fresh.blobs["loss"].data, ran.blobs["loss"].data)


def test_backward_over_a_range_never_forwarded():
    """forward only up to pool1, then backward over ip1..loss: those layers re-run on the
    blobs' data; pool1's diff sums both consumers, as Caffe's Split would."""
    ran = small_net()
    ran.forward()
    ran.backward()
    part = small_net()
    part.forward(end="pool1")
    for name in ("ip1", "ip2", "sum", "loss"):
        part.blobs[name].data[...] = ran.blobs[name].data
    part.backward(start="loss", end="ip1")
    np.testing.assert_allclose(part.blobs["pool1"].diff, ran.blobs["pool1"].diff, rtol=1e-5, atol=1e-7)
    assert not part.params["conv1"][0].diff.any()        # below the range


def test_layer_steps_equal_the_whole_pass():
    whole = small_net()
    whole.forward()
    whole.backward()
    steps = small_net()
    n = len(steps.layer_list)
    for i in range(n):
        steps.forward_layer(i)
    done: set = set()
    for i in reversed(range(n)):
        steps.backward_layer(i, done)
    np.testing.assert_allclose(steps.blobs["loss"].data, whole.blobs["loss"].data, rtol=1e-6)
    for name in ("conv1", "pool1", "ip1", "sum"):
        np.testing.assert_allclose(steps.blobs[name].diff, whole.blobs[name].diff, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(steps.params["conv1"][0].diff, whole.params["conv1"][0].diff, rtol=1e-5, atol=1e-7)


# -- stable memory -----------------------------------------------------------------------------
def test_views_follow_the_blob_across_forwards():
    """net_surgery's ``conv0 = net.blobs['conv'].data[0, 0]`` and forward()'s returned arrays
    show the values of the next forward."""
    net = small_net()
    conv0 = net.blobs["conv1"].data[0, 0]
    out = net.forward()
    np.testing.assert_array_equal(conv0, net.blobs["conv1"].data[0, 0])
    assert conv0.any()
    loss = out["loss"]
    before = float(loss)
    net.blobs["data"].data[...] = RNG.standard_normal((4, 1, 12, 12))
    net.forward()
    assert float(loss) == float(net.blobs["loss"].data) != before
    np.testing.assert_array_equal(conv0, net.blobs["conv1"].data[0, 0])
    diff = net.blobs["pool1"].diff
    net.backward()
    np.testing.assert_array_equal(diff, net.blobs["pool1"].diff)
    assert diff.any()


def test_views_follow_reshape_to_the_same_size_and_smaller():
    net = small_net()
    data = net.blobs["data"].data
    conv = net.blobs["conv1"].data
    net.blobs["data"].reshape(4, 1, 12, 12)             # the same shape: nothing moves
    net.forward()
    assert np.shares_memory(data, net.blobs["data"].data)
    np.testing.assert_array_equal(conv, net.blobs["conv1"].data)
    net.blobs["data"].reshape(2, 1, 12, 12)             # fits in the memory it has (capacity)
    assert np.shares_memory(data, net.blobs["data"].data)
    net.blobs["label"].reshape(2)
    net.blobs["data"].data[...] = 1.5
    net.blobs["label"].data[...] = [1, 2]
    net.forward()
    # conv1 shrank to (2, 3, 10, 10) inside its old memory: the old view's first part shows it.
    assert net.blobs["conv1"].shape == (2, 3, 10, 10)
    np.testing.assert_array_equal(conv.reshape(-1)[:600], net.blobs["conv1"].data.reshape(-1))


def test_no_copy_when_no_view_is_alive():
    """Without a live view the executor takes the computed tensor itself (no copy)."""
    net = small_net()
    net.forward()
    t = net.blobs["ip1"].tensor
    net.forward()
    assert net.blobs["ip1"].tensor is not t                # rebound, no copy made
    view = net.blobs["ip1"].data
    net.forward()
    assert np.shares_memory(view, net.blobs["ip1"].data)   # now written in place


def test_backward_without_forward_matches_float64():
    """The re-run path's gradients against a float64 reference of the same two layers."""
    net = simple_net()
    x = RNG.standard_normal(net.blobs["conv"].data.shape).astype(np.float32)
    net.blobs["conv"].data[...] = x
    d = RNG.standard_normal(net.blobs["ip_blob"].data.shape).astype(np.float32)
    net.blobs["ip_blob"].diff[...] = d
    net.backward(start="ip", end="ip")
    w = torch.tensor(net.params["ip"][0].data, dtype=torch.float64)
    np.testing.assert_allclose(net.params["ip"][0].diff, (torch.tensor(d, dtype=torch.float64).T
                               @ torch.tensor(x.reshape(5, -1), dtype=torch.float64)).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(net.blobs["conv"].diff.reshape(5, -1),
                               (torch.tensor(d, dtype=torch.float64) @ w).numpy(), rtol=1e-5, atol=1e-5)


def test_param_diff_view_follows_solver_steps(tmp_path):
    """``d = solver.net.params['conv1'][0].diff`` keeps showing the current diff across steps."""
    solver_text = f'''net_param {{ {SMALL} }}
base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 max_iter: 10 snapshot_prefix: "{tmp_path}/s"'''
    s = caffe.SGDSolver(solver_text)
    s.net.blobs["data"].data[...] = np.random.default_rng(1).standard_normal((4, 1, 12, 12))
    s.net.blobs["label"].data[...] = [0, 1, 2, 3]
    s.step(1)
    d = s.net.params["conv1"][0].diff
    first = d.copy()
    s.step(1)
    assert np.shares_memory(d, s.net.params["conv1"][0].diff)
    np.testing.assert_array_equal(d, s.net.params["conv1"][0].diff)
    assert not np.array_equal(d, first)


def test_a_view_never_writes_into_another_blobs_memory():
    """A Flatten top is a view of its bottom and a Split's tops are its bottom: once a numpy view
    of such a blob is taken, later writes go to memory of its own, never into the other blob."""
    text = """force_backward: true
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "split" type: "Split" bottom: "x" top: "a" top: "b" }
    layer { name: "relu" type: "ReLU" bottom: "b" top: "r" }
    layer { name: "flat" type: "Flatten" bottom: "r" top: "f" }
    layer { name: "scale" type: "Power" bottom: "a" top: "s" power_param { scale: 2 } }"""
    net = caffe.Net(text, caffe.TRAIN)
    x = np.array([[1, -2, 3], [-4, 5, -6]], np.float32)
    net.forward(x=x)
    a, f = net.blobs["a"].data, net.blobs["f"].data
    assert not np.shares_memory(a, net.blobs["x"].data) and not np.shares_memory(f, net.blobs["r"].data)
    net.forward(x=-x)
    np.testing.assert_array_equal(net.blobs["x"].data, -x)
    np.testing.assert_array_equal(a, -x)
    np.testing.assert_array_equal(f, np.maximum(-x, 0))
    net.blobs["s"].diff[...] = 1
    net.blobs["f"].diff[...] = 1
    da = net.blobs["a"].diff
    net.backward()
    np.testing.assert_array_equal(da, 2)
    np.testing.assert_array_equal(net.blobs["x"].diff, 2 + (-x > 0))
