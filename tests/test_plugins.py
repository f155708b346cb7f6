"""The plugin API: register_layer's rules, typed params, entry-point discovery (in-process and by
the CLI), the worked example's own tests, and the example against the SSD fork's Normalize."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.layers import (
    LAYERS,
    Layer,
    LayerError,
    create_layer,
    layer_class,
    register_layer,
    unregister_layer,
)
from brewnet.layers.neuron import ReLU
from brewnet.layers.registry import BUILTIN

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "new_layer"


@pytest.fixture
def cleanup():
    names = []
    yield names
    for n in names:
        if n in LAYERS and LAYERS[n] is not BUILTIN.get(n):
            unregister_layer(n)


def test_register_rules(cleanup):
    class Twice(Layer):
        def forward(self, bottoms):
            return [2 * bottoms[0]]

    with pytest.raises(LayerError, match="built into brewnet .*override=True"):
        register_layer("ReLU")(Twice)
    cleanup.append("ReLU")
    register_layer("ReLU", override=True)(Twice)
    assert layer_class("ReLU") is Twice
    unregister_layer("ReLU")
    assert layer_class("ReLU") is ReLU
    with pytest.raises(LayerError, match="built into brewnet and cannot be removed"):
        unregister_layer("ReLU")
    cleanup.append("TestTwice")
    register_layer("TestTwice")(Twice)
    register_layer("TestTwice")(Twice)  # the same class again: a re-imported module

    class Other(Layer):
        pass

    with pytest.raises(LayerError, match="already registered by plugin .*Twice"):
        register_layer("TestTwice")(Other)
    with pytest.raises(TypeError, match="not a subclass of brewnet.layers.Layer"):
        register_layer("TestPy")(brewnet.Layer)
    assert "TestTwice" in brewnet.layer_type_list()
    with pytest.raises(LayerError, match="unknown layer type 'Nope'; .*register_layer"):
        create_layer('name: "n" type: "Nope"')
    with pytest.raises(LayerError, match=r"unknown layer type 'TestTwise' \(did you mean 'TestTwice'\?\)"):
        create_layer('name: "n" type: "TestTwise"')


def test_typed_params(cleanup):
    @dataclass
    class P:
        eps: float
        n: int = 2
        flag: bool = False
        sizes: list[int] | None = None

    cleanup.append("TestParams")

    @register_layer("TestParams")
    class WithParams(Layer):
        Params = P

    def params(s):
        layer = create_layer('name: "p" type: "TestParams" bottom: "x" top: "y" '
                             'python_param { param_str: %r }' % s)
        layer.set_up([(2, 3)])
        return layer.params

    assert params("eps=1e-3, n=4 flag=true") == P(1e-3, 4, True)
    assert params('{"eps": 1, "flag": false}') == P(1.0, 2, False)
    assert params("{'eps': 0.5, 'n': 7}") == P(0.5, 7)
    for bad, msg in [("n=4", "missing required param.*eps"), ("eps=x", "param 'eps' must be float"),
                     ("eps=1 m=2", "unknown param.*m; this layer takes: eps, n, flag, sizes"),
                     ('{"eps": 1, "n": 1.5}', "param 'n' must be int"), ("eps", "item 'eps' is not key=value")]:
        with pytest.raises(LayerError, match=r"Layer 'p' \(type TestParams\): python_param.param_str: " + msg):
            params(bad)


def make_dist(root: Path, dist: str, module: str, source: str, entry: str) -> Path:
    """A distribution as pip would lay it out in site-packages: a module and its dist-info."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[brewnet.layers]\n{entry}\n")
    return root


