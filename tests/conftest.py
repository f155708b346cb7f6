"""The device switch: ``BREWNET_TEST_DEVICE=cuda python -m pytest tests`` runs the device parity
tests on ``cuda:0`` and skips the rest, each with one reason.

With the switch on, brewnet's default device (pycaffe's mode, ``runtime.set_default_device``)
is ``cuda:0`` for the whole session, so every Net and Solver a test builds without naming a
device lands there, and TF32 is off (``runtime.configure``: Caffe computes in IEEE float32).
CUDA's kernels are held to their deterministic forms (``torch.use_deterministic_algorithms``,
warn-only; cuBLAS's fixed workspace): the tests that compare two runs on one device bit for bit
(together or fused against alone, a graph against the eager step, a resumed run) need the same
run to give the same bits twice, which atomics in cuDNN's and scatter's backward do not.
Subprocesses a test starts (servers, data-parallel workers) get the device from their flags.
Tests that build layers, tensors or feeds themselves use ``helpers.DEVICE``; the float32
tolerances a GPU needs beyond the CPU's are in ``helpers.DEVICE_TOLERANCES`` with the reason per
kind. Without CUDA the switch stops the run with one line: a run that silently stayed on the CPU
would report a GPU parity it never tested.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Vendored third-party code (Caffe's own pycaffe tests) runs through brewnet run in test_dropin.py.
collect_ignore = ["data"]

SWITCH = "BREWNET_TEST_DEVICE"
# The device parity tests, by module: what each proves on a device. A module not listed here
# tests the CPU (its kernels, its allocator, files, the CLI's text...) and is skipped whole;
# a test in a listed module that cannot run on a device carries @pytest.mark.cpu_only(reason).
DEVICE_MODULES = {
    "test_golden_layers.py": "the golden layer cases from the real Caffe, forward and backward",
    "test_solvers.py": "the golden solver runs and the update rules",
    "test_models.py": "the real models (Caffe's and the forks' nets) against their golden outputs",
    "test_pycaffe.py": "the pycaffe Net API",
    "test_lean.py": "lean inference against the plain forward",
    "test_step_graph.py": "the recorded step (a CUDA graph there) against the eager step",
    "test_parallel.py": "data parallel on one device",
    "test_fused.py": "fused training of K nets",
    "test_together.py": "K nets trained together on one data stream",
    "test_serve.py": "brewnet serve",
    "test_video.py": "video inference",
    "test_gpu.py": "the device switch and the CUDA graphs themselves",
    "test_graph_update.py": "the recorded update (one CUDA graph with the step there) against "
                            "the eager update",
    "test_fusion.py": "inference folding of Convolution/BatchNorm/Scale",
    "test_pycaffe_extras.py": "pycaffe beyond the Net basics (Python layers, NetSpec, forward_all)",
}
NOT_DEVICE = ("not a device parity test (tests/conftest.py DEVICE_MODULES lists those); "
              "it tests CPU-side behaviour")


def device_name() -> str:
    value = os.environ.get(SWITCH, "").strip() or "cpu"
    if value not in ("cpu", "cuda"):
        raise pytest.UsageError(f"{SWITCH}={value!r}: expected cpu or cuda")
    return value


def cuda_missing() -> str | None:
    """Why the CUDA switch cannot run here (None: it can)."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (driver missing or CUDA_VISIBLE_DEVICES empty)"
    return None


_MADE: list[str] = []      # the engine cache folder this process made (removed at the end)


def pytest_configure(config):
    # the engine cache (brewnet/execution/engine_cache.py): this run's own, never the user's;
    # xdist's workers inherit the variable, so the controller alone makes and removes it
    # (its ONNX files are 1-3 GB a full run: 681 such folders had filled this machine's /tmp)
    if "BREWNET_CACHE_DIR" not in os.environ:
        os.environ["BREWNET_CACHE_DIR"] = tempfile.mkdtemp(prefix="brewnet-test-cache-")
        _MADE.append(os.environ["BREWNET_CACHE_DIR"])
    config.addinivalue_line("markers", "cpu_only(reason): in a device module, a test that "
                            "cannot run on a device (skipped under BREWNET_TEST_DEVICE=cuda)")
    if device_name() != "cuda":
        return
    why = cuda_missing()
    if why:
        raise pytest.UsageError(f"{SWITCH}=cuda: {why}; nothing was run (unset it for the CPU)")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before cuBLAS starts
    from brewnet import runtime

    runtime.set_default_device(True, 0)
    runtime.configure("cuda:0")
    import torch

    torch.backends.cudnn.benchmark = False      # no timed algorithm choice: the same run twice
    torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_unconfigure(config):
    for folder in _MADE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_report_header(config):
    return f"brewnet test device: {device_name()} ({SWITCH})"


def pytest_collection_modifyitems(config, items):
    if device_name() != "cuda":
        return
    skip = pytest.mark.skip(reason=NOT_DEVICE)
    for item in items:
        if item.path.name not in DEVICE_MODULES:
            item.add_marker(skip)
            continue
        mark = item.get_closest_marker("cpu_only")
        if mark is not None:
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {mark.args[0]}"))


@pytest.fixture(autouse=True)
def _keep_the_switch_device():
    """A test that calls pycaffe's set_mode_cpu() must not move the rest of the session."""
    yield
    if device_name() == "cuda":
        from brewnet import runtime

        runtime.set_default_device(True, 0)
