"""Inference engines (brewnet/execution/engines.py): each engine gives the eager net's outputs
(``engines.RTOL`` of their scale: another runtime sums in another order) past the call where it
switches on, sees weights changed after it was built, and the choice cache (engine_cache.py)
refuses what no longer applies."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.errors import NetError
from brewnet.execution import engine_cache, engines, lean, runners
from brewnet.pycaffe import Net
from helpers import MODELS, SHARED, need

CIFAR = MODELS / "bvlc/examples/cifar10/cifar10_quick.prototxt"
LENET = MODELS / "bvlc/examples/mnist/lenet.prototxt"
NSFW = SHARED / "caffe-models/trained/open_nsfw"
MTCNN_ONET = Path(__file__).resolve().parents[1] / "benchmarks/zoo/nets/mtcnn_det3.prototxt"   # PReLU throughout
CALLS = lean.AFTER + 5
onnxruntime = pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'brewnet[onnx]')")


def need_engine(engine: str) -> None:
    """Skip where the runtime behind ``engine`` is not installed (one clear reason)."""
    if engine == "opencv":
        pytest.importorskip("cv2", reason="OpenCV")
    elif engine == "openvino":
        pytest.importorskip("openvino", reason="the openvino extra (pip install 'brewnet[openvino]')")


def inputs(net, n: int = CALLS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = net.blobs[net.inputs[0]].data.shape
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def outputs(net, xs) -> list[dict]:
    return [{k: v.copy() for k, v in net.forward(**{net.inputs[0]: x}).items()} for x in xs]


def assert_close(got: dict, want: dict, rtol: float) -> None:
    for k in want:
        scale = max(float(np.abs(want[k]).max()), 1e-30)
        assert np.abs(got[k] - want[k]).max() <= rtol * scale, k


def twin(path, engine, weights=None, batch=None):
    """A net on ``engine`` and an eager one with the same weights."""
    a = Net(str(path), brewnet.TEST, engine=engine)
    b = Net(str(path), brewnet.TEST, engine="eager")
    if weights:
        a.copy_from(str(weights))
        b.copy_from(str(weights))
    else:
        for la, lb in zip(a.layers, b.layers):
            for aa, bb in zip(la.blobs, lb.blobs):
                bb.data[...] = aa.data
    for n in (a, b):
        if batch:
            n.blobs[n.inputs[0]].reshape(batch, *n.blobs[n.inputs[0]].data.shape[1:])
            n.reshape()
    return a, b


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("path", [CIFAR, LENET, MTCNN_ONET], ids=["cifar10_quick", "lenet", "mtcnn_onet"])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_runtime_engine_gives_the_eager_outputs(engine, path, batch):
    need_engine(engine)
    net, eager = twin(path, engine, batch=batch)
    xs = inputs(net)
    got, want = outputs(net, xs), outputs(eager, xs)
    assert net._lean.engine is not None and net._lean.engine.name == engine
    assert eager._lean.engine is None
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])
    # the calls before the switch are eager's own bits
    for g, w in zip(got[:lean.AFTER], want[:lean.AFTER]):
        assert all(np.array_equal(g[k], w[k]) for k in w)


@pytest.mark.parametrize("engine, path, weights, kind", [
    ("onnxruntime", NSFW / "deploy.prototxt", NSFW / "resnet_50_1by2_nsfw.caffemodel", "OnnxRuntimeEngine"),
    ("openvino", NSFW / "deploy.prototxt", NSFW / "resnet_50_1by2_nsfw.caffemodel", "OpenVinoEngine"),
    ("compiled", LENET, None, "CompiledEngine")],
    ids=["onnxruntime-trained-resnet", "openvino-trained-resnet", "compiled-lenet"])
def test_engine_gives_the_eager_outputs(engine, path, weights, kind):
    need_engine(engine)
    net, eager = twin(need(path), engine, weights=weights)
    xs = inputs(net, lean.AFTER + 3)
    got, want = outputs(net, xs), outputs(eager, xs)
    assert isinstance(net._lean.engine, getattr(engines, kind))
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_an_engine_sees_weights_changed_after_it_was_built(engine):
    need_engine(engine)
    net, eager = twin(CIFAR, engine)
    xs = inputs(net)
    outputs(net, xs)
    built = net._lean.engine
    for n in (net, eager):
        n.params["conv1"][0].data[...] *= 0.5          # net surgery, through numpy
    got, want = outputs(net, xs[:3]), outputs(eager, xs[:3])
    assert net._lean.engine is not built and net._lean.engine.name == engine
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


@pytest.mark.parametrize("change", ["written in place", "replaced", "replaced by an equal one"])
def test_an_engine_sees_a_weight_tensor_written_or_replaced_through_torch(change):
    """The core net's parameter tensors, changed with torch (a solver's update, a user's code):
    the engine is rebuilt at the next call. A tensor replaced by an equal copy with the same
    version count rebuilds it too (identity is watched; values are not compared)."""
    net, eager = twin(CIFAR, "onnxruntime")
    xs = inputs(net)
    outputs(net, xs)
    built = net._lean.engine
    for n in (net, eager):
        conv = next(layer for layer in n._lean.net.layer_list if layer.name == "conv1")
        w = conv.blobs[0]
        with torch.no_grad():
            if change == "written in place":
                w.mul_(0.5)
            else:
                new = (w * (0.5 if change == "replaced" else 1.0)).detach()
                while new._version < w._version:        # the same count: only identity tells
                    new.add_(0.0)
                conv.blobs[0] = new.requires_grad_(w.requires_grad)
    got, want = outputs(net, xs[:3]), outputs(eager, xs[:3])
    assert net._lean.engine is not built and isinstance(net._lean.engine, runners.OnnxRuntimeEngine)
    assert net._lean.engine.state.holds()
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino", "opencv", "eager", "plain"])
def test_a_kept_parameter_view_written_after_forwards_reaches_the_next_forward(engine, tmp_path,
                                                                              monkeypatch):
    """pycaffe's parameter arrays are the weights' memory: ``W = net.params[..][0].data`` kept
    and written after the engine, the graph or the folded BatchNorm was built is what the next
    forward computes with (numpy's writes move no torch version counter)."""
    from test_lean import DEPLOY

    need_engine(engine)
    if engine == "plain":
        monkeypatch.setenv("BREWNET_LEAN", "0")
    path = tmp_path / "deploy.prototxt"
    path.write_text(DEPLOY)
    net, eager = twin(path, "eager" if engine == "plain" else engine)
    kept = [net.params[k][i].data for k, i in (("conv1", 0), ("bn1", 0), ("sc1", 1), ("ip1", 0))]
    xs = inputs(net)
    outputs(net, xs)
    assert (net._lean.engine is not None) == (engine in ("onnxruntime", "openvino", "opencv"))
    for step in range(2):
        for w in kept:
            w *= 0.5
            w += 0.01 * (step + 1)
        with torch.no_grad():          # (net's weights read as tensors: no new view of them)
            for la, lb in zip(net.layer_list, eager.layer_list):
                for a, b in zip(la.blobs, lb.blobs):
                    b.copy_(a)
        got, want = outputs(net, xs[:2]), outputs(eager, xs[:2])
        for g, w in zip(got, want):
            assert_close(g, w, engines.RTOL[torch.float32])


def test_the_steady_call_on_an_engine_is_the_general_paths(monkeypatch):
    """Past the switch, a whole forward on inputs of the blobs' shape and dtype takes the direct
    way (``LeanForward.direct``: input copied in, the engine's arrays taken); its outputs and
    intermediate blobs are the general path's, and what it does not cover (float64 input,
    another batch, a viewed intermediate blob, a hook) goes the general way, same numbers."""
    net, eager = twin(LENET, "onnxruntime")
    xs = inputs(net, CALLS + 6)
    outputs(net, xs[:CALLS])
    took = []
    direct = lean.LeanForward.direct
    monkeypatch.setattr(lean.LeanForward, "direct",
                        lambda self, ins: took.append(direct(self, ins)) or took[-1])

    def check(got, x, went_direct):
        assert (took[-1] is not None) == went_direct
        want = eager.forward(data=x)
        assert_close({k: v.copy() for k, v in got.items()}, want, engines.RTOL[torch.float32])

    check(net.forward(data=xs[0]), xs[0], True)
    net.blobs["data"].data[...] = xs[1]              # pycaffe's classic way: blob, then forward()
    check(net.forward(), xs[1], True)
    check(net.forward(data=xs[2].astype(np.float64)), xs[2], False)
    check(net.forward(data=xs[3]), xs[3], True)
    conv2 = net.blobs["conv2"].data                  # the plain forward on the saved input
    assert np.array_equal(conv2, eager.blobs["conv2"].data)
    check(net.forward(data=xs[4]), xs[4], False)     # a viewed intermediate blob: written each call
    eager.forward(data=xs[4])
    assert np.array_equal(conv2, eager.blobs["conv2"].data)
    del conv2
    check(net.forward(data=xs[5]), xs[5], True)
    two = np.concatenate(xs[:2])
    check(net.forward(data=two), two, False)
    seen = []
    net.before_forward(seen.append)
    check(net.forward(data=xs[0]), xs[0], False)
    assert seen


def test_an_engine_failing_in_the_steady_call_leaves_the_net_plain(caplog):
    net, eager = twin(LENET, "onnxruntime")
    xs = inputs(net)
    outputs(net, xs)
    assert net._lean._direct is not None

    def broken(arrays):
        raise RuntimeError("the session died")
    net._lean.engine.arrays = broken
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        got = outputs(net, xs[:2])
    for g, w in zip(got, outputs(eager, xs[:2])):
        assert all(np.array_equal(g[k], w[k]) for k in w)     # the plain path: eager's bits
    assert net._lean.engine is None and "the session died" in caplog.text


def test_intermediate_blobs_under_another_engine_are_the_eager_nets():
    net, eager = twin(CIFAR, "onnxruntime")
    xs = inputs(net)
    outputs(net, xs)
    outputs(eager, xs)
    assert net._lean.engine is not None
    assert np.array_equal(net.blobs["conv2"].data, eager.blobs["conv2"].data)


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino", "opencv"])
def test_an_output_view_under_an_engine_is_rewritten_by_the_next_forward(engine):
    """pycaffe's arrays are views of the blobs: a view kept from one forward shows the next
    one's values, a view dropped costs nothing (ONNX Runtime's fresh outputs are taken, not
    copied), and a copy the user made stays what it was."""
    need_engine(engine)
    net, eager = twin(LENET, engine)
    xs = inputs(net)
    outputs(net, xs[:-2])
    outputs(eager, xs[:-2])
    assert net._lean.engine is not None and net._lean.engine.name == engine
    kept = net.forward(data=xs[-2])["prob"]
    copied = kept.copy()
    new = net.forward(data=xs[-1])["prob"]
    want_old, want_new = (eager.forward(data=x)["prob"].copy() for x in xs[-2:])
    assert np.shares_memory(kept, new)
    assert_close({"p": kept}, {"p": want_new}, engines.RTOL[torch.float32])
    assert_close({"p": copied}, {"p": want_old}, engines.RTOL[torch.float32])
    del kept, new
    net.forward(data=xs[0])
    if engine == "onnxruntime":    # the session's new array is the blob's: a view needs no copy
        assert net.blobs["prob"]._owned["data"]

def test_auto_waits_until_the_forwards_are_worth_an_export(cache):
    """At the defaults, a net whose forwards take milliseconds stays eager through 20 calls:
    no export, no measurement, nothing cached."""
    net = Net(str(LENET), brewnet.TEST)
    assert net.engine == "auto"
    outputs(net, inputs(net, 20))
    assert net._lean.gm is not None and net._lean.engine is None
    assert not (engine_cache.cache_dir() / "onnx").exists() and not cache.path.exists()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BREWNET_CACHE_DIR", str(tmp_path))
    return engine_cache.ChoiceCache()


def test_auto_measures_twice_then_takes_the_cached_choice(cache, monkeypatch, caplog):
    """The first process measures; the next one starts on the cached choice and, once its
    forwards took ``AUTO_AFTER_S``, measures again (``CONFIRMS``: one measurement can be a
    noisy neighbour's); after that the choice stands."""
    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)       # measure at the lean graph's call
    timed = []
    real = engines.measure
    monkeypatch.setattr(engines, "measure", lambda *a, **k: timed.append(1) or real(*a, **k))
    net = Net(str(CIFAR), brewnet.TEST)
    xs = inputs(net)
    first = outputs(net, xs)
    assert timed == [1]
    entries = json.loads(cache.path.read_text())["choices"]
    (entry,) = entries.values()
    # (ONNX Runtime on one thread is tried too when the eager call was under ONE_THREAD_UNDER_S)
    assert set(entry["ms"]) - {engines.ONE_THREAD} == set(engines.candidates("auto"))
    assert {"eager", "onnxruntime", "opencv"} <= set(entry["ms"])
    assert entry["engine"] in entry["ms"]
    with caplog.at_level(logging.INFO, logger="brewnet"):
        again = Net(str(CIFAR), brewnet.TEST)      # (an engine is made ready here when it was)
        again.share_with(net)
        second = outputs(again, xs)
    assert "measured before" in caplog.text and "the mean of 2 measurements" in caplog.text
    assert timed == [1, 1], "a choice measured once is measured again"
    (entry,) = json.loads(cache.path.read_text())["choices"].values()
    assert entry["measures"] == 2
    for g, w in zip(second, first):
        assert_close(g, w, engines.RTOL[torch.float32])
    third = Net(str(CIFAR), brewnet.TEST)
    third.share_with(net)
    for g, w in zip(outputs(third, xs), first):
        assert_close(g, w, engines.RTOL[torch.float32])
    assert timed == [1, 1], "a choice measured twice stands"


