"""The OpenVINO engine (``engine="openvino"``, an ``auto`` candidate where OpenVINO is
installed): the eager net's outputs (``engines.RTOL`` of their scale) past the call where it
switches on, on real nets and at several batches; the steady call's inputs bound once; weights
changed after it was built seen; a clear error where OpenVINO is missing."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.errors import NetError
from brewnet.execution import engines, lean, runners
from brewnet.pycaffe import Net
from helpers import MODELS, SHARED, need
from test_engines import LENET, assert_close, inputs, outputs, twin

CIFAR = MODELS / "bvlc/examples/cifar10/cifar10_quick.prototxt"
MTCNN_ONET = Path(__file__).resolve().parents[1] / "benchmarks/zoo/nets/mtcnn_det3.prototxt"     # PReLU throughout
NSFW = SHARED / "caffe-models/trained/open_nsfw"
ov = pytest.importorskip("openvino", reason="the openvino extra (pip install 'brewnet[openvino]')")


@pytest.mark.parametrize("path", [CIFAR, LENET, MTCNN_ONET], ids=["cifar10_quick", "lenet", "mtcnn_onet"])
@pytest.mark.parametrize("batch", [1, 8])
def test_openvino_engine_gives_the_eager_outputs(path, batch):
    net, eager = twin(path, "openvino", batch=batch)
    xs = inputs(net)
    got, want = outputs(net, xs), outputs(eager, xs)
    assert isinstance(net._lean.engine, runners.OpenVinoEngine)
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])
    for g, w in zip(got[:lean.AFTER], want[:lean.AFTER]):     # before the switch: eager's bits
        assert all(np.array_equal(g[k], w[k]) for k in w)


def test_openvino_engine_on_a_trained_resnet():
    net, eager = twin(need(NSFW / "deploy.prototxt"), "openvino",
                      weights=NSFW / "resnet_50_1by2_nsfw.caffemodel")
    xs = inputs(net, lean.AFTER + 3)
    got, want = outputs(net, xs), outputs(eager, xs)
    assert isinstance(net._lean.engine, runners.OpenVinoEngine)
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


def test_the_steady_call_binds_its_inputs_once_and_follows_new_arrays(monkeypatch):
    """The steady call hands the engine the input blobs' own arrays: bound to the request once.
    A call on other arrays (the engine's torch call, auto's check) binds those, and the next
    steady call binds the blobs' again: each answer is its own input's."""
    net, eager = twin(CIFAR, "openvino")
    xs = inputs(net, lean.AFTER + 8)
    outputs(net, xs[:lean.AFTER + 3])         # switched, and steady calls since
    engine = net._lean.engine
    binds = []
    real = engine.request.set_input_tensor
    monkeypatch.setattr(engine, "request", _Spy(engine.request, lambda *a: binds.append(a) or real(*a)))
    rest = xs[lean.AFTER + 3:]
    got = outputs(net, rest[:2])
    assert binds == [], "the blobs' arrays were bound before"
    other = torch.from_numpy(rest[2])
    assert_close({"prob": engine([other])[0].numpy()}, outputs(eager, rest[2:3])[0], engines.RTOL[torch.float32])
    got += outputs(net, rest[2:])
    assert len(binds) == 2, "bound to the other array, then to the blob's again"
    for g, w in zip(got, outputs(eager, rest[:2]) + outputs(eager, rest[2:])):
        assert_close(g, w, engines.RTOL[torch.float32])


class _Spy:
    """``request`` with ``set_input_tensor`` replaced."""

    def __init__(self, request, set_input_tensor):
        self._request, self.set_input_tensor = request, set_input_tensor

    def __getattr__(self, name):
        return getattr(self._request, name)


def test_openvino_sees_weights_changed_after_it_was_built():
    net, eager = twin(CIFAR, "openvino")
    xs = inputs(net)
    outputs(net, xs)
    built = net._lean.engine
    for n in (net, eager):
        n.params["conv1"][0].data[...] *= 0.5          # net surgery, through numpy
    got, want = outputs(net, xs[:3]), outputs(eager, xs[:3])
    assert net._lean.engine is not built and isinstance(net._lean.engine, runners.OpenVinoEngine)
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


def test_openvino_runs_in_float32_and_on_the_users_thread_count(monkeypatch):
    """Never bfloat16 (OpenVINO's default on CPUs with AMX or AVX512-BF16: not Caffe's
    numbers); a thread count the user fixed is OpenVINO's too."""
    monkeypatch.setenv("BREWNET_THREADS", "1")
    net, _ = twin(LENET, "openvino")
    outputs(net, inputs(net, lean.AFTER + 1))
    model = net._lean.engine.request.get_compiled_model()
    assert str(model.get_property("INFERENCE_PRECISION_HINT")) in ("f32", "<Type: 'float32'>")
    assert model.get_property("INFERENCE_NUM_THREADS") == 1


def test_openvino_asked_for_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(NetError, match=r"pip install 'brewnet\[openvino\]'"):
        Net(str(CIFAR), brewnet.TEST, engine="openvino")
    assert "openvino" not in engines.candidates("auto")
