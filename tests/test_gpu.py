"""The device switch (tests/conftest.py), the CUDA graphs (brewnet/solvers/cuda_graph.py, lean on
CUDA) and the prepared GPU run (benchmarks/gpu.sh). Without a GPU: the switch's refusal, its skip
logic under a CUDA that is only pretended (nothing runs on it), and the script's one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ON_DEVICE

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False here)")
# Pretends CUDA is there (torch.version.cuda, is_available) for conftest's checks; loaded with -p
# before the conftest, so a run under it shows what the switch selects, without running on it.
FAKE_CUDA = "import torch\ntorch.version.cuda = '12.8'\ntorch.cuda.is_available = lambda: True\n"


def pytest_run(args, tmp_path, device="cuda", plugin: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["BREWNET_TEST_DEVICE"] = device
    if plugin:
        (tmp_path / "fake_cuda.py").write_text(plugin)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
        args = ["-p", "fake_cuda", *args]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(CUDA, reason="tests the refusal where CUDA is missing")
def test_the_switch_without_cuda_is_one_clear_error(tmp_path):
    r = pytest_run(["tests/test_gpu.py"], tmp_path)
    assert r.returncode == 4, r.stdout + r.stderr            # pytest's usage error: nothing ran
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert lines and lines[0].startswith("ERROR: BREWNET_TEST_DEVICE=cuda: ")
    assert "nothing was run" in lines[0] and "passed" not in r.stdout


def test_a_bad_switch_value_is_a_usage_error(monkeypatch):
    from conftest import device_name

    monkeypatch.setenv("BREWNET_TEST_DEVICE", "gpu")
    with pytest.raises(pytest.UsageError, match=r"BREWNET_TEST_DEVICE='gpu': expected cpu or cuda"):
        device_name()


@pytest.mark.skipif(ON_DEVICE, reason="runs pytest itself under a pretended CUDA")
def test_the_switch_skips_the_cpu_tests_with_one_reason(tmp_path):
    """Under the switch a module outside conftest.DEVICE_MODULES is skipped whole, with one
    reason; a device module's tests run, and the session's default device is cuda:0, TF32 off."""
    r = pytest_run(["-rs", "tests/test_fillers.py",
                    "tests/test_gpu.py::test_the_switch_sets_the_session_up"], tmp_path,
                   plugin=FAKE_CUDA)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "1 passed" in out and " skipped" in out and "failed" not in out
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert skips and all("tests/test_fillers.py" in ln and "not a device parity test" in ln
                         for ln in skips)


@pytest.mark.skipif(not ON_DEVICE, reason="checks the session the switch set up")
def test_the_switch_sets_the_session_up():
    from brewnet import runtime

    assert runtime.default_device() == torch.device("cuda", 0)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


@pytest.mark.skipif(CUDA, reason="tests the line printed where CUDA is missing")
def test_gpu_script_without_a_gpu_says_so_in_one_line():
    r = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1 and not r.stderr
    assert r.stdout.startswith("gpu.sh: no CUDA GPU on this machine (") and "nothing run" in r.stdout


def test_gpu_script_counts_a_pytest_run_cut_off_or_finished():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import parity_counts

    assert parity_counts("....F.s\n== 5 passed, 1 failed, 1 skipped in 3.2s ==") == \
        {"passed": 5, "failed": 1, "skipped": 1}
    cut = "........s..F  [ 40%]\n.......E"
    assert parity_counts(cut) == {"passed": 17, "failed": 1, "skipped": 1, "errors": 1}


# -- on a GPU ----------------------------------------------------------------------------
@needs_cuda
def test_captured_graph_replays_new_inputs_bit_for_bit():
    from brewnet.solvers.cuda_graph import CapturedGraph

    w = torch.randn(64, 32, device="cuda")

    def f(x):
        return (torch.relu(x @ w.t()).sum(0),)

    g = CapturedGraph(f, [torch.randn(16, 32, device="cuda")])
    for seed in range(3):
        x = torch.randn(16, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(g([x])[0], f(x)[0])
    w.mul_(2)                                   # params are read where they live
    assert torch.equal(g([x])[0], f(x)[0])


DEPLOY = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 10 dim: 10 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
"""


@needs_cuda
def test_lean_inference_on_cuda_is_a_checked_cuda_graph(monkeypatch):
    import brewnet
    from brewnet import lean
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto import parse_text

    monkeypatch.setattr(lean, "AFTER", 1)
    monkeypatch.setenv("BREWNET_LEAN", "1")      # asked for (cuda_graph.DEFAULT_ON_CUDA)
    net = brewnet.Net(parse_text(DEPLOY, pb.NetParameter()), brewnet.TEST, device="cuda:0")
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((2, 3, 10, 10)).astype(np.float32) for _ in range(3)]
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        plain = [net.forward(data=x)["prob"].copy() for x in xs]
    net.forward(data=xs[0])
    for x, want in zip(xs, plain):
        got = net.forward(data=x)["prob"]
        assert net._lean.captured is not None
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    net.params["ip1"][0].data[...] *= 2          # surgery: seen (the same memory, in place)
    with monkeypatch.context() as m:
        m.setenv("BREWNET_LEAN", "0")
        want = net.forward(data=xs[0])["prob"].copy()
    np.testing.assert_allclose(net.forward(data=xs[0])["prob"], want, rtol=1e-5, atol=1e-7)
