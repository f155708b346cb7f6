"""pycaffe drop-in, as a user meets it: pycaffe's module paths under brewnet, ``import caffe``
unchanged (``brewnet run``, ``brewnet compat`` in a fresh venv, never over a real Caffe), and
Caffe's own programs and pycaffe's own test suite run unmodified (tests/data/bvlc-caffe, BSD-2).
Every run is a fresh process with the user's defaults."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data"
CAFFE = DATA / "bvlc-caffe"
BVLC = DATA / "caffe-models" / "bvlc"
MODULES = ["io", "draw", "coord_map", "net_spec", "classifier", "detector", "pycaffe",
           "proto", "proto.caffe_pb2", "layers", "_caffe"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("BREWNET_", "PYTHONPATH"))}


def run(args, cwd, env=None, timeout=300, python=sys.executable):
    p = subprocess.run([str(python), *map(str, args)], cwd=cwd, env=env or ENV, timeout=timeout,
                       capture_output=True, text=True)
    return p


def brewnet(*args, cwd, **kw):
    return run(["-m", "brewnet", *args], cwd, **kw)


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def caffe_root(tmp_path_factory) -> Path:
    """A Caffe source tree as its programs expect: python/, tools/extra/, models/, examples/."""
    root = tmp_path_factory.mktemp("caffe")
    shutil.copytree(CAFFE, root, dirs_exist_ok=True)
    for sub in ("models", "examples"):
        shutil.copytree(BVLC / sub, root / sub)
    return root


USER_SCRIPT = textwrap.dedent("""
    import caffe
    from caffe import layers as L, params as P
    from caffe.coord_map import crop
    import caffe.io, brewnet

    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 100, 100]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=5, pad=2)
    n.pool = L.Pooling(n.conv, kernel_size=2, stride=2)
    n.up = L.Deconvolution(n.pool, convolution_param=dict(num_output=4, kernel_size=4, stride=2))
    n.crop = crop(n.up, n.data)
    print("crop offsets", [int(x) for x in n.crop.fn.params["crop_param"]["offset"]])
    print("same", caffe is brewnet, caffe.io is brewnet.io, caffe.coord_map is brewnet.coord_map)
