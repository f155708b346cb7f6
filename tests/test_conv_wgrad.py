"""A convolution's weight gradient in chunks (brewnet/execution/wgrad.py): the same bits on 1, 2
and 4 threads for each kernel and shape family, float64's numbers within tolerance, one op in a
recorded step, and a real net trained past the switch against the previous per-image path."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

import brewnet  # noqa: F401
from brewnet.execution import determinism, recording, wgrad
from brewnet.layers.functional import conv_nd
from helpers import random_digits_lmdb
from test_merge import conv_net, params_of, solver

# (x, w, stride, pad, dilation, groups): plain, strided + padded, grouped, depthwise, 1x1,
# dilated, an odd batch (uneven chunks), a batch of one
FAMILIES = {
    "plain": ((16, 3, 20, 20), (8, 3, 5, 5), 1, 0, 1, 1),
    "strided": ((10, 3, 39, 39), (12, 3, 7, 7), 4, 2, 1, 1),
    "grouped": ((8, 16, 13, 13), (24, 8, 3, 3), 1, 1, 1, 2),
    "depthwise": ((8, 16, 28, 28), (16, 1, 3, 3), 1, 1, 1, 16),
    "pointwise": ((8, 32, 14, 14), (64, 32, 1, 1), 1, 0, 1, 1),
    "dilated": ((8, 8, 20, 20), (8, 8, 3, 3), 1, 2, 2, 1),
    "odd batch": ((13, 20, 12, 12), (50, 20, 5, 5), 1, 0, 1, 1),
    "batch of one": ((1, 8, 30, 30), (8, 8, 3, 3), 1, 1, 1, 1),
}


def case(name, channels_last=False):
    xs, ws, s, p, d, g = FAMILIES[name]
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen)
    with torch.no_grad():
        dy = torch.randn(torch.nn.functional.conv2d(x, w, None, s, p, d, g).shape, generator=gen)
    if channels_last:
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    return dy, x, w, (s, s), (p, p), (d, d), g


def at_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernel", wgrad.KERNELS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_kernel_same_bits_on_1_2_4_threads_and_float64_within_tolerance(family, kernel):
    dy, x, w, s, p, d, g = case(family, channels_last=family == "grouped")
    k = wgrad.chunks(x.shape, w.shape, dy.shape[2:])
    runs = [at_threads(n, lambda: torch.ops.brewnet.conv2d_weight_grad(
        dy, x, w, list(s), list(p), list(d), g, kernel, k)) for n in (1, 2, 4)]
    for gw, gb in runs[1:]:
        assert torch.equal(gw, runs[0][0]) and torch.equal(gb, runs[0][1])
    _, rw, rb = determinism.onednn_backward(dy.double(), x.double(), w.double(), s, p, d, g,
                                            [False, True, True])
    gw, gb = runs[0]
    assert (gw.double() - rw).abs().max() <= 1e-5 * rw.abs().max()
    assert (gb.double() - rb).abs().max() <= 1e-5 * rb.abs().max()


def test_chunks_follow_the_shape_and_the_machines_cores_not_the_threads(monkeypatch):
    assert wgrad.bounds(13, 4) == [0, 4, 7, 10, 13]
    shape = ((64, 1, 28, 28), (20, 1, 5, 5), (24, 24))
    got = {at_threads(n, lambda: wgrad.chunks(*shape)) for n in (1, 2, 4)}
    assert got == {min(wgrad.MAX_CHUNKS, os.cpu_count())}
    for cores, k in ((1, 1), (2, 2), (6, 6), (64, wgrad.MAX_CHUNKS)):
        monkeypatch.setattr(wgrad, "CORES", cores)
        assert {at_threads(n, lambda: wgrad.chunks(*shape)) for n in (1, 2, 4)} == {k}
    assert wgrad.chunks((4, 1, 4, 4), (1, 1, 3, 3), (2, 2)) == 1       # tiny: one chunk


def test_choice_once_per_shape_logged_and_pinned_in_deterministic_mode(caplog, monkeypatch):
    dy, x, w, s, p, d, g = case("pointwise")
    monkeypatch.setattr(determinism, "onednn_invariant", lambda *a: False)
    with caplog.at_level(logging.INFO, logger="brewnet"):
        first = wgrad.choose(x[:7], w, s, p, d, g)         # a shape no other test chose
        assert wgrad.choose(x[:7], w, s, p, d, g) == first
    lines = [r.getMessage() for r in caplog.records if "weight gradient by" in r.getMessage()]
    assert len(lines) == 1 and "oneDNN's bits differ" in lines[0]
    # untimed: two processes (a loaded CI's train.py and brewnet train) must choose alike
    assert first == ("chunks/onednn", wgrad.chunks(x[:7].shape, w.shape, dy.shape[2:]))
    monkeypatch.setattr(determinism, "onednn_invariant", lambda *a: True)
    assert wgrad.choose(x[:6], w, s, p, d, g) == ("oneDNN", 1)   # its bits held on every count
    monkeypatch.setitem(determinism._state, "on", True)
    assert wgrad.choose(x[:5], w, s, p, d, g) == ("per-image", 1)


def test_conv_backward_in_a_recording_replays_the_chunks_on_any_thread_count(monkeypatch):
    """The chunks are one op: a recorded step's replay runs them again, one thread each."""
    _, x, w, s, p, d, g = case("plain")
    w = w.requires_grad_()
    monkeypatch.setenv("BREWNET_CONV_WGRAD", "onednn")      # the chunks whatever oneDNN does

    def step(x):
        w.grad = None
        conv_nd(x, w, None, s, p, d, g).square().sum().backward()
        return (w.grad,)

    eager = step(x)[0].clone()
    gm = recording.record(step, [x])
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "brewnet.conv2d_weight_grad.default" in ops
    for n in (1, 2, 4):
        assert torch.equal(at_threads(n, lambda: gm(x)[0]), eager)