@pytest.mark.parametrize("ready", [True, False], ids=["ready at construction", "at the graph's call"])
def test_a_second_measurement_can_overturn_a_cached_choice(cache, tmp_path, monkeypatch, ready):
    """A cached choice of ONNX Runtime measured once (0.9 ms against eager's 1.0); measured again
    the eager graph is 0.5 ms and ONNX Runtime 5: on the mean (0.75 against 2.95) the net goes
    to the eager graph, and the cache says so with 2 measurements. Whether the engine was made
    ready at construction or taken at the lean graph's call."""
    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)
    probe = Net(str(CIFAR), brewnet.TEST)
    weights = tmp_path / "w.caffemodel"
    probe.save(str(weights))
    key = engine_cache.choice_key(probe, [probe.blobs["data"].data.shape], engines.cores(), "fp32")
    cache.put(key, "onnxruntime", {"eager": 1.0, "onnxruntime": 0.9, "opencv": 3.0})
    if not ready:
        monkeypatch.setattr(engines, "ready", lambda lean: None)
    net, eager = twin(CIFAR, None, weights)
    assert isinstance(net._lean.engine, runners.OnnxRuntimeEngine) is ready
    again = {"eager": 5e-4, "onnxruntime": 5e-3, "openvino": 5e-3, "opencv": 5e-3, engines.ONE_THREAD: 5e-3}
    monkeypatch.setattr(engines, "measure", lambda runners, xs, **kw: {k: again[k] for k in runners})
    xs = inputs(net)
    got, want = outputs(net, xs), outputs(eager, xs)
    assert net._lean.engine is None and net._lean.gm is not None
    entry = cache.get(key)
    assert entry["engine"] == "eager" and entry["measures"] == 2
    assert entry["ms"]["eager"] == pytest.approx(0.75) and entry["ms"]["onnxruntime"] == pytest.approx(2.95)
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