""")


def test_module_paths_are_the_pycaffe_modules(tmp_path):
    code = textwrap.dedent(f"""
        import importlib, brewnet, brewnet.pycaffe as pc
        for m in {MODULES!r}:
            mod = importlib.import_module("brewnet." + m)
            assert mod is getattr(brewnet, m.split(".")[0]) or m.startswith("proto"), m
        assert brewnet.io is pc.io and brewnet.net_spec is pc.net_spec and brewnet._caffe is pc._caffe
        import brewnet_alias; brewnet_alias.install()
        import caffe, caffe.proto.caffe_pb2, caffe._caffe
        for m in {MODULES!r}:
            assert importlib.import_module("caffe." + m) is importlib.import_module("brewnet." + m), m
        assert caffe._caffe.Net is caffe.Net and caffe._caffe.Timer is caffe.Timer
        net = caffe.Net(caffe.proto.caffe_pb2.NetParameter(), caffe.TEST)
        assert isinstance(net, brewnet.Net) and isinstance(net, caffe.pycaffe.Net)
        try:
            import caffe.no_such_module
        except ModuleNotFoundError as e:
            assert "caffe.no_such_module" in str(e), e
        print("ok")
    """)
    assert ok(run(["-c", code], tmp_path)).stdout.strip() == "ok"


def test_brewnet_run_resolves_import_caffe(tmp_path):
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    out = ok(brewnet("run", "user.py", cwd=tmp_path)).stdout
    # FCN's crop of the 2x upsampled pool output against the input. By hand: the pool maps p to
    # 2p + 0.5, the deconvolution u to (u - 1.5) / 2, so u lands on u - 1: offset 1.
    assert "crop offsets [1]" in out and "same True True True" in out
    p = run(["user.py"], tmp_path)                   # plain python: no alias, as before
    assert p.returncode != 0 and "No module named 'caffe'" in p.stderr


def test_brewnet_run_passes_the_scripts_arguments(tmp_path):
    (tmp_path / "args.py").write_text("import sys, caffe\nprint(sys.argv)\nsys.exit(3)\n")
    p = brewnet("run", "args.py", "-input_file", "x", "--center_only", "-m", cwd=tmp_path)
    assert p.returncode == 3 and "['args.py', '-input_file', 'x', '--center_only', '-m']" in p.stdout
    p = brewnet("run", "missing.py", cwd=tmp_path)
    assert p.returncode != 0 and "missing.py: no such file" in p.stderr and "Traceback" not in p.stderr


def fake_real_caffe(tmp_path) -> Path:
    site = tmp_path / "realsite"
    (site / "caffe").mkdir(parents=True)
    (site / "caffe" / "__init__.py").write_text("REAL = True\n")
    return site


def test_never_shadows_a_real_caffe(tmp_path):
    (tmp_path / "user.py").write_text("import caffe\nprint('real' if hasattr(caffe, 'REAL') else 'brewnet')\n")
    env = dict(ENV, PYTHONPATH=str(fake_real_caffe(tmp_path)))
    p = brewnet("run", "user.py", cwd=tmp_path, env=env)
    assert p.returncode != 0 and "a real 'caffe' is importable here" in p.stderr
    assert "--shadow-caffe" in p.stderr and "Traceback" not in p.stderr
    assert ok(brewnet("run", "--shadow-caffe", "user.py", cwd=tmp_path, env=env)).stdout.strip() == "brewnet"


@pytest.fixture
def venv(tmp_path) -> Path:
    """A fresh venv that sees this environment's packages (torch, brewnet) but has its own
    site-packages for the switch."""
    ok(run(["-m", "venv", "--system-site-packages", "--without-pip", tmp_path / "venv"], tmp_path))
    return tmp_path / "venv" / "bin" / "python"


def test_compat_switch_in_a_fresh_venv(tmp_path, venv):
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    assert "off" in ok(brewnet("compat", "status", cwd=tmp_path, python=venv)).stdout
    ok(brewnet("compat", "install", cwd=tmp_path, python=venv))
    assert "on" in ok(brewnet("compat", "status", cwd=tmp_path, python=venv)).stdout
    out = ok(run(["user.py"], tmp_path, python=venv)).stdout           # plain `python user.py`
    assert "crop offsets [1]" in out and "same True True True" in out
    light = ok(run(["-c", "import sys; print('torch' in sys.modules, 'brewnet' in sys.modules)"],
                   tmp_path, python=venv)).stdout
    assert light.strip() == "False False"            # the switch loads nothing until `import caffe`
    assert run(["user.py"], tmp_path).returncode != 0  # the outer environment is untouched
    # A real Caffe arriving later wins over the switch; installing over one is refused.
    env = dict(ENV, PYTHONPATH=str(fake_real_caffe(tmp_path)))
    (tmp_path / "which.py").write_text("import caffe\nprint('real' if hasattr(caffe, 'REAL') else 'brewnet')\n")
    assert ok(run(["which.py"], tmp_path, env=env, python=venv)).stdout.strip() == "real"
    ok(brewnet("compat", "uninstall", cwd=tmp_path, python=venv))
    p = brewnet("compat", "install", cwd=tmp_path, env=env, python=venv)
    assert p.returncode != 0 and "will not shadow it" in p.stderr and "--force" in p.stderr
    assert run(["user.py"], tmp_path, python=venv).returncode != 0


def test_pycaffes_own_test_suite(caffe_root):
    """BVLC's python/caffe/test, unchanged, with `caffe` resolved to brewnet: all 52 pass
    (test_draw renders every models/ and examples/ net with Graphviz)."""
    if shutil.which("dot") is None:
        pytest.skip("needs Graphviz's dot (apt-get install graphviz) for test_draw")
    p = brewnet("run", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
                "python/caffe/test", cwd=caffe_root, timeout=600)
    assert re.search(r"\b52 passed\b", p.stdout) and "failed" not in p.stdout, p.stdout[-3000:]


TINY = """name: "tiny"
input: "data" input_shape { dim: 1 dim: 3 dim: 32 dim: 32 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param {
  num_output: 4 kernel_size: 5 stride: 2 weight_filler { type: "gaussian" std: 0.1 }
  bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc" inner_product_param {
  num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small classifier with random weights written by brewnet, and OpenCV's dnn on the same
    files as the independent oracle of its outputs."""
    cv2 = pytest.importorskip("cv2")
    d = tmp_path_factory.mktemp("tiny")
    (d / "deploy.prototxt").write_text(TINY)
    ok(run(["-c", "import brewnet as caffe; caffe.set_random_seed(3); "
                  "caffe.Net('deploy.prototxt', caffe.TEST).save('tiny.caffemodel')"], d))
    cv = cv2.dnn.readNetFromCaffe(str(d / "deploy.prototxt"), str(d / "tiny.caffemodel"))

    def oracle(rgb01: np.ndarray) -> np.ndarray:
        """Caffe's preprocessing of an RGB [0, 1] HxWx3 image (BGR, x255, CHW), then the net."""
        cv.setInput(np.ascontiguousarray(rgb01[:, :, ::-1].transpose(2, 0, 1)[None] * 255, np.float32))
        return cv.forward("prob").reshape(-1)

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    cv2.imwrite(str(d / "img.png"), image[:, :, ::-1])
    return d, oracle, image.astype(np.float32) / 255


def test_classify_py(caffe_root, tiny):
    d, oracle, image = tiny
    crop = image[:32, :32]
    cv2 = pytest.importorskip("cv2")
    cv2.imwrite(str(d / "crop.png"), (crop * 255).round().astype(np.uint8)[:, :, ::-1])
    ok(brewnet("run", caffe_root / "python/classify.py", "--model_def", d / "deploy.prototxt",
               "--pretrained_model", d / "tiny.caffemodel", "--images_dim", "32,32", "--mean_file", "",
               d / "crop.png", d / "out.npy", cwd=d))
    got = np.load(d / "out.npy")
    # Oversampling at the crop size: the 4 corners and the centre are the image, then mirrored.
    want = (oracle(crop) + oracle(crop[:, ::-1])) / 2
    assert got.shape == (1, 5)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-6)


def test_detect_py_crop_mode_list(caffe_root, tiny):
    pd = pytest.importorskip("pandas", reason="detect.py needs pandas (pip install 'pandas<3' tables)")
    if int(pd.__version__.split(".")[0]) >= 3:
        pytest.skip("Caffe's detect.py calls df.to_hdf(path, 'df'), which pandas 3 refuses: pandas<3")
    pytest.importorskip("tables", reason="detect.py's .h5 output needs PyTables (pip install tables)")
    d, oracle, image = tiny
    windows = [(0, 0, 32, 32), (16, 8, 48, 40), (30, 32, 62, 64)]
    rows = "".join(f"{d / 'img.png'},{y0},{x0},{y1},{x1}\n" for y0, x0, y1, x1 in windows)
    (d / "windows.csv").write_text("filename,ymin,xmin,ymax,xmax\n" + rows)
    out = ok(brewnet("run", caffe_root / "python/detect.py", "--crop_mode", "list",
                     "--model_def", d / "deploy.prototxt", "--pretrained_model", d / "tiny.caffemodel",
                     "--mean_file", "", "--context_pad", "0", d / "windows.csv", d / "det.h5", cwd=d)).stdout
    assert "Processed 3 windows" in out
    df = pd.read_hdf(d / "det.h5", "df")
    assert [tuple(r) for r in df[["ymin", "xmin", "ymax", "xmax"]].values] == windows
    for (y0, x0, y1, x1), pred in zip(windows, df["prediction"]):
        np.testing.assert_allclose(pred, oracle(image[y0:y1, x0:x1]), rtol=0, atol=2e-6)


def test_draw_net_py(caffe_root, tmp_path):
    lenet = caffe_root / "examples/mnist/lenet_train_test.prototxt"
    out = ok(brewnet("run", caffe_root / "python/draw_net.py", lenet, tmp_path / "a.dot",
                     "--phase", "TRAIN", cwd=tmp_path)).stdout
    assert "Drawing net to" in out
    ok(brewnet("draw", lenet, tmp_path / "b.dot", "--phase", "TRAIN", cwd=tmp_path))
    assert (tmp_path / "a.dot").read_text() == (tmp_path / "b.dot").read_text()
    assert "conv1" in (tmp_path / "a.dot").read_text()
    if shutil.which("dot"):
        ok(brewnet("run", caffe_root / "python/draw_net.py", lenet, tmp_path / "a.png", cwd=tmp_path))
        assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LAYERS = ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]


