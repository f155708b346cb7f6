"""ENet's SpatialDropout Python layer built in, against its code (TimoSaemann/caffe-enet 22d356c,
python/spatial_dropout.py): TRAIN keeps or drops whole channels, a Bernoulli(1 - p) draw per
(sample, channel), scaled by 1/(1-p); its other branch (the deploy nets' 'TEST') multiplies by
1/(1-p) too. The phase is param_str's, as the fork's layer reads it. The corpus' ENet deploy net
(its module not published with it) builds and runs on the built-in."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from helpers import make_layer

ENET = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo" / "nets" / "enet.prototxt"


def _python_layer(phase_str, p="0.01", net_phase=pb.TEST):
    return make_layer('name: "drop" type: "Python" bottom: "x" top: "y" python_param { '
                      'module: "spatial_dropout" layer: "SpatialDropoutLayer" '
                      f'param_str: "{{\'phase\': \'{phase_str}\', \'p\': \'{p}\'}}" }}',
                      [(3, 40, 5, 6)], net_phase)[0]


def _fork_forward(x: np.ndarray, p: float, phase: str, keep: np.ndarray | None = None) -> np.ndarray:
    """spatial_dropout.py's forward, its loops as written. The fork ran on Python 2's numpy, whose
    value-based casting kept ``float32 array * int64 scalar * float`` in float32 (numpy 2 would
    widen the integer product to float64): the mask value and scale_ enter as float32 here."""
    scale_ = 1. / (1. - p)
    top = np.empty_like(x)
    if phase == 'TRAIN':
        for i in range(x.shape[0]):
            vec_w = keep[i]
            for j in range(x.shape[1]):
                top[i, j, :, :] = x[i, j, :, :] * np.float32(vec_w[j]) * np.float32(scale_)
    else:
        top[...] = x[...] * scale_
    return top


@pytest.mark.parametrize("p", ["0.01", "0.1", "0.5"])
def test_test_branch_scales_by_one_over_one_minus_p(p):
    x = np.random.default_rng(0).standard_normal((3, 40, 5, 6)).astype(np.float32)
    y = _python_layer("TEST", p).forward([torch.from_numpy(x)])[0].numpy()
    np.testing.assert_array_equal(y, _fork_forward(x, float(p), "TEST"))
    assert not np.array_equal(y, x)     # not the identity: the fork scales at TEST as well


def test_train_branch_drops_whole_channels():
    x = np.random.default_rng(1).uniform(0.5, 1.5, (3, 40, 5, 6)).astype(np.float32)
    torch.manual_seed(0)
    # param_str's phase wins over the net's: a 'TRAIN' layer in a TEST net still drops
    layer = _python_layer("TRAIN", "0.3", net_phase=pb.TEST)
    y = layer.forward([torch.from_numpy(x)])[0].numpy()
    keep = (y[:, :, 0, 0] != 0).astype(np.int64)       # positive x: zero only where dropped
    np.testing.assert_array_equal(y, _fork_forward(x, 0.3, "TRAIN", keep))
    assert 0.5 < keep.mean() < 0.9                      # 1 - p = 0.7 of 120 draws
    assert len({tuple(k) for k in keep}) == 3           # a draw per sample
    y2 = layer.forward([torch.from_numpy(x)])[0].numpy()
    assert not np.array_equal(y, y2)                    # fresh masks each forward


def test_gradient_float64_each_sample_through_its_own_mask():
    layer = _python_layer("TRAIN", "0.4")
    x = torch.randn(4, 6, 3, 2, dtype=torch.float64, requires_grad=True)

    def fn(x):
        torch.manual_seed(7)        # one mask for every evaluation of the check
        return layer.forward([x])[0]

    assert torch.autograd.gradcheck(fn, (x,), atol=1e-7, rtol=1e-6)
    y = fn(x)
    y.backward(torch.ones_like(y))
    keep = (y.detach() != 0).double()
    torch.testing.assert_close(x.grad, keep / (1 - 0.4))


def test_built_in_type_and_errors():
    layer, tops = make_layer('name: "d" type: "SpatialDropout" bottom: "x" top: "y" '
                             'dropout_param { dropout_ratio: 0.2 }', [(2, 3, 4, 4)], pb.TEST)
    assert tops == [(2, 3, 4, 4)]
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(layer.forward([x])[0], x * np.float32(1 / 0.8))
    with pytest.raises(LayerError, match="p \\(dropout_ratio\\) must be between 0 and 1"):
        _python_layer("TEST", "1.0")
    with pytest.raises(LayerError, match="is not spatial_dropout's"):
        make_layer('name: "d" type: "Python" bottom: "x" top: "y" python_param { '
                   'module: "spatial_dropout" layer: "SpatialDropoutLayer" param_str: "p: 3" }',
                   [(1, 2, 3, 3)], pb.TEST)


def test_enet_deploy_net_runs_on_the_built_in():
    net = brewnet.Net(str(ENET), brewnet.TEST, engine="eager")
    drops = [la for la in net.layer_list if la.type == "Python"]
    assert len(drops) == 27 and all(d.builtin.type == "SpatialDropout" for d in drops)
    net.blobs["data"].reshape(1, 3, 64, 128)
    net.reshape()
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((1, 3, 64, 128))
    out = net.forward()[net.outputs[0]]
    assert out.shape[0] == 1 and out.shape[2:] == (64, 128) and np.isfinite(out).all()
