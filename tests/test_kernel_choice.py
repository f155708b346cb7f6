"""Kernels chosen per shape (brewnet/execution/kernel_choice.py): each InnerProduct candidate
against the golden cases, float64 and a float64 gradient check, its bits on 1, 2 and 4 threads,
one op in a recorded step; the choice measured once, shared through the cache by two processes
started together, pinned in deterministic mode; a corrupt or stale cache a warning and rebuilt."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet as caffe
from brewnet import layers as L
from brewnet.execution import determinism, kernel_choice, recording
from brewnet.layers import functional as Fn
from helpers import random_digits_lmdb
from test_golden_layers import CASES
from test_golden_layers import test_golden_layer as golden_case
from test_merge import params_of, solver, with_data

pytestmark = pytest.mark.skipif(kernel_choice.dnn_linear() is None, reason="torch without oneDNN")
ROOT = Path(__file__).resolve().parents[1]
IP_CASES = [c for c in CASES if c["type"] == "InnerProduct"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, and no choice of this process remembered."""
    monkeypatch.setenv("BREWNET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_choice, "_chosen", {})
    monkeypatch.setattr(kernel_choice, "_unread", set())
    monkeypatch.setattr(kernel_choice, "MEASURE_S", 0.05)
    return tmp_path / "cache" / "kernels.json"


@pytest.mark.parametrize("kernel", kernel_choice.KERNELS)
@pytest.mark.parametrize("case", IP_CASES, ids=[c["file"] for c in IP_CASES])
def test_each_candidate_gives_caffes_golden_numbers(case, kernel, monkeypatch):
    monkeypatch.setattr(Fn, "DNN_MIN_WEIGHT", 0)          # the golden cases are small
    monkeypatch.setenv("BREWNET_IP_KERNEL", kernel)
    seen = []
    for name in ("_DnnInnerProduct", "MklInnerProduct"):
        cls = getattr(kernel_choice, name)
        orig = cls.apply
        monkeypatch.setattr(cls, "apply", lambda *a, _o=orig, _n=name: seen.append(_n) or _o(*a))
    golden_case(case)
    assert seen and set(seen) == {"MklInnerProduct" if kernel == "mkl" else "_DnnInnerProduct"}


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("kernel", kernel_choice.KERNELS)
def test_each_candidate_near_float64_and_same_bits_on_1_2_4_threads(kernel, transpose):
    m, k, n = 13, 600, 500
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(*((k, n) if transpose else (n, k)), generator=gen) * 0.1
    b, dy = torch.randn(n, generator=gen), torch.randn(m, n, generator=gen)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    y64 = xd @ (wd if transpose else wd.t()) + bd
    ref = (y64, *torch.autograd.grad(y64, (xd, wd, bd), dy.double()))
    got = {}
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        determinism.blas_on_one_thread()
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = kernel_choice.APPLY[kernel](xs, ws, bs, transpose)
        got[threads] = (y.detach(), *torch.autograd.grad(y, (xs, ws, bs), dy))
    torch.set_num_threads(2)
    for a, c in zip(got[1], ref):
        np.testing.assert_allclose(a.numpy(), c.detach().numpy(), rtol=0,
                                   atol=1e-5 * c.abs().max().item())
    for threads in (2, 4):
        assert all(torch.equal(a, c) for a, c in zip(got[1], got[threads])), threads


def test_mkl_candidate_float64_gradient_check():
    gen = torch.Generator().manual_seed(0)
    for transpose in (False, True):
        x = torch.randn(4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.randn(*((6, 5) if transpose else (5, 6)), dtype=torch.float64, generator=gen,
                        requires_grad=True)
        b = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda x, w, b, t=transpose: kernel_choice.MklInnerProduct.apply(x, w, b, t),
            (x, w, b))


def test_mkl_inner_product_is_one_op_in_a_recording_and_replays_on_any_thread_count(monkeypatch):
    monkeypatch.setenv("BREWNET_IP_KERNEL", "mkl")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 800, generator=gen)
    w = (torch.randn(500, 800, generator=gen) * 0.05).requires_grad_()

    def step(x):
        w.grad = None
        Fn.inner_product(x, w, None).square().sum().backward()
        return (w.grad,)

    eager = step(x)[0].clone()
    gm = recording.record(step, [x])
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"brewnet.ip_mkl.default", "brewnet.ip_mkl_backward.default"} <= ops
    for n in (1, 2, 4):
        torch.set_num_threads(n)
        assert torch.equal(gm(x)[0], eager)
    torch.set_num_threads(2)


def test_choice_measured_once_cached_and_read_at_calls(cache, caplog):
    with caplog.at_level(logging.INFO, logger="brewnet"):
        assert kernel_choice.choose(8, 600, 500, False, measure_missing=False) == "onednn"
        assert not cache.exists()                      # a call never measures
        got = kernel_choice.choose(8, 600, 500, False)
    entry = next(iter(json.loads(cache.read_text())["choices"].values()))
    assert entry["kernel"] == got and set(entry["ms"]) == set(kernel_choice.KERNELS)
    assert entry["key"]["shape"] == [8, 600, 500, False] and "cpu" in entry["key"]
    assert "torch" in entry["key"]["versions"]
    assert sum("inner product [8, 600, 500, False]: kernel" in r.message for r in caplog.records) == 1
    kernel_choice._chosen.clear()
    kernel_choice._unread.clear()
    entry["kernel"] = "mkl" if got == "onednn" else "onednn"      # the cache wins over measuring
    cache.write_text(json.dumps({"format": kernel_choice.FORMAT,
                                 "choices": {kernel_choice._digest(entry["key"]): entry}}))
    assert kernel_choice.choose(8, 600, 500, False, measure_missing=False) == entry["kernel"]