@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory):
    """Caffe's LeNet on a small random-digit LMDB, test every 10, snapshot at 20."""
    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import random_digits_lmdb

    d = tmp_path_factory.mktemp("lenet")
    db = random_digits_lmdb(str(d / "db"), 256, 28, 0)
    txt = (BVLC / "examples/mnist/lenet_train_test.prototxt").read_text()
    (d / "net.prototxt").write_text(txt.replace("examples/mnist/mnist_train_lmdb", db)
                                    .replace("examples/mnist/mnist_test_lmdb", db))
    (d / "solver.prototxt").write_text(
        'net: "net.prototxt"\ntest_iter: 2\ntest_interval: 10\nbase_lr: 0.01\nmomentum: 0.9\n'
        'lr_policy: "inv"\ngamma: 0.0001\npower: 0.75\nmax_iter: 20\ndisplay: 5\nsnapshot: 20\n'
        'snapshot_prefix: "lenet"\nsolver_mode: CPU\nrandom_seed: 1\n')
    return d


def params_of(d: Path, model: str) -> dict:
    code = (f"import brewnet as caffe, numpy as np; n = caffe.Net('net.prototxt', caffe.TEST, weights='{model}'); "
            "np.savez('p.npz', **{k: v[0].data for k, v in n.params.items()})")
    ok(run(["-c", code], d))
    return dict(np.load(d / "p.npz"))


