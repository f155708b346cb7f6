"""Training at the user's defaults, past the step graph's switch, against the same run with every
switch off, bit for bit: LeNet and CIFAR10-quick (Caffe's own train/test prototxts and solvers,
their data layers swapped for Input layers fed deterministic random batches) and a small residual
net (Convolution without bias -> BatchNorm -> Scale, an Eltwise SUM shortcut).

The default run sets no ``BREWNET_*`` variable: a ``solve`` of at least ``recorded_step.MIN_ITERS``
iterations records the train net's forward-backward at its second eager step when that step took
under ``recorded_step.MAX_EAGER_S`` (brewnet/execution/recorded_step.py) and replays it after that. The
plain run sets ``BREWNET_STEP_GRAPH=0`` and ``BREWNET_LEAN=0``. Every layer blob (learnable
params and BatchNorm's statistics), every history tensor, the loss of every iteration and every
test net output must be the same bits. The batches are small enough that a step stays under
``MAX_EAGER_S`` on a 2-core CPU, as a user's would for the graph to switch on at all.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import brewnet
from brewnet.execution import recorded_step
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text, read_net, read_solver
from helpers import VENDORED, swap_data_layers

ITERS = 600             # past recorded_step.MIN_ITERS: the default run is long enough to record
BATCHES = 16            # distinct random batches, cycled
EXAMPLES = VENDORED / "caffe-models" / "bvlc" / "examples"

RESIDUAL = """name: "residual"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 16 dim: 16 } shape { dim: 8 } } }
layer { name: "conv0" type: "Convolution" bottom: "data" top: "conv0"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "msra" } } }
layer { name: "bn0" type: "BatchNorm" bottom: "conv0" top: "conv0"
        param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
layer { name: "scale0" type: "Scale" bottom: "conv0" top: "conv0" scale_param { bias_term: true } }
layer { name: "relu0" type: "ReLU" bottom: "conv0" top: "conv0" }
layer { name: "conv1" type: "Convolution" bottom: "conv0" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"
        param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "msra" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2"
        param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
layer { name: "scale2" type: "Scale" bottom: "conv2" top: "conv2" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "conv0" bottom: "conv2" top: "sum"
        eltwise_param { operation: SUM } }
layer { name: "relu_sum" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
        pooling_param { pool: AVE kernel_size: 4 stride: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
# BatchNorm's use_global_stats is left to its phase default: batch statistics (and the running
# sums updated each forward) in TRAIN, the stored statistics in the test net.
RESIDUAL_SOLVER = """base_lr: 0.05 momentum: 0.9 weight_decay: 1e-4 lr_policy: "step" gamma: 0.5
    stepsize: 250 display: 100 max_iter: 10000 type: "Nesterov" """


def caffe_example(solver: str, net: str, shape: tuple, batch: int):
    """Caffe's solver and train/test net, data layers swapped for Input layers of ``batch``."""
    param = read_solver(EXAMPLES / solver)
    param.ClearField("net")
    tops = [(batch, *shape), (batch,)]
    param.net_param.CopyFrom(swap_data_layers(read_net(EXAMPLES / net), [tops, tops]))
    return param


def residual(batch: int):
    param = parse_text(RESIDUAL_SOLVER, pb.SolverParameter())
    net = parse_text(RESIDUAL, pb.NetParameter())
    del net.layer[0].input_param.shape[:]
    for s in ((batch, 3, 16, 16), (batch,)):
        net.layer[0].input_param.shape.add().dim.extend(s)
    param.net_param.CopyFrom(net)
    return param


# name: (solver param builder, (C, H, W), batch, value range, test_iter, test_interval)
NETS = {
    "LeNet": (lambda b: caffe_example("mnist/lenet_solver.prototxt",
                                      "mnist/lenet_train_test.prototxt", (1, 28, 28), b),
              (1, 28, 28), 16, (0.0, 1.0), 2, 300),
    "CIFAR10-quick": (lambda b: caffe_example("cifar10/cifar10_quick_solver.prototxt",
                                              "cifar10/cifar10_quick_train_test.prototxt",
                                              (3, 32, 32), b),
                      (3, 32, 32), 10, (-128.0, 128.0), 2, 300),
    "residual": (residual, (3, 16, 16), 8, (-1.0, 1.0), 3, 200),
}


def feed(shape: tuple, batch: int, span: tuple, seed: int):
    """``feed(i)``: the i-th of ``BATCHES`` random batches, cycled; labels 0-9."""
    rng = np.random.default_rng(seed)
    lo, hi = span
    xs = (lo + (hi - lo) * rng.random((BATCHES, batch, *shape))).astype(np.float32)
    ys = rng.integers(0, 10, (BATCHES, batch)).astype(np.float32)
    return lambda i: {"data": xs[i % BATCHES], "label": ys[i % BATCHES]}


def train(name: str, monkeypatch, plain: bool) -> dict:
    build, shape, batch, span, test_iter, test_interval = NETS[name]
    for var in ("BREWNET_STEP_GRAPH", "BREWNET_LEAN", "BREWNET_THREADS"):
        monkeypatch.delenv(var, raising=False)
    if plain:
        monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
        monkeypatch.setenv("BREWNET_LEAN", "0")
    param = build(batch)
    param.solver_mode = pb.SolverParameter.CPU
    param.max_iter = ITERS
    param.random_seed = 1701
    param.snapshot = 0
    param.snapshot_after_train = False
    del param.test_iter[:]
    param.test_iter.append(test_iter)
    param.test_interval = test_interval
    s = brewnet.get_solver(param, train_feed=feed(shape, batch, span, 1),
                           test_feeds=[feed(shape, batch, span, 2)])
    losses, replayed, tests = [], [], []

    def on_gradients():
        losses.append(s.loss)
        g = getattr(s, "_graph", None)
        replayed.append(g is not None and g.gm is not None)

    s.add_callback(None, on_gradients)
    test = s.test

    def recorded_test(k=0):
        out = test(k)
        tests.append({n: np.array(v, np.float32) for n, v in out.items()})
        return out

    s.test = recorded_test
    s.solve()
    assert s.iter == ITERS
    return {"solver": s, "losses": np.array(losses, np.float32), "replayed": replayed,
            "tests": tests,
            "blobs": [t.detach().clone() for layer in s.net.layer_list for t in layer.blobs],
            "history": [h.clone() for h in s.history]}


def assert_same_bits(fast: dict, plain: dict) -> None:
    assert len(fast["losses"]) == len(plain["losses"]) == ITERS
    np.testing.assert_array_equal(fast["losses"], plain["losses"])     # every iteration's loss
    assert len(fast["blobs"]) == len(plain["blobs"]) and fast["blobs"]
    for i, (a, b) in enumerate(zip(fast["blobs"], plain["blobs"])):
        assert torch.equal(a, b), f"layer blob {i}"
    assert len(fast["history"]) == len(plain["history"]) and fast["history"]
    for i, (a, b) in enumerate(zip(fast["history"], plain["history"])):
        assert torch.equal(a, b), f"history {i}"
    assert len(fast["tests"]) == len(plain["tests"]) >= 3          # test at 0, ..., ITERS
    for a, b in zip(fast["tests"], plain["tests"]):
        assert a.keys() == b.keys()
        for n in a:
            np.testing.assert_array_equal(a[n], b[n], err_msg=n)


@pytest.mark.parametrize("name", ["LeNet", "CIFAR10-quick"])
def test_replayed_training_equals_plain_bitwise(name, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="brewnet")
    fast = train(name, monkeypatch, plain=False)
    s = fast["solver"]
    refused = getattr(s, "_graph_refused", (None, None))[1]
    assert refused is None, f"the step graph refused {name}: {refused}"
    assert s._graph.gm is not None, [r.getMessage() for r in caplog.records
                                     if r.getMessage().startswith("step graph")]
    # recorded at the second eager step (iteration 1) here; on a loaded machine at the first
    # later one under MAX_EAGER_S. Every step after it a replay.
    first = fast["replayed"].index(True)
    assert first >= 1 and all(fast["replayed"][first:]) and s._graph.eager_calls == first + 1
    assert first < ITERS - recorded_step.MIN_ITERS, f"recorded only at iteration {first}"
    plain = train(name, monkeypatch, plain=True)
    assert getattr(plain["solver"], "_graph", None) is None and not any(plain["replayed"])
    assert_same_bits(fast, plain)


def test_residual_batchnorm_training_equals_plain_bitwise(monkeypatch, caplog):
    """BatchNorm is not in ``recorded_step.PURE`` (its TRAIN forward updates its running sums in
    place), so the step graph refuses this net and says why at debug level: the default run
    stays eager. When the step graph learns BatchNorm, turn this expectation into the other
    nets' (``_graph.gm is not None``)."""
    caplog.set_level(logging.DEBUG, logger="brewnet")
    fast = train("residual", monkeypatch, plain=False)
    s = fast["solver"]
    why = "layer 'bn0' of type BatchNorm"
    assert "BatchNorm" not in recorded_step.PURE
    assert s._graph_refused[1] == why
    assert f"step graph: {why}" in [r.getMessage() for r in caplog.records]
    assert not any(fast["replayed"])
    plain = train("residual", monkeypatch, plain=True)
    assert_same_bits(fast, plain)
    # BatchNorm's running sums moved (the TRAIN forward ran on batch statistics)
    assert fast["blobs"][3].item() > 1        # bn0's scale factor: 1 + 0.999 + 0.999^2 ...
