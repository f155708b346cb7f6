"""Inference folding of Convolution -> BatchNorm -> Scale equals running the layers one by one,
and follows every change to the parameters."""
from __future__ import annotations

import numpy as np
import torch

import brewnet as caffe
from helpers import tol

# folded against layer by layer: one convolution with the BatchNorm/Scale folded in against the
# three, so a float32 rounding of each product (on a GPU: cuDNN's algorithm for either)
FOLD = tol("blas", 1e-5, 1e-6)

CHAIN = """
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 BIAS
                            weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" }
SCALE
layer { name: "relu" type: "ReLU" bottom: "c" top: "c" }
layer { name: "pool" type: "Pooling" bottom: "c" top: "p" pooling_param { pool: AVE global_pooling: true } }
"""
SCALE = 'layer { name: "sc" type: "Scale" bottom: "c" top: "c" scale_param { bias_term: true } }'


def make(bias=True, scale=True):
    text = CHAIN.replace("BIAS", "" if bias else "bias_term: false").replace("SCALE", SCALE if scale else "")
    net = caffe.Net(text, caffe.TEST)
    rng = np.random.default_rng(0)
    bn = net.params["bn"]
    bn[0].data[...] = rng.standard_normal(4) * 5
    bn[1].data[...] = rng.random(4) * 3 + 0.1
    bn[2].data[...] = 2.5
    if scale:
        net.params["sc"][0].data[...] = rng.standard_normal(4)
        net.params["sc"][1].data[...] = rng.standard_normal(4)
    net.blobs["x"].data[...] = rng.standard_normal((2, 3, 9, 9))
    return net


def unfolded(net):
    """Each layer by itself: the reference the folding must reproduce."""
    net.forward(end="conv")
    for name in [l.name for l in net.layer_list][2:]:
        net.forward(start=name, end=name)
    return net.blobs["p"].data.copy(), net.blobs["c"].data.copy()


def test_chains_found_and_folded_equals_unfolded():
    for bias in (True, False):
        for scale in (True, False):
            net = make(bias, scale)
            assert net._folder.chains == {1: 3 if scale else 2}
            p, c = unfolded(net)
            out = net.forward()
            np.testing.assert_allclose(net.blobs["c"].data, c, **tol("blas", 1e-5, 1e-5))
            np.testing.assert_allclose(out["p"], p, **FOLD)


def test_folding_follows_parameter_changes():
    net = make()
    net.forward()
    net.params["bn"][0].data[...] += 1.0                   # write through numpy
    p, _ = unfolded(net)
    np.testing.assert_allclose(net.forward()["p"], p, **FOLD)
    with torch.no_grad():
        net.layer_by_name["sc"].blobs[1].add_(3.0)          # write through torch
    p, _ = unfolded(net)
    np.testing.assert_allclose(net.forward()["p"], p, **FOLD)


def test_no_folding_when_training_or_with_batch_stats():
    net = caffe.Net(CHAIN.replace("BIAS", "").replace("SCALE", SCALE), caffe.TRAIN)
    assert net._folder.chains == {}                         # BatchNorm uses batch statistics