def train_both(caffe_root, lenet_run, tmp_path, env=None, timing=False):
    a, b = tmp_path / "a", tmp_path / "b"
    for x in (a, b):
        shutil.copytree(lenet_run, x)
    p = ok(brewnet("run", caffe_root / "python/train.py", "--solver", "solver.prototxt",
                   *(["--timing"] if timing else []), cwd=a, env=env, timeout=600))
    ok(brewnet("train", "--solver", "solver.prototxt", cwd=b, env=env, timeout=600))
    return p.stdout + p.stderr, params_of(a, "lenet_iter_20.caffemodel"), params_of(b, "lenet_iter_20.caffemodel")


def test_train_py_timing(caffe_root, lenet_run, tmp_path):
    log, pa, pb = train_both(caffe_root, lenet_run, tmp_path, timing=True)
    # pycaffe's per-layer table from Timer and the Net's four hooks, at every display.
    for i, name in enumerate(LAYERS):
        assert re.search(rf"forw +{i} +{name} : \d+\.\d\d", log), name
        assert re.search(rf"back +{i} +{name} : \d+\.\d\d", log), name
    assert len(re.findall(r"solver total: \d+\.\d\d", log)) == 4      # iterations 0, 5, 10, 15
    # train.py's solver runs in a worker forked after import, which checks its convolution
    # kernels on 1 and its own thread count only (brewnet/determinism.py): on up to 2 cores that
    # is every count `brewnet train` checks, so both pick the same kernels and give the same bits.
    from brewnet.threads import usable_cores

    for k in pa:
        if usable_cores() <= 2:
            np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
        else:     # different kernels may be picked; 20 momentum steps grow last-bit differences
            np.testing.assert_allclose(pa[k], pb[k], rtol=0, atol=1e-3, err_msg=k)


