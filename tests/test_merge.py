"""nideep's merge (``brewnet.merge_indep_net_spec``): the seed flow with pycaffe's names, merged
training bitwise equal to training each net alone, nideep's text, and what brewnet adds (param
names stay per net, in-place layers on data, differing data layers refused)."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import brewnet as caffe
from brewnet import layers as L
from brewnet import params as P
from brewnet.cli import main
from brewnet.many.merge import MergeError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_net
from helpers import random_digits_lmdb


@pytest.fixture
def lmdb(tmp_path):
    return random_digits_lmdb(tmp_path / "digits_lmdb", 48, 8, seed=12)


def data_layers(lmdb, batch):
    """The train and test data layers, as the notebook writes them: the TEST layer's name and
    tops fixed to the train layer's (NetSpec names a layer after its first top)."""
    out = []
    for phase in (caffe.TRAIN, caffe.TEST):
        n = caffe.NetSpec()
        n.data, n.label = L.Data(batch_size=batch, backend=P.Data.LMDB, source=lmdb, ntop=2,
                                 transform_param=dict(scale=1. / 255), include=dict(phase=phase))
        layer = n.to_proto().layer[0]
        layer.name = "data"
        out.append(layer)
    return out


def with_data(body, lmdb, batch=8):
    net = pb.NetParameter(name="seed")
    net.layer.extend(data_layers(lmdb, batch))
    net.layer.extend(body.layer)
    return net


def ip_net(lmdb, batch=8):
    n = caffe.NetSpec()
    n.data, n.label = L.Input(ntop=2)           # placeholders: the real data layers go first
    n.ip = L.InnerProduct(n.data, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip, n.label)
    body = n.to_proto()
    del body.layer[0]
    return with_data(body, lmdb, batch)


def conv_net(lmdb, batch=8, filters=4, kernel=3):
    n = caffe.NetSpec()
    n.data, n.label = L.Input(ntop=2)
    n.conv = L.Convolution(n.data, num_output=filters, kernel_size=kernel,
                           weight_filler=dict(type="xavier"))
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.ip = L.InnerProduct(n.pool, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip, n.label)
    body = n.to_proto()
    del body.layer[0]
    return with_data(body, lmdb, batch)


def mlp_two_losses(lmdb, batch=8):
    n = caffe.NetSpec()
    n.data, n.label = L.Input(ntop=2)
    n.ip1 = L.InnerProduct(n.data, num_output=16, weight_filler=dict(type="xavier"))
    n.relu = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    n.ip3 = L.InnerProduct(n.relu, num_output=10, weight_filler=dict(type="gaussian", std=0.1),
                           param=[dict(name="ip3_w"), dict(lr_mult=2)])
    n.loss_b = L.SoftmaxWithLoss(n.ip3, n.label, loss_weight=0.5)
    body = n.to_proto()
    del body.layer[0]
    return with_data(body, lmdb, batch)


SOLVER = """net: "{net}" base_lr: 0.05 lr_policy: "fixed" momentum: {momentum} weight_decay: 0.0005
test_iter: 2 test_interval: {iters} max_iter: {iters} display: 0 snapshot: 0
random_seed: {seed} snapshot_prefix: "{prefix}" solver_mode: CPU"""


def solver(tmp_path, name, net, seed, momentum=0.0, iters=5):
    net_file = tmp_path / f"{name}.prototxt"
    net_file.write_text(text_format.MessageToString(net))
    solver_file = tmp_path / f"{name}_solver.prototxt"
    solver_file.write_text(SOLVER.format(net=net_file, momentum=momentum, iters=iters, seed=seed,
                                         prefix=tmp_path / name))
    return caffe.SGDSolver(str(solver_file)), net_file


def params_of(net, suffix=""):
    """{layer: [blob arrays]} for the layers with params (without the suffix in the names)."""
    return {k[:len(k) - len(suffix)] if suffix else k: [b.data.copy() for b in v]
            for k, v in net.params.items() if k.endswith(suffix)}


def train_alone_then_merged(tmp_path, nets, iters, momentum):
    alone, initial, files = [], [], []
    for i, net in enumerate(nets):
        s, f = solver(tmp_path, f"n{i}", net, seed=100 + i, momentum=momentum, iters=iters)
        initial.append(params_of(s.net))
        s.step(iters)
        alone.append(params_of(s.net))
        files.append(f)
    parsed = [read_net(str(f)) for f in files]
    merged_text = caffe.merge_indep_net_spec(parsed)
    m, _ = solver(tmp_path, "merged", text_format.Parse(merged_text, pb.NetParameter()), seed=7,
                  momentum=momentum, iters=iters)
    for i, init in enumerate(initial):
        for layer, blobs in init.items():
            for dst, src in zip(m.net.params[f"{layer}_nidx_{i:02d}"], blobs):
                dst.data[...] = src
    m.step(iters)
    return alone, [params_of(m.net, f"_nidx_{i:02d}") for i in range(len(nets))], initial


def assert_bitwise(alone, merged):
    for a, b in zip(alone, merged):
        assert a.keys() == b.keys()
        for layer in a:
            for x, y in zip(a[layer], b[layer]):
                assert x.tobytes() == y.tobytes(), layer


def test_seed_flow_two_ip_nets_merged_equal_alone_bitwise(tmp_path, lmdb):
    alone, merged, initial = train_alone_then_merged(tmp_path, [ip_net(lmdb), ip_net(lmdb)], 5, 0.0)
    assert_bitwise(alone, merged)
    w0, w1 = alone[0]["ip"], alone[1]["ip"]
    assert not np.array_equal(w0[0], w1[0]) and not np.array_equal(w0[1], w1[1])
    assert not np.array_equal(w0[0], initial[0]["ip"][0])       # it trained


