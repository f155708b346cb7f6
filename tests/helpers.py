"""Shared test helpers: build one layer from text, check its gradient in float64."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from google.protobuf import text_format

from brewnet.layers import create_layer
from brewnet.proto import caffe_pb2 as pb

# The shared data (default: ../shared next to the checkout). Small text and golden data are also
# vendored under tests/data (see its README); the large artefacts are only here.
SHARED = Path(os.environ.get("BREWNET_SHARED") or Path(__file__).resolve().parents[2] / "shared")
VENDORED = Path(__file__).resolve().parent / "data"


def pick(rel: str) -> Path:
    """SHARED/rel when it exists (so a golden set dropped there, e.g. a hidden one, is the one
    tested), else the vendored copy."""
    return SHARED / rel if (SHARED / rel).exists() else VENDORED / rel


GOLDEN = SHARED / "golden"              # lmdb/ and models/: large, shared only
GOLDEN_LAYERS = pick("golden/layers")
GOLDEN_SOLVERS = pick("golden/solvers")
GOLDEN_NETS = pick("golden/nets")
MODELS = pick("caffe-models")           # vendored: the .prototxt files (not vgg/, densenet/)
_GROUPS = ("golden/lmdb", "golden/models", "caffe-models")


def _missing_group(path: Path) -> str | None:
    """The shared group (one of _GROUPS) ``path`` belongs to, when it is absent and so is the file."""
    if path.exists():
        return None
    for root in (SHARED, VENDORED):
        if path.is_relative_to(root):
            rel = path.relative_to(root).as_posix()
            group = next((g for g in _GROUPS if rel == g or rel.startswith(g + "/")), None)
            return group if group and not (SHARED / group).is_dir() else None
    return None


def have(path) -> bool:
    """False when ``path`` is missing because the shared data is not here (a loop may pass it)."""
    return _missing_group(Path(path)) is None


def need(path) -> Path:
    """``path``, or skip when it is missing because its shared group is not here: one reason per
    group. A file missing from a present group is returned, so the test fails on it."""
    group = _missing_group(Path(path))
    if group:
        pytest.skip(f"needs {group}/ of the shared data (set BREWNET_SHARED; default ../shared)",
                    allow_module_level=True)
    return Path(path)


def layer_param(text: str) -> "pb.LayerParameter":
    return text_format.Parse(text, pb.LayerParameter())


def make_layer(text: str, bottom_shapes, phase=pb.TEST):
    """Parse a ``layer { ... }`` body, set the layer up; returns (layer, top_shapes)."""
    layer = create_layer(text, phase)
    return layer, layer.set_up(bottom_shapes)


def gradcheck_layer(layer, bottoms, grad_bottoms=None, check_params=True, **kw) -> bool:
    """Finite-difference check (float64) of d(tops)/d(bottoms, params) for one layer.

    ``grad_bottoms``: indices of bottoms to differentiate (default: those the layer allows).
    Pass inputs away from kinks (ReLU at 0, max ties), as Caffe's GradientChecker does.
    """
    bottoms = [b.detach().double() for b in bottoms]
    if grad_bottoms is None:
        grad_bottoms = [i for i in range(len(bottoms)) if layer.allow_backward(i)]
    for i in grad_bottoms:
        bottoms[i].requires_grad_(True)
    params = [b.detach().double().requires_grad_(check_params) for b in layer.blobs]
    n_b = len(bottoms)

    def fn(*xs):
        layer.blobs = list(xs[n_b:])
        return tuple(layer.forward(list(xs[:n_b])))

    kw.setdefault("atol", 1e-5)
    kw.setdefault("rtol", 1e-4)
    kw.setdefault("eps", 1e-6)
    return torch.autograd.gradcheck(fn, (*bottoms, *params), **kw)


DATA_TYPES = {"Data", "ImageData", "HDF5Data", "WindowData", "AnnotatedData", "Python", "MemoryData"}


def swap_data_layers(net_param, shapes_per_layer):
    """Replace data layers by Input layers, in file order: ``shapes_per_layer[i]`` is the list of
    top shapes for the i-th data layer. Include/exclude rules are kept."""
    from brewnet.proto import caffe_pb2 as pb

    out = pb.NetParameter()
    out.CopyFrom(net_param)
    del out.layer[:]
    k = 0
    for lp in net_param.layer:
        if lp.type in DATA_TYPES and not lp.bottom:
            new = pb.LayerParameter(name=lp.name, type="Input", top=lp.top)
            new.include.extend(lp.include)
            new.exclude.extend(lp.exclude)
            for s in shapes_per_layer[k]:
                new.input_param.shape.add().dim.extend(s)
            k += 1
            out.layer.append(new)
        else:
            out.layer.append(lp)
    return out


def random_digits_lmdb(path, n: int, side: int, seed: int) -> str:
    """An LMDB of ``n`` random 1 x side x side uint8 Datums with labels 0-9 (keys 00000000...)."""
    import numpy as np

    from brewnet.data.db import open_writer
    from brewnet.data.transform import chw_to_datum

    rng = np.random.default_rng(seed)
    with open_writer(str(path)) as w:
        for i in range(n):
            w.put(f"{i:08d}", chw_to_datum(rng.integers(0, 256, (1, side, side), dtype=np.uint8),
                                           int(rng.integers(10))).SerializeToString())
    return str(path)



# -- the device switch (tests/conftest.py) -------------------------------------------------
ON_DEVICE = (os.environ.get("BREWNET_TEST_DEVICE", "").strip() or "cpu") == "cuda"
DEVICE = torch.device("cuda", 0) if ON_DEVICE else torch.device("cpu")
# The float32 tolerance a kind of comparison needs on the GPU beyond its CPU one: (rtol, atol,
# why). TF32 is off (runtime.configure), so the rest is summation order and libm.
DEVICE_TOLERANCES = {
    "exact": (0.0, 0.0, "ArgMax, Accuracy, pooling masks, routing: no arithmetic"),
    "elementwise": (2e-6, 1e-6, "CUDA's expf/tanhf/logf are within 2 ulp (CUDA C guide, "
                    "appendix 'Mathematical functions'), glibc's within 1"),
    "blas": (1e-4, 5e-5, "cuBLAS/cuDNN choose the algorithm (implicit GEMM, Winograd, split-K): "
             "a sum of K products in another order and, for Winograd, a transform's rounding"),
    "loss": (1e-5, 1e-6, "a reduction over the batch in a tree (CUDA) instead of a loop"),
    "trajectory": (1e-4, 1e-5, "a solver run: a step's rounding differences carried by the "
                   "following steps (as between Caffe's CPU and GPU runs)"),
    "lean": (1e-5, 1e-6, "lean's folded BatchNorm/Scale on cuDNN (no CPU kernel choices)"),
}


def tol(kind: str, rtol: float, atol: float) -> dict:
    """{rtol, atol} for an assert_allclose: the CPU's own, widened to the device's for ``kind``
    (DEVICE_TOLERANCES) under the device switch."""
    if not ON_DEVICE:
        return dict(rtol=rtol, atol=atol)
    d_rtol, d_atol, _ = DEVICE_TOLERANCES[kind]
    return dict(rtol=max(rtol, d_rtol), atol=max(atol, d_atol))


def host(t):
    """A tensor (any device) as a numpy array; numpy arrays pass through."""
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t


def fork_pb2(tmp_dir: Path, excerpt: Path, module: str):
    """A vendored excerpt of a fork's caffe.proto compiled by protoc (grpc_tools) into ``module``
    and imported: the fork's own classes, its field numbers (a generator: the fixture's body)."""
    import importlib
    import subprocess
    import sys

    pytest.importorskip("grpc_tools")
    (tmp_dir / f"{module}.proto").write_text(excerpt.read_text())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp_dir}", f"--python_out={tmp_dir}",
                    str(tmp_dir / f"{module}.proto")], check=True)
    sys.path.insert(0, str(tmp_dir))
    try:
        yield importlib.import_module(f"{module}_pb2")
    finally:
        sys.path.remove(str(tmp_dir))


def wait_until_serving(proc, url: str, tries: int = 240) -> None:
    """Poll ``url``/healthz of a ``brewnet serve`` process until it answers 200; the server's
    stderr is the failure message if it exits first."""
    import time

    import httpx

    for _ in range(tries):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()