def python2() -> str | None:
    """A Python 2 interpreter: Caffe's parse_log.py (BVLC's last commit) has a print statement."""
    cands = [shutil.which("python2.7"), *map(str, sorted(Path.home().glob(".pyenv/versions/2.7*/bin/python")))]
    for c in filter(None, cands):
        if subprocess.run([c, "-c", "print 'ok'"], capture_output=True).returncode == 0:
            return c
    return None


def test_caffes_log_tools_read_brewnet_logs(caffe_root, lenet_run, tmp_path):
    py2 = python2()
    if py2 is None:
        pytest.skip("Caffe's tools/extra/parse_log.py is Python 2 code: needs a python2.7")
    shutil.copytree(lenet_run, tmp_path / "r")
    d = tmp_path / "r"
    p = ok(brewnet("train", "--solver", "solver.prototxt", cwd=d, timeout=600))
    (d / "train.log").write_text(p.stderr)
    losses = [float(x) for x in re.findall(r"Iteration \d+ \(.*\), loss = ([\d.e+-]+)", p.stderr)]
    accs = [float(x) for x in re.findall(r"Test net output #0: accuracy = ([\d.e+-]+)", p.stderr)]
    assert len(losses) == 4 and len(accs) == 3
    ok(run([caffe_root / "tools/extra/parse_log.py", "train.log", "."], d, python=py2))
    train = np.genfromtxt(d / "train.log.train", delimiter=",", names=True)
    test = np.genfromtxt(d / "train.log.test", delimiter=",", names=True)
    assert list(train["NumIters"]) == [0, 5, 10, 15] and list(train["loss"]) == pytest.approx(losses, abs=1e-5)
    assert list(test["NumIters"]) == [0, 10, 20] and list(test["accuracy"]) == pytest.approx(accs, abs=1e-5)
    assert all(np.diff(train["Seconds"]) >= 0)
    # parse_log.sh runs extract_seconds.py as `#!/usr/bin/env python` (it is 2/3 code).
    env = dict(ENV, PATH=f"{Path(sys.executable).parent}:{ENV.get('PATH', '')}")
    ok(subprocess.run(["bash", caffe_root / "tools/extra/parse_log.sh", "train.log"], cwd=d, env=env,
                      capture_output=True, text=True, timeout=120))
    rows = [line.split() for line in (d / "train.log.test").read_text().splitlines()[1:]]
    assert [int(r[0]) for r in rows] == [0, 10, 20] and [float(r[2]) for r in rows] == pytest.approx(accs, abs=1e-5)


def test_timer_and_net_hooks(tmp_path):
    """caffe.Timer as Caffe's (restart resets, ms stops a running timer, 0 before any start) and
    the Net's hooks in ForwardFromTo/BackwardFromTo order, every layer, with the same values."""
    import time

    import brewnet as caffe

    t = caffe.Timer()
    assert t.ms == 0.0
    t.start()
    time.sleep(0.02)
    t.start()                                      # a running timer is not restarted
    first = t.ms                                   # reading stops it
    assert 15 < first < 1000 and t.ms == first
    t.start()
    t.stop()
    assert t.ms < first
    softmax = 'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }'
    (tmp_path / "tiny.prototxt").write_text(TINY.replace(softmax, "force_backward: true"))
    net = caffe.Net(str(tmp_path / "tiny.prototxt"), caffe.TEST)
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    plain = net.forward(data=x)["fc"].copy()
    calls = []
    for when in ("before_forward", "after_forward", "before_backward", "after_backward"):
        getattr(net, when)(lambda i, w=when: calls.append((w, i)))
    np.testing.assert_array_equal(net.forward(data=x)["fc"], plain)
    net.blobs["fc"].diff[...] = 1
    net.backward()
    n = len(net.layers)
    assert calls == [(w, i) for i in range(n) for w in ("before_forward", "after_forward")] + \
        [(w, i) for i in reversed(range(n)) for w in ("before_backward", "after_backward")]
    with pytest.raises(TypeError, match="callable"):
        net.before_forward(3)
