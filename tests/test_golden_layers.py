"""Every layer case produced by the real Caffe (../shared/golden/layers) through brewnet's Net:
forward tops, bottom diffs and param diffs (and BatchNorm's running blobs after forward).

Tolerances (float32, from the golden README):
- elementwise / routing / pooling / shape layers: atol 1e-6 plus rtol 1e-6. The rtol is added
  because a transcendental (exp, tanh, log) may differ by an ulp between glibc and torch's
  vectorised kernels, and an ulp of a value above 8 is already 1e-6;
- ArgMax, Accuracy and pooling masks: exactly equal;
- BLAS-like layers (conv, inner product, LRN, softmax, MVN, BatchNorm, recurrent, reductions):
  rtol 1e-4, atol 1e-5 (summation order differs from OpenBLAS);
- losses: rtol 1e-5 on the loss, rtol 1e-4 / atol 1e-6 on diffs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from brewnet import Net
from brewnet.layers import LAYERS as LAYER_TYPES
from brewnet.proto import caffe_pb2 as pb
from helpers import GOLDEN_LAYERS as LAYERS
from helpers import tol

INDEX = json.loads((LAYERS / "index.json").read_text())
CASES = INDEX["cases"]

def tolerances(layer_type: str, what: str) -> dict:
    """From what the layer declares of its arithmetic (``Layer.arithmetic``, ``routing``).
    Under the device switch each is widened to its kind's (helpers.DEVICE_TOLERANCES)."""
    cls = LAYER_TYPES[layer_type]
    if cls.arithmetic == "exact":
        return tol("exact", 0, 0)
    if cls.routing or cls.arithmetic == "elementwise":
        return tol("elementwise", 1e-6, 1e-6)
    if cls.is_loss:
        return tol("loss", 1e-5, 1e-7) if what == "top" else tol("blas", 1e-4, 1e-6)
    return tol("blas", 1e-4, 1e-5)


def _producer(net: Net, blob: str):
    for layer, tops in zip(net.layer_list, net.top_lists):
        if blob in tops:
            return layer
    raise KeyError(blob)


def test_every_indexed_case_is_there():
    # A golden set missing files (or the index missing cases) must fail, not test fewer.
    assert len(CASES) == INDEX["count"] > 0
    assert sorted(c["file"] for c in CASES) == sorted(p.name for p in LAYERS.glob("*.npz"))


@pytest.mark.parametrize("case", CASES, ids=[c["file"][:-4] for c in CASES])
def test_golden_layer(case):
    z = np.load(LAYERS / case["file"], allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    phase = pb.TRAIN if meta["phase"] == "TRAIN" else pb.TEST
    net = Net(str(z["prototxt"]), phase)
    t = meta["type"]

    for name in meta["bottoms"]:
        value = z[f"bottom/{name}"]
        if name in net.inputs:
            net.blobs[name].reshape(*value.shape)
            net.blobs[name].data[...] = value
        else:  # "param" mode: a differentiable bottom comes from a Parameter layer
            net.params[_producer(net, name).name][0].data[...] = value
    for i in range(meta["num_params"]):
        net.params["test"][i].data[...] = z[f"param/{i}"]

    net.forward()
    for name in meta["tops"]:
        limits = dict(rtol=0, atol=0) if name == "mask" else tolerances(t, "top")
        np.testing.assert_allclose(net.blobs[name].data, z[f"top/{name}"], **limits,
                                   err_msg=f"top '{name}'")
    for i in range(meta["num_params"]):
        key = f"param_after_forward/{i}"
        if key in z.files:
            np.testing.assert_allclose(net.params["test"][i].data, z[key], **tolerances(t, "top"),
                                       err_msg=f"param {i} after forward")
    if not case.get("backward", True):
        return

    for name in meta["tops"]:
        net.blobs[name].diff[...] = z[f"top_diff/{name}"]
    net.backward()
    for name in meta["grad_bottoms"]:
        if name in net.inputs:
            got = net.blobs[name].diff
        else:
            got = net.params[_producer(net, name).name][0].diff
        np.testing.assert_allclose(got, z[f"bottom_diff/{name}"], **tolerances(t, "diff"),
                                   err_msg=f"bottom diff '{name}'")
    for i in range(meta["num_params"]):
        key = f"param_diff/{i}"
        if key in z.files:
            np.testing.assert_allclose(net.params["test"][i].diff, z[key], **tolerances(t, "diff"),
                                       err_msg=f"param diff {i}")