@pytest.mark.parametrize("under_s, tried", [(0.0, False), (10.0, True)])
def test_one_thread_onnxruntime_is_tried_for_short_calls_only(cache, monkeypatch, under_s, tried):
    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)
    monkeypatch.setattr(engines, "ONE_THREAD_UNDER_S", under_s)
    monkeypatch.setattr(engines, "cores", lambda: 2)
    picked = []
    real = engines.measure
    monkeypatch.setattr(engines, "measure",
                        lambda runners, xs, **kw: picked.append(dict(runners)) or real(runners, xs, **kw))
    net = Net(str(LENET), brewnet.TEST)
    xs = inputs(net)
    got = outputs(net, xs)
    (runners,) = picked
    assert (engines.ONE_THREAD in runners) is tried
    if tried:
        assert runners[engines.ONE_THREAD].session.get_session_options().intra_op_num_threads == 1
        eager = Net(str(LENET), brewnet.TEST, engine="eager")
        eager.share_with(net)
        for g, w in zip(got, outputs(eager, xs)):
            assert_close(g, w, engines.RTOL[torch.float32])


def test_each_candidate_is_timed_after_the_last_ones_threads_have_settled():
    """A runtime called just after another runs slower (the other's pool still spins): auto must
    time each one as it runs alone. Two fakes: "spinner" takes 2 ms; "victim" 1 ms, but 6 ms
    while the spinner ran within the last 30 ms. Timed one call after the spinner, the victim
    would look the slower and lose."""
    last = {"spin": -1.0}

    def spinner(_):
        time.sleep(0.002)
        last["spin"] = time.perf_counter()

    def victim(_):
        time.sleep(0.006 if time.perf_counter() - last["spin"] < 0.03 else 0.001)

    assert engines.SETTLE_S >= 0.03
    ms = engines.measure({"spinner": spinner, "victim": victim}, [torch.zeros(1)], budget_s=0.0)
    assert ms["victim"] < ms["spinner"] < 0.004, ms


