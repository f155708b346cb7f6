"""Call N equals call 1: a net called in a loop, as a script classifying a folder or a server
does, past every switch brewnet makes on its own (lean inference at call ``lean.AFTER + 1``),
with the defaults a user has. Each combination of folded weights the lean graph and
``to_torch(fold=True)`` meet: bias or none, BatchNorm with or without Scale, Scale with or
without bias, params shared between layers."""
import itertools
import logging

import numpy as np
import pytest
import torch

import brewnet
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text

CALLS = 20
LEAN_RTOL = 1e-5      # brewnet/lean.py: a re-chosen kernel sums in another order (float32 rounding)


def chain_net(conv_bias: bool, scale: str | None, shared: bool, plain2: bool = False) -> str:
    """Input -> conv1 [-> BatchNorm [-> Scale]] -> ReLU -> conv2 [-> BatchNorm [-> Scale]] ->
    InnerProduct; ``scale``: None (BatchNorm alone), "bias" or "nobias"; ``shared``: conv2
    reads conv1's weights (Caffe's named params); ``plain2``: conv2 has no chain to fold."""
    def conv(name, bottom, chain=True):
        share = 'param { name: "w_shared" }' if shared else ""
        share += ' param { name: "b_shared" }' if shared and conv_bias else ""
        text = (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" {share}'
                f' convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 bias_term: {str(conv_bias).lower()}'
                ' weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }\n')
        if not chain:
            return text
        text += (f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}" top: "{name}" '
                 'batch_norm_param { use_global_stats: true } }\n')
        if scale:
            text += (f'layer {{ name: "{name}_sc" type: "Scale" bottom: "{name}" top: "{name}" '
                     f'scale_param {{ bias_term: {str(scale == "bias").lower()} }} }}\n')
        return text + f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'
    return ('layer { name: "data" type: "Input" top: "data" '
            'input_param { shape { dim: 2 dim: 4 dim: 9 dim: 9 } } }\n'
            + conv("conv1", "data") + conv("conv2", "conv1", not plain2)
            + 'layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip" '
              'inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }\n')


COMBOS = [(*c, False) for c in itertools.product([True, False], [None, "bias", "nobias"], [False, True])]
COMBOS += [(bias, "bias", True, True) for bias in (True, False)]   # a folded and a plain conv share


def _random_stats(net) -> None:
    rng = np.random.default_rng(7)
    for layer in net.layer_list:
        if layer.type == "BatchNorm":
            n = layer.blobs[0].shape[0]
            for b, v in zip(layer.blobs, (rng.standard_normal(n) * 0.2, rng.random(n) + 0.5, [0.9])):
                with torch.no_grad():
                    b.copy_(torch.as_tensor(np.asarray(v, np.float32)).reshape(b.shape))
        elif layer.type == "Scale":
            with torch.no_grad():
                for b in layer.blobs:
                    b.copy_(torch.as_tensor(rng.random(tuple(b.shape)).astype(np.float32) + 0.5))


def _build(combo):
    brewnet.set_random_seed(11)
    net = brewnet.Net(parse_text(chain_net(*combo), pb.NetParameter()), brewnet.TEST)
    _random_stats(net)
    return net


def _ids(combo):
    bias, scale, shared, plain2 = combo
    return f"{'bias' if bias else 'nobias'}-{'bn' if scale is None else 'scale_' + scale}" + \
        ("-shared" if shared else "") + ("-with-plain" if plain2 else "")


@pytest.mark.parametrize("combo", COMBOS, ids=[_ids(c) for c in COMBOS])
def test_call_n_equals_call_1_on_folded_chains(combo, caplog, monkeypatch):
    """With the user's defaults (no switch set): every call's output equals the first's, past
    the call where lean inference takes over, and the graph is in use without a warning."""
    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    net = _build(combo)
    x = np.random.default_rng(3).standard_normal((2, 4, 9, 9)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        outs = [net.forward(data=x)["ip"].copy() for _ in range(CALLS)]
    assert net._lean.gm is not None, "the lean graph did not take over"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    scale = np.abs(outs[0]).max()
    for i, out in enumerate(outs[1:], 2):
        assert np.abs(out - outs[0]).max() <= LEAN_RTOL * scale, f"call {i}"
    # the layers one by one, nothing folded
    monkeypatch.setenv("BREWNET_LEAN", "0")
    monkeypatch.setattr(net._folder, "chains", {})
    want = net.forward(data=x)["ip"].copy()
    assert np.abs(outs[-1] - want).max() <= LEAN_RTOL * scale


@pytest.mark.parametrize("combo", COMBOS, ids=[_ids(c) for c in COMBOS])
def test_to_torch_folded_equals_the_net(combo, tmp_path):
    """``to_torch(fold=True)`` on every combination gives the net's outputs."""
    from brewnet.deploy.fx_export import to_torch

    net = _build(combo)
    weights = tmp_path / "w.caffemodel"
    net.save(str(weights))
    proto = tmp_path / "net.prototxt"
    proto.write_text(chain_net(*combo))
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 4, 9, 9)).astype(np.float32))
    want = net.forward(data=x.numpy())["ip"].copy()
    for fold in (False, True):
        gm = to_torch(str(proto), str(weights), fold=fold)
        with torch.no_grad():
            got = gm(x).numpy()
        assert np.abs(got - want).max() <= LEAN_RTOL * np.abs(want).max(), f"fold={fold}"


# -- no automatic fast path raises into a user's loop (brewnet/fast_path.py) --------------------
def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "brewnet" and r.levelno >= logging.WARNING]


def _eager_outputs(combo, x, monkeypatch, calls: int) -> list[np.ndarray]:
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        net = _build(combo)
        return [net.forward(data=x)["ip"].copy() for _ in range(calls)]