def test_entry_points_load_lazily_and_name_broken_plugins(tmp_path, monkeypatch, cleanup):
    cleanup.append("TestEPDouble")
    # The entry point names a class that is not decorated: it registers under the entry's name.
    src = ("from brewnet.layers import Layer\n"
           "class Double(Layer):\n    def forward(self, b):\n        return [2 * b[0]]\n")
    monkeypatch.syspath_prepend(str(make_dist(tmp_path / "a", "test-ep-double", "test_ep_double",
                                              src, "TestEPDouble = test_ep_double:Double")))
    monkeypatch.syspath_prepend(str(make_dist(tmp_path / "b", "test-ep-broken", "test_ep_broken",
                                              "import not_a_module_anywhere\n",
                                              "TestEPBroken = test_ep_broken")))
    assert "TestEPDouble" not in LAYERS
    layer = create_layer('name: "d" type: "TestEPDouble" bottom: "x" top: "y"')
    assert layer.type == "TestEPDouble" and layer.forward([torch.ones(1)])[0].item() == 2
    with pytest.raises(LayerError, match=r"type 'TestEPBroken' comes from a plugin distribution "
                                         r"'test-ep-broken' .*ModuleNotFoundError"):
        create_layer('name: "b" type: "TestEPBroken"')
    with pytest.raises(LayerError, match=r"(?s)unknown layer type 'Other'.*failed to import.*'test-ep-broken'"):
        create_layer('name: "o" type: "Other"')
    with pytest.warns(UserWarning, match="test-ep-broken"):
        assert "TestEPDouble" in brewnet.layer_type_list()


def _env(*paths) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *map(str, paths)])
    return env


def test_installed_example_works_in_brewnet_shapes_and_train(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "brewnet-l2normalize", "l2_normalize", (EXAMPLE / "l2_normalize.py").read_text(),
              "L2Normalize = l2_normalize:L2Normalize")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE / "l2norm_train.prototxt", work)
    (work / "solver.prototxt").write_text(
        (EXAMPLE / "l2norm_solver.prototxt").read_text()
        .replace("examples/new_layer/l2norm_train", "l2norm_train")
        .replace("examples/new_layer/l2norm", "l2norm").replace("max_iter: 100", "max_iter: 40"))
    run = lambda *argv: subprocess.run([sys.executable, "-m", "brewnet.cli", *argv], cwd=work,
                                       env=_env(site), capture_output=True, text=True, timeout=300)
    shapes = run("shapes", "l2norm_train.prototxt")
    assert shapes.returncode == 0, shapes.stderr
    assert [l.split()[:3] for l in shapes.stdout.splitlines() if l.startswith("norm ")] == \
        [["norm", "L2Normalize", "norm"]]
    train = run("train", "--solver", "solver.prototxt")
    assert train.returncode == 0, train.stderr
    losses = [float(l.rsplit("= ", 1)[1]) for l in train.stderr.splitlines() if "] Iteration" in l and "loss = " in l]
    assert len(losses) >= 2 and losses[-1] < 0.1 * losses[0]
    assert (work / "l2norm_iter_40.caffemodel").exists()
    # Without the distribution on the path the type is unknown, and the error says so.
    alone = subprocess.run([sys.executable, "-m", "brewnet.cli", "shapes", "l2norm_train.prototxt"],
                           cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
    assert alone.returncode != 0 and "unknown layer type 'L2Normalize'" in alone.stderr


def test_the_examples_own_tests_pass():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "6 passed" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channel_shared", [True, False])
def test_example_agrees_with_ssd_normalize(dtype, channel_shared, monkeypatch):
    # Where the definitions coincide: across_spatial, scale 1 (both default eps 1e-10).
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import l2_normalize  # noqa: F401
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((3, 4, 5, 6))).to(dtype)
    dy = torch.from_numpy(np.random.default_rng(6).standard_normal((3, 4, 5, 6))).to(dtype)
    out = []
    for text in ['type: "L2Normalize"',
                 f'type: "Normalize" norm_param {{ across_spatial: true '
                 f'channel_shared: {str(channel_shared).lower()} }}']:
        layer = create_layer(f'name: "n" bottom: "x" top: "y" {text}')
        layer.set_up([x.shape])
        t = x.clone().requires_grad_(True)
        y = layer.forward([t])[0]
        y.backward(dy)
        out.append((y.detach(), t.grad))
    (y1, g1), (y2, g2) = out
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert (y1 - y2).abs().max() <= tol and (g1 - g2).abs().max() <= tol