def test_auto_compares_what_a_steady_caller_pays_not_a_lucky_call():
    """An engine whose calls vary (eager's threads waking op by op) has fast calls now and then:
    compared on its fastest call it wins where a steady caller pays more. Two fakes: "steady"
    takes 2 ms every call; "erratic" 0.5 ms on one call in five, else 5 ms (3.0 on average)."""
    calls = {"n": 0}

    def steady(_):
        time.sleep(0.002)

    def erratic(_):
        calls["n"] += 1
        time.sleep(0.0005 if calls["n"] % 5 == 0 else 0.005)

    ms = engines.measure({"erratic": erratic, "steady": steady}, [torch.zeros(1)], budget_s=0.0)
    assert ms["steady"] < ms["erratic"], ms


def test_a_cached_choice_is_taken_at_the_lean_call_at_the_defaults(cache):
    net, eager = twin(CIFAR, None)
    xs = inputs(net)
    key = engine_cache.choice_key(net, [net.blobs["data"].data.shape], engines.cores(), "fp32")
    cache.put(key, "onnxruntime", {"eager": 2.0, "onnxruntime": 1.0})
    got, want = outputs(net, xs), outputs(eager, xs)
    assert isinstance(net._lean.engine, runners.OnnxRuntimeEngine)
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


def cached_net(cache, tmp_path, engine="onnxruntime", batch=None):
    """(weights file, key): CIFAR10-quick's weights saved, ``engine`` cached as auto's choice
    for its declared input shape (or ``batch``), as a first process leaves them."""
    first = Net(str(CIFAR), brewnet.TEST)
    weights = tmp_path / "w.caffemodel"
    first.save(str(weights))
    shape = (batch or first.blobs["data"].data.shape[0], *first.blobs["data"].data.shape[1:])
    key = engine_cache.choice_key(first, [shape], engines.cores(), "fp32")
    cache.put(key, engine, {"eager": 2.0, engine: 1.0})
    return weights


