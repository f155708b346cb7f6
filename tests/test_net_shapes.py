"""Every network under ../shared/caffe-models builds for TEST with Caffe's blob and param shapes
(../shared/golden/nets/shapes.json, made by the real Caffe; its inserted Split blobs aside)."""
from __future__ import annotations

import json
import re

import pytest

from brewnet import Net
from brewnet.proto.io import read_net
from helpers import GOLDEN_NETS, MODELS, need, swap_data_layers

SHAPES = json.loads((GOLDEN_NETS / "shapes.json").read_text())
NETS = SHAPES["nets"]
NOTE = re.compile(r"^\w+ layer '[^']*' -> Input (\[\[.*\]\])")


def build(path: str, notes) -> Net:
    param = read_net(str(need(MODELS / path)))
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
    got = {n: tuple(net.shapes[n]) for n in net.blobs}
    assert got == want
    ref_params = {l["name"]: [tuple(p) for p in l["params"]] for l in ref["layers"] if l["type"] != "Split"}
    # last of a duplicated name wins, as in Caffe
    got_params = {l.name: [tuple(b.shape) for b in l.blobs] for l in net.layer_list}
    assert got_params == ref_params
    assert sum(b.numel() for l in net.layer_list for b in l.blobs) == ref["total_params"]
    assert net.inputs == ref["inputs"]
    assert net.outputs == ref["outputs"]


# The 12 nets the real Caffe could not parse (fields of forks: ceil_mode, SSD's params) build too.
FAILED = SHAPES["failed"]
# Published learnable-parameter counts (torchvision's DenseNets have the same architecture).
DENSENET = {"121": 7_978_856, "161": 28_681_000, "169": 14_149_480, "201": 20_013_928}
PRIORS = {"mobilenet-ssd": 1917, "ssd": 8732}   # SSD300: 8732 default boxes; MobileNet-SSD: 1917


def build_failed(path: str) -> Net:
    param = read_net(str(need(MODELS / path)))
    data = [l for l in param.layer if l.type == "AnnotatedData"]
    phase = 0 if path.endswith("train.prototxt") else 1   # train files have only a TRAIN data layer
    if data:
        swaps = [[[l.data_param.batch_size, 3, l.transform_param.resize_param.height,
                   l.transform_param.resize_param.width], [1, 1, 1, 8]] for l in data]
        param = swap_data_layers(param, swaps)
    return Net(param, phase)


@pytest.mark.parametrize("path", sorted(FAILED))
def test_fork_nets_build(path):
    net = build_failed(path)
    if path.startswith("densenet"):
        k = re.search(r"DenseNet_(\d+)", path).group(1)
        learnable = sum(b.numel() for l in net.layer_list if l.type != "BatchNorm" for b in l.blobs)
        assert learnable == DENSENET[k]
        assert net.shapes["pool1"][2:] == (56, 56)   # ceil_mode: false -> FLOOR (CEIL gives 57)
        assert net.shapes["fc6"] == (1, 1000, 1, 1)
        return
    n = net.blobs["data"].shape[0]
    priors = PRIORS[path.split("/")[0]]
    assert net.shapes["mbox_priorbox"] == (1, 2, priors * 4)
    assert net.shapes["mbox_loc"] == (n, priors * 4)
    assert net.shapes["mbox_conf"] == (n, priors * 21)
    if "detection_out" in net.blobs:
        assert net.shapes["detection_out"][-1] == 7
    if "mbox_loss" in net.blobs:
        assert net.shapes["mbox_loss"] == ()