@pytest.mark.parametrize("when", ["build", "call"])
def test_a_lean_graph_that_fails_warns_once_and_the_net_goes_on_eager(when, caplog, monkeypatch):
    """A layer failing while the graph is traced (``build``), or the graph failing at its 15th
    call (``call``): one warning naming the net, the layer and the reason; every call returns
    the eager outputs; the graph is never tried again."""
    from brewnet.execution.lean import LeanForward

    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    combo = (False, "bias", False, False)
    x = np.random.default_rng(3).standard_normal((2, 4, 9, 9)).astype(np.float32)
    want = _eager_outputs(combo, x, monkeypatch, 1)[0]
    net = _build(combo)
    net.name = "guarded"
    if when == "build":        # the InnerProduct raises when it runs on the tracee's params
        ip = net.layer_list[[l.name for l in net.layer_list].index("ip")]
        own, real = ip.blobs[0], ip.forward

        def forward(bottoms):
            if ip.blobs[0] is not own:
                raise IndexError("list index out of range")
            return real(bottoms)
        monkeypatch.setattr(ip, "forward", forward)
    else:
        real_call, calls = LeanForward._call, []

        def call(self, xs):
            calls.append(1)
            if len(calls) == 15 - 10:
                raise RuntimeError("a kernel the graph chose failed")
            return real_call(self, xs)
        monkeypatch.setattr(LeanForward, "_call", call)
    with caplog.at_level(logging.INFO, logger="brewnet"):
        outs = [net.forward(data=x)["ip"].copy() for _ in range(CALLS + 5)]
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "Net 'guarded'" in warned[0] and "eager path" in warned[0]
    if when == "build":
        assert "'ip' (type InnerProduct)" in warned[0] and "IndexError" in warned[0]
    else:
        assert "a kernel the graph chose failed" in warned[0]
    assert net._lean.guard.off is not None and net._lean.gm is None
    assert net._lean.traces == 1
    for i, out in enumerate(outs, 1):
        assert np.abs(out - want).max() <= LEAN_RTOL * np.abs(want).max(), f"call {i}"


def test_the_users_errors_still_raise_after_the_switch(monkeypatch, caplog):
    """A wrong input shape after the lean graph took over is the user's error, raised as the
    eager path raises it, not a warning; the graph stays on for good inputs."""
    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    net = _build((False, "bias", False, False))
    x = np.random.default_rng(3).standard_normal((2, 4, 9, 9)).astype(np.float32)
    for _ in range(12):
        net.forward(data=x)
    assert net._lean.gm is not None
    with caplog.at_level(logging.WARNING, logger="brewnet"), pytest.raises(ValueError, match="conv1"):
        net.forward(data=np.zeros((2, 3, 9, 9), np.float32))
    assert not _warnings(caplog) and net._lean.guard.off is None


def _logreg_solver(feed):
    from test_step_graph import LOGREG, make_solver
    return make_solver(LOGREG, feed=feed)


@pytest.mark.parametrize("when", ["capture", "replay"])
def test_a_step_graph_that_fails_warns_once_and_training_goes_on_eager(when, monkeypatch, caplog):
    """The recorded training step failing at its capture or at a replay: one warning naming
    the net and the reason, and the run's numbers bit for bit those of the eager run."""
    from brewnet.execution.recorded_step import StepGraph
    from test_step_graph import logreg_feed, state

    monkeypatch.setenv("BREWNET_STEP_GRAPH", "0")
    eager = _logreg_solver(logreg_feed())
    eager.step(40)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    name = "_prepare" if when == "capture" else "_run"
    real, runs = getattr(StepGraph, name), []

    def failing(self, *a):
        runs.append(1)
        if when == "capture" or len(runs) == 20:
            raise RuntimeError(f"the {when} broke")
        return real(self, *a)
    monkeypatch.setattr(StepGraph, name, failing)
    with caplog.at_level(logging.INFO, logger="brewnet"):
        s = _logreg_solver(logreg_feed())
        s.step(40)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "Net 'logreg'" in warned[0] and f"the {when} broke" in warned[0], warned
    assert s._graph.guard.off is not None and s._graph.gm is None
    for a, b in zip(state(s), state(eager)):
        np.testing.assert_array_equal(a, b)


def test_a_bad_label_in_a_replay_is_still_the_users_error(monkeypatch, caplog):
    """The label check runs before the guarded replay: out-of-range labels raise, no warning."""
    from brewnet.layers.base import LayerError
    from test_step_graph import logreg_feed

    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    s = _logreg_solver(logreg_feed(bad_at=7))
    with caplog.at_level(logging.WARNING, logger="brewnet"), pytest.raises(LayerError, match="out of range"):
        s.step(20)
    assert s._graph.gm is not None and s._graph.guard.off is None and not _warnings(caplog)


def test_thread_tuning_that_fails_warns_once_and_the_calls_go_on(monkeypatch, caplog):
    from brewnet.execution import threads

    monkeypatch.delenv("BREWNET_LEAN", raising=False)
    net = _build((True, None, False, False))
    net.name = "tuned"
    x = np.random.default_rng(3).standard_normal((2, 4, 9, 9)).astype(np.float32)

    def broken(self, fixed):
        raise ZeroDivisionError("float division by zero")
    monkeypatch.setattr(threads.Tuner, "_enter", broken)     # runs on every call
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        outs = [net.forward(data=x)["ip"].copy() for _ in range(CALLS)]
    warned = _warnings(caplog)
    assert len(warned) == 1 and "Net 'tuned': thread tuning failed" in warned[0], warned
    assert np.abs(outs[-1] - outs[0]).max() <= LEAN_RTOL * np.abs(outs[0]).max()