@pytest.mark.parametrize("engine", ["onnxruntime", "opencv", "onnxruntime-1thread", "openvino"])
def test_a_cached_engine_is_ready_for_the_first_call(cache, tmp_path, engine, monkeypatch):
    """Built at construction, and the first forward already takes the steady call's short path
    (``LeanForward.direct``), with either way of feeding it."""
    need_engine(engine)
    weights = cached_net(cache, tmp_path, engine)
    net = Net(str(CIFAR), brewnet.TEST, weights=str(weights))
    eager = Net(str(CIFAR), brewnet.TEST, weights=str(weights), engine="eager")
    assert net._lean.engine is not None and net._lean.engine.name == engine
    assert not net.blobs["prob"].data.any(), "the check at construction leaves the blobs alone"
    took = []
    direct = lean.LeanForward.direct
    monkeypatch.setattr(lean.LeanForward, "direct",
                        lambda self, ins: took.append((self, direct(self, ins))) or took[-1][1])
    xs = inputs(net, 4)
    net.blobs["data"].data[...] = xs[0]
    got = [{k: v.copy() for k, v in net.forward().items()}] + outputs(net, xs[1:])
    want = outputs(eager, xs)
    mine = [out for who, out in took if who is net._lean]
    assert len(mine) == 4 and all(out is not None for out in mine)
    assert net._lean.traces == 0 and net._lean.engine.name == engine   # no trace, no pick
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])
    # an intermediate blob read after it is the plain path's, as with a picked engine
    assert np.array_equal(net.blobs["conv2"].data, eager.blobs["conv2"].data)


def test_a_net_cached_on_onnxruntime_does_not_load_opencv(cache, tmp_path):
    """Listing auto's candidates finds OpenCV without importing it: cv2's import starts its
    OpenBLAS's server thread, which spins ~0.1 s on a core; in a fresh process it stalled the
    first calls of a net on ONNX Runtime by a scheduler tick (4 ms against 0.2) at random."""
    pytest.importorskip("cv2", reason="OpenCV")
    weights = cached_net(cache, tmp_path)
    script = (f"import sys, numpy as np, brewnet\n"
              f"from brewnet.pycaffe import Net\n"
              f"from brewnet.execution import engines\n"
              f"assert 'opencv' in engines.candidates('auto')\n"
              f"net = Net({str(CIFAR)!r}, brewnet.TEST, weights={str(weights)!r})\n"
              f"assert net._lean.engine.name == 'onnxruntime', net._lean.engine\n"
              f"for _ in range(3):\n"
              f"    net.forward(data=np.ones((1, 3, 32, 32), np.float32))\n"
              f"print('cv2' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, BREWNET_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"], out.stdout


