"""Nets cut before their layers with no graph form (brewnet/execution/cut.py): the trunk on the
lean graph or an engine, PriorBox's priors once per shape, DetectionOutput eagerly after them.
Past the call where the fast path switches on, each engine gives the eager net's detections:
compared as sets (``same_detections``: image and label equal, score and box within ``DET_TOL``;
NMS could keep the other of two near-tied boxes, none did here). A cut that needs two values
of one blob is declined: the net stays plain."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.execution import cut, engines, lean, runners
from brewnet.execution.fast_path import Declined
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text
from brewnet.pycaffe import Net
from helpers import need, pick

REPO = Path(__file__).resolve().parents[1]
DET_TOL = 1e-4        # scores and normalised box corners (engines.RTOL of the heads' scale: 1e-4)
CALLS = lean.AFTER + 4
SSD = """name: "tiny_ssd"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 32 dim: 32 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "loc" type: "Convolution" bottom: "conv1" top: "loc"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "loc_perm" type: "Permute" bottom: "loc" top: "loc_perm"
        permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "loc_flat" type: "Flatten" bottom: "loc_perm" top: "loc_flat" }
layer { name: "conf" type: "Convolution" bottom: "conv1" top: "conf"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "conf_perm" type: "Permute" bottom: "conf" top: "conf_perm"
        permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_perm" top: "conf_flat" }
layer { name: "prior" type: "PriorBox" bottom: "conv1" bottom: "data" top: "prior"
        prior_box_param { min_size: 8 max_size: 16 variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "priors" type: "Concat" bottom: "prior" top: "priors" concat_param { axis: 2 } }
layer { name: "conf_reshape" type: "Reshape" bottom: "conf_flat" top: "conf_reshape"
        reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax" softmax_param { axis: 2 } }
layer { name: "conf_out" type: "Flatten" bottom: "conf_softmax" top: "conf_out" }
layer { name: "detection_out" type: "DetectionOutput" bottom: "loc_flat" bottom: "conf_out" bottom: "priors"
        top: "detection_out"
        detection_output_param { num_classes: 3 background_label_id: 0 confidence_threshold: 0.2
          nms_param { nms_threshold: 0.45 top_k: 100 } code_type: CENTER_SIZE keep_top_k: 50 } }
"""
REAL = {"mobilenet_ssd": ("caffe-models/mobilenet-ssd/deploy.prototxt", 160),
        "pelee_ssd_voc": ("benchmarks/zoo/nets/pelee_ssd_voc.prototxt", 0)}


def same_detections(got: np.ndarray, want: np.ndarray, where: str) -> None:
    """DetectionOutput's rows (image, label, score, 4 corners) as sets: as many rows, and each
    wanted row matched by its own row of ``got`` of the same image and label, score and box
    within ``DET_TOL``."""
    g, w = got.reshape(-1, 7), want.reshape(-1, 7)
    assert len(g) == len(w), f"{where}: {len(g)} detections, eager {len(w)}"
    free = list(range(len(g)))
    for row in w:
        hit = next((i for i in free if g[i, 0] == row[0] and g[i, 1] == row[1]
                    and np.abs(g[i, 2:] - row[2:]).max() <= DET_TOL), None)
        assert hit is not None, f"{where}: eager's detection {row.tolist()} is missing"
        free.remove(hit)


def tiny(engine=None):
    brewnet.set_random_seed(3)
    return Net(parse_text(SSD, pb.NetParameter()), brewnet.TEST, engine=engine)


def eager_outputs(net, xs, monkeypatch) -> list[dict]:
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        return [{k: v.copy() for k, v in net.forward(**x).items()} for x in xs]


def run(net, xs) -> list[dict]:
    return [{k: v.copy() for k, v in net.forward(**x).items()} for x in xs]


def test_the_cut_runs_the_trunk_in_a_graph_the_priors_once_and_nms_eagerly():
    net = tiny()
    c = cut.plan(net)
    names = [net.layer_list[i].name for i in c.trunk]
    assert [net.layer_list[i].name for i in c.const] == ["prior", "priors"]
    assert [net.layer_list[i].name for i in c.tail] == ["detection_out"]
    assert "detection_out" not in names and "conv1" in names
    assert c.outputs == ["loc_flat", "conf_out"]
    assert cut.plan(Net(parse_text(SSD.split('layer { name: "prior"')[0], pb.NetParameter()),
                        brewnet.TEST)) is None        # a graph holds the whole net


@pytest.mark.parametrize("engine", ["eager", "onnxruntime", "onnxruntime-nospin", "openvino", "opencv"])
def test_each_engine_gives_the_eager_detections_on_a_cut_net(engine, monkeypatch):
    pytest.importorskip({"onnxruntime": "onnxruntime", "onnxruntime-nospin": "onnxruntime",
                         "openvino": "openvino", "opencv": "cv2"}.get(engine, "torch"),
                        reason=f"engine {engine} is not installed")
    net = tiny(engine)
    rng = np.random.default_rng(0)
    xs = [{"data": rng.standard_normal((2, 3, 32, 32)).astype(np.float32)} for _ in range(CALLS)]
    want = eager_outputs(net, xs, monkeypatch)
    got = run(net, xs)
    assert net._lean.gm is not None and net._lean.cut is not None
    assert (net._lean.engine.name if net._lean.engine else "eager") == engine
    assert len(want[0]["detection_out"].reshape(-1, 7)) > 10         # something to compare
    for i, (g, w) in enumerate(zip(got, want)):
        same_detections(g["detection_out"], w["detection_out"], f"call {i + 1}")
    # the intermediate blobs are the eager net's (the plain path re-makes them when read)
    np.testing.assert_array_equal(net.blobs["priors"].data, net.blobs["prior"].data)
    assert net.blobs["conf_out"].data.shape == (2, 16 * 16 * 2 * 3)


class _Trunk:
    """A stand-in engine for a cut net's trunk: its outputs (precomputed: faster than the eager
    trunk), after which the tail runs ``slow_tail_s`` slower (as after a pool that spins)."""

    def __init__(self, name, net, outs, flag):
        self.name, self.net, self.outs, self.flag = name, net, outs, flag
        self.state = runners.WeightsWatch(net)

    def __call__(self, xs):
        self.flag["slow"] = True
        return self.outs


def test_auto_times_a_cut_nets_candidates_with_its_tail_after_them(tmp_path, monkeypatch):
    """A trunk engine faster than the eager trunk, after which the eager tail runs 30 ms
    slower: auto keeps the eager engine (timing the trunks alone picked the other). ONNX
    Runtime without its pool's spin-wait is among the candidates of a cut net."""
    monkeypatch.setenv("BREWNET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)
    monkeypatch.setattr(engines, "MEASURE_S", 0.2)
    monkeypatch.setattr(engines, "ONE_THREAD_UNDER_S", 0.0)
    monkeypatch.setattr(engines, "candidates", lambda asked: ["eager", "onnxruntime"])
    net = tiny()
    x = {"data": np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)}
    flag = {"slow": False}
    detect = net._lean.net.layer_list[-1]
    plain_forward = detect.forward

    def tail(bottoms):
        if flag.pop("slow", False):
            time.sleep(0.03)
        return plain_forward(bottoms)

    monkeypatch.setattr(detect, "forward", tail)
    timed = []
    real = engines.measure
    monkeypatch.setattr(engines, "measure",
                        lambda runners, xs, **kw: timed.append(dict(runners)) or real(runners, xs, **kw))

    def fake(name):
        def build(core, threads, cut=None):
            with torch.no_grad():
                outs = core._lean._bound_call([core.blobs[n].tensor.detach() for n in core.inputs])
            return _Trunk(name, core, outs, flag)
        return build

    for name in ("onnxruntime", engines.NO_SPIN):
        monkeypatch.setitem(engines.BUILDERS, name, fake(name))
    want = eager_outputs(net, [x], monkeypatch)[0]["detection_out"]
    for _ in range(CALLS):
        got = net.forward(**x)["detection_out"].copy()
    (runners,) = timed
    assert set(runners) == {"eager", "onnxruntime", engines.NO_SPIN}
    assert net._lean._picked and net._lean.engine is None, "auto kept the engine with the slow tail"
    # each timed candidate is a whole call: the net's detections, not the trunk's outputs
    whole = runners["eager"]([net._lean.net.blobs["data"].tensor.detach()])
    same_detections(whole[0].numpy(), want, "the timed eager candidate")
    same_detections(got, want, "the call after the pick")


def test_onnxruntime_nospin_is_a_session_whose_pool_does_not_spin():
    pytest.importorskip("onnxruntime", reason="engine onnxruntime is not installed")
    net = tiny()
    runner = engines.BUILDERS[engines.NO_SPIN](net._lean.net, 2, cut=cut.plan(net))
    opts = runner.session.get_session_options()
    assert runner.name == engines.NO_SPIN
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize("name", list(REAL))
def test_a_real_ssd_at_the_defaults_gives_the_eager_detections(name, tmp_path, monkeypatch):
    """At the user's defaults (engine auto, measured at the lean graph's call here instead of
    after ``AUTO_AFTER_S``), past the graph's call and the pick, on random weights drawn to
    compute what a trained net would."""
    from test_every_net_every_call import feed, realistic

    rel, size = REAL[name]
    proto = need(pick(rel)) if rel.startswith("caffe-models") else REPO / rel
    monkeypatch.setenv("BREWNET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BREWNET_ENGINE", raising=False)
    monkeypatch.setattr(engines, "AUTO_AFTER_S", 0.0)
    brewnet.set_random_seed(0)
    net = Net(str(proto), brewnet.TEST)
    realistic(net, size, 1)
    feed(net, 1, size, seed=1)
    x = {n: net.blobs[n].data.copy() for n in net.inputs}
    want = eager_outputs(net, [x], monkeypatch)[0]["detection_out"]
    assert len(want.reshape(-1, 7)) > 5
    for i in range(CALLS):
        got = net.forward(**x)["detection_out"].copy()
        same_detections(got, want, f"{name} call {i + 1}")
    assert net._lean.cut is not None and net._lean._picked


def test_a_cut_needing_two_values_of_one_blob_is_declined(caplog):
    """A layer after DetectionOutput that rewrites one of its bottoms in place: the graph would
    have to return the blob before and after; the net stays plain, logged at info."""
    text = SSD + ('layer { name: "late" type: "ReLU" bottom: "loc_flat" top: "loc_flat" }\n')
    with pytest.raises(Declined, match="Layer 'late' .* rewrites blob 'loc_flat' after layer 'detection_out'"):
        cut.plan(Net(parse_text(text, pb.NetParameter()), brewnet.TEST))
    net = Net(parse_text(text, pb.NetParameter()), brewnet.TEST, engine="eager")
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="brewnet"):
        for _ in range(CALLS):
            net.forward(data=x)
    assert net._lean.gm is None and "rewrites blob 'loc_flat'" in caplog.text