def test_a_real_net_past_the_switch_same_bits_on_1_and_2_threads_near_the_per_image_path(
        tmp_path, monkeypatch):
    """LeNet's first layers trained with the step graph on from the first iteration, as a user
    gets them (``auto``) and with every convolution in chunks: 1 and 2 threads give the same
    weights, and the previous path (per-image where oneDNN's bits differ) the same within
    float32's rounding."""
    lmdb = random_digits_lmdb(tmp_path / "digits", 64, 28, seed=5)
    net = conv_net(lmdb, 16, 20, 5)
    monkeypatch.setenv("BREWNET_STEP_GRAPH", "1")
    got = {}
    for how in ("auto", "onednn", "old"):
        for n in (1, 2):
            monkeypatch.setenv("BREWNET_CONV_WGRAD", how)
            monkeypatch.setenv("BREWNET_THREADS", str(n))
            s, _ = solver(tmp_path, f"{how}{n}", net, seed=4, momentum=0.9, iters=6)
            s.step(6)
            got[how, n] = params_of(s.net)
            graph = getattr(s, "_graph", None)
            assert graph is not None and graph.gm is not None     # replayed past iteration 1
            if how == "onednn":
                assert "brewnet.conv2d_weight_grad.default" in {
                    str(node.target) for node in graph.gm.graph.nodes}
    for layer, want in got["old", 2].items():
        for how in ("auto", "onednn"):
            for a, b, c in zip(got[how, 1][layer], got[how, 2][layer], want):
                assert a.tobytes() == b.tobytes(), (how, layer)
                np.testing.assert_allclose(a, c, rtol=0, atol=1e-4 * np.abs(c).max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_nhwc_weight_copied_once_same_bits_as_torch_converting_it(family):
    """On NHWC activations the training convolution hands oneDNN the weight's NHWC copy, made
    once in the forward and kept for the backward (torch made it in the forward, the input and
    the weight gradient, as the previous code called them): the output and the three gradients
    keep those calls' bits."""
    dy, x, w, s, p, d, g = case(family, channels_last=True)
    b = torch.randn(w.shape[0])
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    y = conv_nd(xg, wg, bg, s, p, d, g)
    saved_w = y.grad_fn.saved_tensors[1]
    assert saved_w.is_contiguous(memory_format=torch.channels_last) and torch.equal(saved_w, w)
    y.backward(dy)
    with torch.no_grad():
        ref_y = torch.nn.functional.conv2d(x, w, b, s, p, d, g)
    ref_dx = determinism.onednn_backward(dy, x, w, s, p, d, g, [True, False, False])[0]
    ref_dw, ref_db = wgrad.weight_grad(dy, x, w, s, p, d, g)
    for got, ref in ((y, ref_y), (xg.grad, ref_dx), (wg.grad, ref_dw), (bg.grad, ref_db)):
        assert torch.equal(got.detach(), ref)