def test_copy_from_readies_the_engine_a_random_net_does_not(cache, tmp_path):
    weights = cached_net(cache, tmp_path)
    onnx_files = lambda: sorted(tmp_path.glob("onnx/*.onnx"))   # noqa: E731
    net = Net(str(CIFAR), brewnet.TEST)            # filled at random: nothing exported for it
    assert net._lean.engine is None and onnx_files() == []
    net.copy_from(str(weights))
    assert net._lean.engine is not None and len(onnx_files()) == 1


def test_a_users_reshape_to_a_cached_shape_readies_its_engine(cache, tmp_path):
    weights = cached_net(cache, tmp_path, batch=3)
    net = Net(str(CIFAR), brewnet.TEST, weights=str(weights))
    assert net._lean.engine is None                   # declared batch 1: nothing cached
    net.blobs["data"].reshape(3, 3, 32, 32)
    net.reshape()
    assert net._lean.engine is not None and net._lean.engine.name == "onnxruntime"
    eager = Net(str(CIFAR), brewnet.TEST, weights=str(weights), engine="eager")
    eager.blobs["data"].reshape(3, 3, 32, 32)
    eager.reshape()
    xs = inputs(net, 3)
    for g, w in zip(outputs(net, xs), outputs(eager, xs)):
        assert_close(g, w, engines.RTOL[torch.float32])


def test_a_ready_engine_sees_weights_changed_before_the_first_call(cache, tmp_path):
    weights = cached_net(cache, tmp_path)
    net = Net(str(CIFAR), brewnet.TEST, weights=str(weights))
    eager = Net(str(CIFAR), brewnet.TEST, weights=str(weights), engine="eager")
    ready = net._lean.engine
    for n in (net, eager):
        n.params["conv1"][0].data[...] *= 0.5
    xs = inputs(net, 3)
    for g, w in zip(outputs(net, xs), outputs(eager, xs)):
        assert_close(g, w, engines.RTOL[torch.float32])
    assert net._lean.engine is not ready and net._lean.engine is not None


def test_a_cached_engine_that_fails_its_check_is_not_ready(cache, tmp_path, monkeypatch, caplog):
    weights = cached_net(cache, tmp_path)

    class Wrong(runners.OnnxRuntimeEngine):
        def __call__(self, xs):
            return tuple(o + 1 for o in super().__call__(xs))

    monkeypatch.setitem(engines.BUILDERS, "onnxruntime", Wrong)
    with caplog.at_level(logging.DEBUG, logger="brewnet"):
        net = Net(str(CIFAR), brewnet.TEST, weights=str(weights))
    assert net._lean.engine is None and "no engine ready at construction" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    eager = Net(str(CIFAR), brewnet.TEST, weights=str(weights), engine="eager")
    xs = inputs(net, 2)
    for g, w in zip(outputs(net, xs), outputs(eager, xs)):
        assert all(np.array_equal(g[k], w[k]) for k in w)


def test_the_cache_refuses_a_stale_entry(cache):
    net = Net(str(CIFAR), brewnet.TEST)
    key = engine_cache.choice_key(net, [(1, 3, 32, 32)], 1, "fp32")
    cache.put(key, "onnxruntime", {"eager": 2.0, "onnxruntime": 1.0})
    assert cache.get(key)["engine"] == "onnxruntime"
    assert cache.get(engine_cache.choice_key(net, [(2, 3, 32, 32)], 1, "fp32")) is None   # shapes
    wider = CIFAR.read_text().replace("num_output: 32", "num_output: 48", 1)
    other = Net(wider, brewnet.TEST)
    assert cache.get(engine_cache.choice_key(other, [(1, 3, 32, 32)], 1, "fp32")) is None  # weights
    # an entry stored under the right digest with another key inside is not taken either
    data = json.loads(cache.path.read_text())
    (digest,) = data["choices"]
    data["choices"][digest]["key"]["threads"] = 7
    cache.path.write_text(json.dumps(data))
    assert cache.get(key) is None
    # the ONNX file is keyed by the weights' values too
    before = engine_cache.onnx_path(net, [(1, 3, 32, 32)], runners.OPSET)
    net.params["conv1"][0].data[0, 0, 0, 0] += 1
    assert engine_cache.onnx_path(net, [(1, 3, 32, 32)], runners.OPSET) != before


def test_a_corrupt_cache_file_is_named_and_rebuilt(cache, monkeypatch, caplog):
    cache.path.parent.mkdir(parents=True, exist_ok=True)
    cache.path.write_text("{this is not json")
    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)
    net = Net(str(CIFAR), brewnet.TEST)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        outputs(net, inputs(net))
    assert str(cache.path) in caplog.text and "corrupt" in caplog.text
    assert len(json.loads(cache.path.read_text())["choices"]) == 1