def test_choice_pinned_in_deterministic_mode_and_by_the_switch(cache, monkeypatch):
    monkeypatch.setitem(determinism._state, "on", True)
    assert kernel_choice.choose(8, 600, 500, False) == kernel_choice.RULE
    assert not cache.exists()
    monkeypatch.setitem(determinism._state, "on", False)
    monkeypatch.setenv("BREWNET_IP_KERNEL", "mkl")
    assert kernel_choice.choose(8, 600, 500, False) == "mkl"
    monkeypatch.setenv("BREWNET_IP_KERNEL", "fast")
    with pytest.raises(ValueError, match="BREWNET_IP_KERNEL='fast'"):
        kernel_choice.choose(8, 600, 500, False)


@pytest.mark.parametrize("content, said", [
    ("{not json", "corrupt"), ('{"format": 1, "choices": []}', "corrupt"),
    ('{"format": 0, "choices": {}}', "stale"), (None, "names no known kernel")])
def test_a_corrupt_or_stale_cache_is_one_warning_and_rebuilt(cache, caplog, content, said):
    cache.parent.mkdir(parents=True)
    if content is None:                  # an entry of this key naming a kernel that is not one
        k = kernel_choice.key(8, 600, 500, False)
        content = json.dumps({"format": kernel_choice.FORMAT, "choices": {
            kernel_choice._digest(k): {"key": k, "kernel": "fast", "ms": {}}}})
    cache.write_text(content)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        got = kernel_choice.choose(8, 600, 500, False)
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and said in warned[0] and str(cache) in warned[0], warned
    data = json.loads(cache.read_text())
    assert data["format"] == kernel_choice.FORMAT
    assert [e["kernel"] for e in data["choices"].values()] == [got]


def test_a_choice_that_cannot_be_kept_is_the_rules(cache, monkeypatch, caplog):
    """An unwritable cache: every process would measure anew and might differ, so the rule."""
    monkeypatch.setattr(kernel_choice, "measure", lambda *a: {"kernel": "mkl", "ms": {},
                                                             "threads": 1})
    monkeypatch.setattr(kernel_choice.engine_cache, "write_atomic", lambda path, data: None)
    with caplog.at_level(logging.WARNING, logger="brewnet"):
        assert kernel_choice.choose(8, 600, 500, False) == kernel_choice.RULE
    assert any("could not be kept" in r.message for r in caplog.records)


CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from brewnet.execution import kernel_choice
kernel_choice.MEASURE_S = 0.3
print("CHOSE", kernel_choice.choose(16, 700, 600, False))
"""


def test_two_processes_started_together_measure_once_and_take_the_same_kernel(tmp_path):
    env = dict(os.environ, BREWNET_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    chose = [[ln for ln in o.splitlines() if ln.startswith("CHOSE")] for o in outs]
    assert len(chose[0]) == 1 and chose[0] == chose[1], outs
    assert sum(o.count("kept in") for o in outs) == 1, outs


def mlp(lmdb, batch):
    n = caffe.NetSpec()
    n.data, n.label = L.Input(ntop=2)
    n.ip1 = L.InnerProduct(n.data, num_output=400, weight_filler=dict(type="xavier"))
    n.relu = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    body = n.to_proto()
    del body.layer[0]
    return with_data(body, lmdb, batch)


def test_a_net_trained_with_each_kernel_same_bits_on_1_and_2_threads(tmp_path, monkeypatch, cache):
    """An MLP whose ip1 (784 x 400) has the choice, the step graph on from the first iteration:
    1 and 2 threads the same weights with each kernel, the two kernels within rounding."""
    lmdb = random_digits_lmdb(tmp_path / "digits", 64, 28, seed=5)
    net = mlp(lmdb, 16)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    got = {}
    for kernel in kernel_choice.KERNELS:
        for n in (1, 2):
            monkeypatch.setenv("BREWNET_IP_KERNEL", kernel)
            monkeypatch.setenv("BREWNET_THREADS", str(n))
            s, _ = solver(tmp_path, f"{kernel}{n}", net, seed=4, momentum=0.9, iters=6)
            s.step(6)
            got[kernel, n] = params_of(s.net)
            graph = getattr(s, "_graph", None)
            assert graph is not None and graph.gm is not None     # replayed past iteration 1
            ops = {str(node.target) for node in graph.gm.graph.nodes}
            assert ("brewnet.ip_mkl_backward.default" in ops) == (kernel == "mkl")
    for layer, want in got["onednn", 1].items():
        for kernel in kernel_choice.KERNELS:
            for a, b, c in zip(got[kernel, 1][layer], got[kernel, 2][layer], want):
                assert a.tobytes() == b.tobytes(), (kernel, layer)
                np.testing.assert_allclose(a, c, rtol=0, atol=1e-4 * np.abs(c).max())
