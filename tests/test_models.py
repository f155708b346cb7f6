"""Real trained Caffe models reproduce the real Caffe's numbers (../shared/golden/models)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import brewnet as caffe
from brewnet.data.idx import read_idx
from helpers import GOLDEN, MODELS, need, tol

LENET = np.load(need(GOLDEN / "models" / "lenet_mnist.npz"), allow_pickle=False)  # else: skip the module
LENET_META = json.loads(str(LENET["meta"]))
T10K = MODELS / "trained" / "mnist_t10k" / "data" / "mnist"


@pytest.fixture(scope="module")
def mnist_test():
    images = read_idx(T10K / "t10k-images-idx3-ubyte.gz").astype(np.float32) * LENET_META["scale"]
    labels = read_idx(T10K / "t10k-labels-idx1-ubyte.gz").astype(np.int64)
    return images[:, None], labels


@pytest.mark.parametrize("model", sorted(LENET_META["models"]))
def test_lenet_matches_caffe(model, mnist_test):
    m = LENET_META["models"][model]
    net = caffe.Net(str(MODELS / m["prototxt"]), caffe.TEST, weights=str(need(MODELS / m["caffemodel"])))
    images, labels = mnist_test
    np.testing.assert_array_equal(images[:256], LENET["input"])
    out = net.forward(data=LENET["input"])
    np.testing.assert_allclose(net.blobs["ip2"].data, LENET[f"{model}/ip2"], **tol("blas", 0, 1e-4))
    np.testing.assert_allclose(out["prob"], LENET[f"{model}/prob"], **tol("blas", 0, 1e-5))
    preds = []
    for i in range(0, len(images), 500):
        preds.append(net.forward(data=images[i:i + 500])["prob"].argmax(1))
    preds = np.concatenate(preds)
    np.testing.assert_array_equal(preds, LENET[f"{model}/pred_10000"])
    assert (preds == labels).mean() == pytest.approx(m["accuracy_10000"], abs=1e-9)


def test_open_nsfw_matches_caffe():
    z = np.load(GOLDEN / "models" / "open_nsfw.npz", allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    d = MODELS / "trained" / "open_nsfw"
    net = caffe.Net(str(d / "deploy.prototxt"), caffe.TEST, weights=str(need(d / "resnet_50_1by2_nsfw.caffemodel")))
    for image in meta["images"]:
        x = z[f"{image}/input_data"]
        names = meta["blobs_all_images"] + (meta["blobs_first_image_only"] if image == meta["images"][0] else [])
        for name in names:
            net.blobs["data"].data[...] = x
            net.forward(end=name)
            ref = z[f"{image}/{name}"]
            atol = 1e-5 if name == "prob" else 1e-4 * np.abs(ref).max()
            np.testing.assert_allclose(net.blobs[name].data, ref, **tol("blas", 0, atol),
                                       err_msg=f"{image}/{name}")