def test_a_damaged_onnx_file_is_written_again(cache, caplog):
    net, eager = twin(CIFAR, "onnxruntime")
    path = engine_cache.onnx_path(net, [net.blobs["data"].data.shape], runners.OPSET)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x00garbage")
    xs = inputs(net)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        got, want = outputs(net, xs), outputs(eager, xs)
    assert "does not load" in caplog.text
    assert isinstance(net._lean.engine, runners.OnnxRuntimeEngine)
    assert_close(got[-1], want[-1], engines.RTOL[torch.float32])


def test_an_engine_that_cannot_take_the_net_is_skipped_quietly_by_auto(cache, monkeypatch, caplog):
    def refuse(*a, **k):
        raise NetError("no ONNX form for this layer")

    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)
    monkeypatch.setitem(engines.BUILDERS, "onnxruntime", refuse)
    monkeypatch.setitem(engines.BUILDERS, "opencv", refuse)
    monkeypatch.setitem(engines.BUILDERS, "openvino", refuse)
    monkeypatch.setitem(engines.BUILDERS, engines.ONE_THREAD, refuse)
    net, eager = twin(CIFAR, None)
    xs = inputs(net)
    with caplog.at_level(logging.DEBUG, logger="brewnet"):
        got, want = outputs(net, xs), outputs(eager, xs)
    assert net._lean.engine is None and net._lean.gm is not None
    assert "engine onnxruntime skipped: NetError: no ONNX form" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(np.array_equal(g["prob"], w["prob"]) for g, w in zip(got, want))


def test_onnxruntime_asked_for_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(NetError, match=r"pip install 'brewnet\[onnx\]'"):
        Net(str(CIFAR), brewnet.TEST, engine="onnxruntime")
    net = Net(str(CIFAR), brewnet.TEST)                  # auto: without it, no error
    assert "onnxruntime" not in engines.candidates(net.engine)
    outputs(net, inputs(net))
    assert net._lean.engine is None


def test_onnxruntime_on_one_thread_asked_for_by_name(cache):
    """auto's pick for tiny nets, also a name a user may ask for (a net per worker, say)."""
    net, eager = twin(LENET, engines.ONE_THREAD)
    xs = inputs(net)
    for g, w in zip(outputs(net, xs), outputs(eager, xs)):
        assert_close(g, w, engines.RTOL[torch.float32])
    engine = net._lean.engine
    assert engine.name == engines.ONE_THREAD
    assert engine.session.get_session_options().intra_op_num_threads == 1


def test_a_bad_engine_name_is_one_line(monkeypatch):
    with pytest.raises(NetError, match=r"^engine='fast': expected one of auto, eager, compiled, onnxruntime, "
                                       r"openvino, opencv, onnxruntime-1thread, onnxruntime-nospin$"):
        Net(str(CIFAR), brewnet.TEST, engine="fast")
    monkeypatch.setenv("BREWNET_ENGINE", "ort")
    with pytest.raises(NetError, match=r"^BREWNET_ENGINE='ort'"):
        Net(str(CIFAR), brewnet.TEST)
    monkeypatch.setenv("BREWNET_ENGINE", "eager")
    assert Net(str(CIFAR), brewnet.TEST).engine == "eager"


