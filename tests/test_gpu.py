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


# What the switch selects in the files that pin no device of their own (the CPU's by default):
# per file, the tests skipped there and the reason's start; every other test runs on cuda:0.
SWITCHED = {
    "test_parallel.py": ({"test_workers_equal_one_process_on_the_combined_batch",
                          "test_brewnet_train_workers_and_torchrun",
                          "test_a_killed_worker_stops_the_others_naming_it",
                          "test_resume_auto_after_a_kill_ends_bitwise_as_the_uninterrupted_run",
                          "test_pycaffe_train_py_flow",
                          "test_a_rendezvous_that_never_completes_stops_in_bounded_time",
                          "test_a_hung_worker_stops_the_others_within_the_timeout"},
                         "CPU only: several workers on one GPU"),
    "test_fused.py": (set(), ""),
    "test_fusion.py": (set(), ""),
    "test_together.py": ({"test_worker_count_by_net_size"},
                         "CPU only: the worker-thread count follows the CPU's cores"),
    "test_serve.py": (set(), ""),
    "test_lean.py": ({"test_lean_inference_default_and_override",
                      "test_lean_forward_matches_and_keeps_blob_semantics",
                      "test_nhwc_weights_are_bit_identical_and_follow_surgery"}, "CPU only: "),
    "test_models.py": (set(), ""),
    "test_pycaffe.py": (set(), ""),
    "test_pycaffe_extras.py": (set(), ""),
}
# Appended to FAKE_CUDA: after conftest has marked the items, write what would run or skip and
# why, and run nothing.
COLLECTION_REPORT = """
import json, os, pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    import helpers
    out = {"device": str(helpers.DEVICE), "items": []}
    for item in items:
        why = next((m.kwargs.get("reason") or (m.args[0] if m.args else "")
                    for m in item.iter_markers("skip")), None)
        if why is None:
            why = next((m.kwargs.get("reason") for m in item.iter_markers("skipif")
                        if m.args and m.args[0]), None)
        out["items"].append([item.path.name, item.originalname, why])
    with open(os.environ["FAKE_CUDA_REPORT"], "w") as f:
        json.dump(out, f)
    items[:] = []
"""


@pytest.mark.skipif(ON_DEVICE, reason="collects pytest itself under a pretended CUDA")
def test_the_switch_runs_or_skips_each_file_with_one_reason(tmp_path, monkeypatch):
    """The switch over the files whose tests once pinned the CPU: collected under a pretended
    CUDA (nothing runs), each test either runs (on cuda:0: helpers.DEVICE) or skips with its
    file's one reason; a file outside conftest.DEVICE_MODULES skips whole."""
    import json

    from conftest import DEVICE_MODULES, NOT_DEVICE

    report = tmp_path / "report.json"
    monkeypatch.setenv("FAKE_CUDA_REPORT", str(report))
    files = [f"tests/{f}" for f in SWITCHED] + ["tests/test_fillers.py"]
    r = pytest_run(["--collect-only", *files], tmp_path, plugin=FAKE_CUDA + COLLECTION_REPORT)
    assert r.returncode in (0, 5), r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["device"] == "cuda:0"
    by_file: dict = {}
    for name, test, why in got["items"]:
        by_file.setdefault(name, []).append((test, why))
    assert all(why == NOT_DEVICE for _, why in by_file.pop("test_fillers.py"))
    for name, (skipped, reason) in SWITCHED.items():
        assert name in DEVICE_MODULES
        if name == "test_models.py" and name not in by_file:     # no shared data: skipped whole
            continue
        tests = by_file[name]
        assert {t for t, why in tests if why} == skipped, name
        assert all(why.startswith(reason) for t, why in tests if why), name
        assert any(why is None for _, why in tests), name


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
