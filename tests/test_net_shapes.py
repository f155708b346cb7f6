"""Every network under ../shared/caffe-models builds for TEST with Caffe's blob and param shapes
(../shared/golden/nets/shapes.json, made by the real Caffe; its inserted Split blobs aside)."""
from __future__ import annotations

import json
import re

import pytest

from brewnet.net import Net
from brewnet.proto.io import read_net

from helpers import GOLDEN, MODELS, swap_data_layers

SHAPES = json.loads((GOLDEN / "nets" / "shapes.json").read_text())
NETS = SHAPES["nets"]
NOTE = re.compile(r"^\w+ layer '[^']*' -> Input (\[\[.*\]\])")


def build(path: str, notes) -> Net:
    param = read_net(str(MODELS / path))
    swaps = [json.loads(m.group(1)) for m in map(NOTE.match, notes) if m]
    if swaps:
        param = swap_data_layers(param, swaps)
    stages = [s for n in notes if n.startswith("stages") for s in json.loads(n[7:].replace("'", '"'))]
    return Net(param, 1, stages=stages)


@pytest.mark.parametrize("path", sorted(NETS))
def test_shapes_match_caffe(path):
    ref = NETS[path]
    net = build(path, ref.get("notes", []))
    want = {n: tuple(s) for n, s in ref["blobs"] if "_split_" not in n}
    got = {n: tuple(net._shapes[n]) for n in net.blobs}
    assert got == want
    ref_params = {l["name"]: [tuple(p) for p in l["params"]] for l in ref["layers"] if l["type"] != "Split"}
    got_params = {l.name: [tuple(b.shape) for b in l.blobs] for l in net.layer_list}  # last of a duplicated name wins, as in Caffe
    assert got_params == ref_params
    assert sum(b.numel() for l in net.layer_list for b in l.blobs) == ref["total_params"]
    assert net.inputs == ref["inputs"]
    assert net.outputs == ref["outputs"]