def test_brewnet_time_engines_prints_every_engines_time(tmp_path, monkeypatch, capsys):
    from brewnet.cli import main

    monkeypatch.setenv("BREWNET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "ONE_THREAD_UNDER_S", 10.0)   # as auto: one thread tried for short calls
    assert main(["time", "--model", str(LENET), "--engines", "--iterations", "3"]) == 0
    err = capsys.readouterr().err
    rows = {line.split()[-3]: line for line in err.splitlines() if line.split()[-1:] and "x" in line.split()[-1]}
    assert {"eager", "onnxruntime", "onnxruntime-1thread", "opencv"} <= set(rows), err
    picks = next(line for line in err.splitlines() if "auto picks " in line)
    assert "onnxruntime-1thread" in picks.split(" among ")[1]
    assert main(["time", "--model", str(CIFAR), "--engines", "auto"]) != 0
    assert "--engines lists engines to time" in capsys.readouterr().err
    assert main(["time", "--model", str(CIFAR), "--engines", "eager,tensorrt"]) != 0
    err = capsys.readouterr().err
    assert "--engines='tensorrt': expected one of" in err and "Traceback" not in err


@pytest.mark.parametrize("asked", ["onnxruntime", "onnxruntime-1thread", "onnxruntime-nospin", "openvino",
                                   "auto"])
def test_serves_module_on_an_engine_answers_any_batch_as_the_module(asked, tmp_path, monkeypatch):
    """brewnet serve's module on each engine gives the module's outputs at any batch, and leaves
    no file behind (a server started again and again left its ONNX files in /tmp)."""
    import tempfile

    from brewnet.deploy import to_torch

    gm = to_torch(str(CIFAR))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if asked == "openvino":
        pytest.importorskip("openvino", reason="the openvino extra (pip install 'brewnet[openvino]')")
    fn, chosen, ms = engines.for_module(gm, asked, torch.randn(4, 3, 32, 32), 1)
    assert list(tmp_path.iterdir()) == []
    assert chosen in ("eager", "onnxruntime", "onnxruntime-1thread", "onnxruntime-nospin", "openvino")
    if asked == "onnxruntime-nospin":
        assert fn.session.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning") == "0"
    if asked == "auto":
        assert set(ms) == set(engines.candidates("auto")) - {"opencv"} and chosen == min(ms, key=ms.get)
    else:
        assert chosen == asked and fn is not gm
    for n in (1, 7):
        x = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            assert engines.within((fn(x),), (gm(x),)) is None


def test_serve_names_a_bad_engine(tmp_path, capsys):
    from brewnet.cli import main

    weights = tmp_path / "w.caffemodel"
    Net(str(CIFAR), brewnet.TEST).save(str(weights))
    assert main(["serve", "--model", str(CIFAR), "--weights", str(weights), "--engine", "fastest"]) != 0
    assert "--engine='fastest': expected one of auto, eager, compiled, onnxruntime, openvino, opencv" in \
        capsys.readouterr().err


def test_bf16_runs_from_the_first_call_and_stays_near_fp32():
    if runners.bf16_refusal():
        pytest.skip(runners.bf16_refusal())
    net, eager = twin(CIFAR, None)
    bf = Net(str(CIFAR), brewnet.TEST, precision="bf16")
    bf.share_with(net)
    xs = inputs(net, 3)
    got, want = outputs(bf, xs), outputs(eager, xs)
    assert isinstance(bf._lean.engine, runners.Bf16Engine) and bf._lean.calls == 3
    for g, w in zip(got, want):
        assert g["prob"].dtype == np.float32
        assert_close(g, w, engines.RTOL[torch.bfloat16])
        assert not np.array_equal(g["prob"], w["prob"])        # it did run in bf16


def test_bf16_names_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(NetError, match="precision bf16 needs a CPU with AMX or AVX512-BF16"):
        Net(str(CIFAR), brewnet.TEST, precision="bf16")
    with pytest.raises(NetError, match=r"^precision='fp16': expected one of fp32, bf16$"):
        Net(str(CIFAR), brewnet.TEST, precision="fp16")


@pytest.mark.parametrize("path", [CIFAR, LENET], ids=["cifar10_quick", "lenet"])
def test_opencv_engine_gives_the_eager_outputs(path):
    net, eager = twin(path, "opencv", batch=4)
    xs = inputs(net)
    got, want = outputs(net, xs), outputs(eager, xs)
    assert isinstance(net._lean.engine, runners.OpenCVEngine)
    for g, w in zip(got, want):
        assert_close(g, w, engines.RTOL[torch.float32])


AXPY = """name: "se_gate"
layer { name: "a" type: "Input" top: "a" input_param { shape { dim: 1 dim: 4 dim: 1 dim: 1 } } }
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 4 dim: 3 dim: 3 } } }
layer { name: "y" type: "Input" top: "y" input_param { shape { dim: 1 dim: 4 dim: 3 dim: 3 } } }
layer { name: "axpy" type: "Axpy" bottom: "a" bottom: "x" bottom: "y" top: "out" }
"""


def test_an_engine_that_computes_another_thing_is_refused(caplog):
    """OpenCV 4's Axpy computes a*y + x where the SENet fork (and brewnet) compute a*x + y: the
    output check refuses the engine, and the eager net answers."""
    net = Net(AXPY, brewnet.TEST, engine="opencv")
    rng = np.random.default_rng(0)
    feed = {n: rng.standard_normal(net.blobs[n].data.shape).astype(np.float32) for n in net.inputs}
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        for _ in range(CALLS):
            out = net.forward(**feed)["out"]
    assert net._lean.engine is None
    assert "engine opencv cannot run it (NetError: its outputs differ from the eager net's" in caplog.text
    np.testing.assert_allclose(out, feed["a"] * feed["x"] + feed["y"], rtol=1e-6)
