"""The OpenVINO engine (``engine="openvino"``, an ``auto`` candidate where OpenVINO is
installed): the steady call's inputs bound once, float32 and the user's threads, a clear error
where OpenVINO is missing. Its outputs against the eager net's (CIFAR10-quick, LeNet, MTCNN's
O-Net, a trained ResNet), weights changed after it was built, a kept output view and a cached
choice ready at construction: test_engines.py, beside ONNX Runtime's; a cut net: test_cut.py."""
from __future__ import annotations

import sys

import pytest
import torch

import brewnet
from brewnet.errors import NetError
from brewnet.execution import engines, lean
from brewnet.pycaffe import Net
from helpers import MODELS
from test_engines import LENET, assert_close, inputs, outputs, twin

CIFAR = MODELS / "bvlc/examples/cifar10/cifar10_quick.prototxt"
ov = pytest.importorskip("openvino", reason="the openvino extra (pip install 'brewnet[openvino]')")


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
