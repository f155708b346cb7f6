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
        share = f'param {{ name: "w_shared" }}' if shared else ""
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
    from brewnet.deploy.graph import to_torch

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