def test_three_topologies_with_momentum_seven_steps(tmp_path, lmdb):
    nets = [conv_net(lmdb), mlp_two_losses(lmdb), ip_net(lmdb)]
    alone, merged, initial = train_alone_then_merged(tmp_path, nets, 7, 0.9)
    assert_bitwise(alone, merged)
    assert set(merged[1]) == {"ip1", "ip2", "ip3"}
    for a, i in zip(alone, initial):
        assert any(not np.array_equal(a[k][0], i[k][0]) for k in a)


def nideep_reference(nets):
    """nideep's merge_indep_net_spec as it is written (string concatenation), on copies."""
    nets = [pb.NetParameter.FromString(n.SerializeToString()) for n in nets]
    is_data = lambda t: "data" in t.lower() and "output" not in t.lower()  # noqa: E731
    data_tops = {t for n in nets for l in n.layer if is_data(l.type) for t in l.top}
    text = ""
    for idx, n in enumerate(nets):
        suffix = "_nidx_%02d" % idx
        keep = []
        for l in n.layer:
            if not is_data(l.type):
                l.name += suffix
                l.bottom[:] = [b if b in data_tops else b + suffix for b in l.bottom]
                l.top[:] = [t if t in data_tops else t + suffix for t in l.top]
            elif idx > 0:
                continue
            keep.append(l)
        del n.layer[:]
        n.layer.extend(keep)
        s = text_format.MessageToString(n)
        if idx > 0 and s.startswith("name:"):
            s = s.split("\n", 1)[1]
        text += s
    return text


def test_text_is_nideeps_and_inputs_are_untouched(lmdb):
    nets = [ip_net(lmdb), conv_net(lmdb)]
    nets[1].name = "second"
    before = [n.SerializeToString() for n in nets]
    text = caffe.merge_indep_net_spec(nets)
    assert text == nideep_reference(nets)
    assert [n.SerializeToString() for n in nets] == before
    assert text.startswith('name: "seed"') and text.count("name: \"second\"") == 0
    merged = caffe.merge_nets(nets)
    assert [l.name for l in merged.layer] == ["data", "data", "ip_nidx_00", "loss_nidx_00",
                                              "conv_nidx_01", "pool_nidx_01", "ip_nidx_01",
                                              "loss_nidx_01"]
    assert list(merged.layer[3].bottom) == ["ip_nidx_00", "label"]


def test_param_names_get_the_suffix(lmdb):
    merged = caffe.merge_nets([mlp_two_losses(lmdb)] * 2)
    names = [p.name for l in merged.layer for p in l.param if p.name]
    assert names == ["ip3_w_nidx_00", "ip3_w_nidx_01"]
    net = caffe.Net(merged, caffe.TRAIN)       # two nets, two separate ip3 weights
    assert net.params["ip3_nidx_00"][0].data is not net.params["ip3_nidx_01"][0].data
    net.params["ip3_nidx_00"][0].data[...] = 1
    assert not (net.params["ip3_nidx_01"][0].data == 1).all()


def test_in_place_layer_on_a_data_top_writes_its_own_copy(lmdb):
    net = ip_net(lmdb)
    scale = net.layer.add(name="scale", type="Power", bottom=["data"], top=["data"])
    scale.power_param.scale = 2.0
    net.layer.insert(2, scale)
    del net.layer[-1]
    net.layer[3].bottom[0] = "data"
    merged = caffe.merge_nets([net, ip_net(lmdb)])
    power = next(l for l in merged.layer if l.type == "Power")
    assert list(power.bottom) == ["data"] and list(power.top) == ["data_nidx_00"]
    assert list(merged.layer[3].bottom) == ["data_nidx_00"]       # net 0's ip reads its copy
    assert list(merged.layer[5].bottom) == ["data"]               # net 1's ip, the shared data


def test_differing_data_layers_are_refused_naming_both_nets_and_the_field(lmdb, tmp_path):
    with pytest.raises(MergeError, match=r"net 0 \('seed'\) and 'data' of net 1 \('seed'\) differ "
                                         r"in data_param.batch_size \(8 vs 16\)"):
        caffe.merge_nets([ip_net(lmdb), ip_net(lmdb, batch=16)])
    other = ip_net(lmdb)
    other.layer[0].data_param.source = str(tmp_path / "other")
    with pytest.raises(MergeError, match="differ in data_param.source"):
        caffe.merge_nets([ip_net(lmdb), other])
    other = ip_net(lmdb)
    other.layer[1].include[0].phase = caffe.TRAIN
    with pytest.raises(MergeError, match=r"include\[0\].phase \(1 vs 0\)"):
        caffe.merge_nets([ip_net(lmdb), other])


def test_cli_merge(lmdb, tmp_path, capsys):
    a, b = tmp_path / "a.prototxt", tmp_path / "b.prototxt"
    a.write_text(text_format.MessageToString(ip_net(lmdb)))
    b.write_text(text_format.MessageToString(conv_net(lmdb)))
    out = tmp_path / "m.prototxt"
    assert main(["merge", str(a), str(b), "-o", str(out)]) == 0
    assert read_net(str(out)) == caffe.merge_nets([str(a), str(b)])
    b.write_text(text_format.MessageToString(ip_net(lmdb, batch=4)))
    assert main(["merge", str(a), str(b), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{a}" in err and f"{b}" in err and "data_param.batch_size (8 vs 4)" in err
    assert "Traceback" not in err
