"""Minerva's owl interface (brewnet.owl, ``brewnet owl SCRIPT``) against the brewnet commands it
stands on, on LeNet over real MNIST (the shared t10k images; skipped without them) and a
10-view test on an ImageData net that crops.

owl's semantics checked: the snapshot *index* (iteration = index x the solver's snapshot; a
resumed run ends bitwise as the uninterrupted one; a missing index starts from the fillers at
that iteration), the split-batch rule (2 CPU workers at batch B/2 equal one process at batch B
within 2e-5 after 30 steps, tests/test_parallel.py's tolerance and reasoning: only the order of
the per-sample sums differs), owl's log lines, owl's feature text matrix, and a unit's own output
for stacked in-place layers (``ip1`` before ``relu1``).
"""
from __future__ import annotations

import gzip
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from brewnet.cli import main
from brewnet.owl.net import trainer as owl_tools
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import read_binary
from helpers import SHARED, need

REPO = Path(__file__).resolve().parents[1]
T10K = SHARED / "caffe-models" / "trained" / "mnist_t10k" / "data" / "mnist"
LENET = REPO / "examples" / "mnist" / "lenet_train_test.prototxt"
RECORDS, TOL = 600, 2e-5
SOLVER = """net: "{net}" {test} base_lr: 0.01 momentum: 0.9
weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75 display: 10 max_iter: 30
snapshot: 10 snapshot_prefix: "{prefix}" solver_mode: CPU random_seed: 1701
"""


def weights(path) -> dict:
    net = read_binary(str(path), pb.NetParameter())
    return {(l.name, i): np.array(b.data, np.float32) for l in net.layer for i, b in enumerate(l.blobs)}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def lenet(folder: Path, db: str, train_batch=16, test_batch=50, name="lenet") -> Path:
    text = (LENET.read_text().replace("examples/mnist/mnist_train_lmdb", db)
            .replace("examples/mnist/mnist_test_lmdb", db)
            .replace("batch_size: 64", f"batch_size: {train_batch}")
            .replace("batch_size: 100", f"batch_size: {test_batch}"))
    path = folder / f"{name}.prototxt"
    path.write_text(text)
    return path


def solver(folder: Path, net: Path, prefix: str, test_iter=2, name="solver") -> str:
    """LeNet's solver for 30 iterations, snapshots every 10, tests every 10 (none: test_iter 0)."""
    path = folder / f"{name}.prototxt"
    test = f"test_iter: {test_iter} test_interval: 10" if test_iter else ""
    path.write_text(SOLVER.format(net=net, prefix=folder / prefix, test=test))
    return str(path)


@pytest.fixture(scope="module")
def mnist(tmp_path_factory) -> str:
    """The first RECORDS MNIST test images as an LMDB (Caffe's convert_mnist_data format)."""
    from brewnet.data.db import open_writer
    from brewnet.data.transform import chw_to_datum

    images = need(T10K / "t10k-images-idx3-ubyte.gz")
    with gzip.open(images) as f:
        x = np.frombuffer(f.read(16 + RECORDS * 784), np.uint8)[16:].reshape(RECORDS, 1, 28, 28)
    with gzip.open(T10K / "t10k-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(8 + RECORDS), np.uint8)[8:]
    path = tmp_path_factory.mktemp("owl_mnist") / "mnist_lmdb"
    with open_writer(str(path)) as w:
        for i in range(RECORDS):
            w.put(f"{i:08d}", chw_to_datum(x[i], int(y[i])).SerializeToString())
    return str(path)


@pytest.fixture(scope="module")
def trained(mnist, tmp_path_factory):
    """NetTrainer's 30 iterations (snapshots 1, 2, 3) and its stdout."""
    import contextlib

    d = tmp_path_factory.mktemp("owl_train")
    s = solver(d, lenet(d, mnist), "lenet")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        t = owl_tools.NetTrainer(s, 0, 1)
        t.build_net()
        t.run()
    return d, s, out.getvalue()


def test_net_trainer_is_brewnet_train_with_owls_lines(trained, mnist):
    d, s, out = trained
    ref = solver(d, d / "lenet.prototxt", "ref", name="ref_solver")
    assert main(["train", "--solver", ref]) == 0
    for it in (10, 20, 30):                 # the same bits as Caffe's loop, snapshot by snapshot
        assert max_diff(weights(d / f"lenet_iter_{it}.caffemodel"), weights(d / f"ref_iter_{it}.caffemodel")) == 0
    assert re.findall(r"Save to snapshot (\d+), current lr ", out) == ["1", "2", "3"]
    assert len(re.findall(r"^Training Loss loss: [\d.]+$", out, re.M)) == 3
    assert len(re.findall(r"^Finished training \d+ minibatch \(time: .*; speed: .* img/s\)$", out, re.M)) == 30
    tests = [float(v) for v in re.findall(r"^Testing Accuracy: ([\d.]+)$", out, re.M)]
    assert len(tests) == 3                  # at iterations 10, 20, 30 (none at the start, as owl)
    assert not (d / "lenet_iter_0.caffemodel").exists()
    # The first test during training reads the test data from its start: NetTester's numbers.
    first = owl_tools.NetTester(s, "loss", "accuracy", 1)
    first.build_net()
    assert first.run(False) == pytest.approx(tests[0], abs=1e-6)


def test_snapshot_index_resume_equals_the_uninterrupted_run(trained, tmp_path):
    d, _, _ = trained
    s = solver(tmp_path, d / "lenet.prototxt", "cut")
    for f in d.glob("lenet_iter_20.*"):
        shutil.copy(f, tmp_path / f.name.replace("lenet_", "cut_"))
    t = owl_tools.NetTrainer(s, 2, 1)
    t.build_net()
    assert t.owl_net.trainer_solver.iter == 20
    t.run()
    a, b = weights(d / "lenet_iter_30.caffemodel"), weights(tmp_path / "cut_iter_30.caffemodel")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # A missing index: the fillers, at that index's iteration (owl's start_idx).
    miss = solver(tmp_path, d / "lenet.prototxt", "miss", name="miss")
    t = owl_tools.NetTrainer(miss, 2, 1)
    t.build_net()
    assert t.owl_net.trainer_solver.iter == 20
    t.run()
    assert sorted(p.name for p in tmp_path.glob("miss_iter_*.caffemodel")) == ["miss_iter_30.caffemodel"]


def test_net_tester_script_equals_brewnet_test(trained, capsys):
    d, s, _ = trained
    assert main(["owl", "net_tester", s, "loss", "accuracy", "3", "0", "0"]) == 0
    out = capsys.readouterr()
    lines = re.findall(r"^Accuracy of the (\d) mb: ([\d.]+), batch_size: 50, current mean accuracy: ([\d.]+)$",
                       out.out, re.M)
    assert [int(i) for i, _, _ in lines] == [0, 1]
    owl_acc = float(re.search(r"^Testing Accuracy: ([\d.]+)$", out.out, re.M).group(1))
    assert main(["test", "--model", str(d / "lenet.prototxt"), "--weights",
                 str(d / "lenet_iter_30.caffemodel"), "--iterations", "2"]) == 0
    err = capsys.readouterr().err
    batches = [float(v) for v in re.findall(r"Batch \d, accuracy = ([\d.]+)", err)]
    assert [float(a) for _, a, _ in lines] == pytest.approx(batches, abs=1e-6)
    assert owl_acc == pytest.approx(float(re.search(r"\] accuracy = ([\d.]+)", err).group(1)), abs=1e-6)
    assert owl_acc > 0.5                    # 30 iterations of LeNet learn something


def test_feature_extractor_is_owls_matrix_of_brewnet_extract(trained, tmp_path, capsys):
    d, s, _ = trained
    assert main(["owl", "feature_extractor", s, "relu1", str(tmp_path / "relu1.txt"), "3"]) == 0
    assert capsys.readouterr().out.count("Finish One Batch") == 2
    lines = (tmp_path / "relu1.txt").read_text().split("\n")
    assert lines[-1] == "" and all(re.fullmatch(r"(-?\d+\.\d{6} )+", line) for line in lines[:-1])
    owl_relu1 = np.loadtxt(tmp_path / "relu1.txt")
    assert main(["extract", "--model", str(d / "lenet.prototxt"), "--weights", str(d / "lenet_iter_30.caffemodel"),
                 "--blobs", "ip1", "--iterations", "2", "--out", str(tmp_path / "f.npy")]) == 0
    core = np.load(tmp_path / "f_ip1.npy")
    assert owl_relu1.shape == core.shape == (100, 500)
    assert np.abs(owl_relu1 - core).max() <= 5e-7          # %f keeps 6 decimals
    # owl's stacked layers: the unit ip1 is before relu1 (the blob 'ip1' is after it).
    ip1 = owl_tools.FeatureExtractor(s, 3)
    ip1.build_net()
    assert ip1.run("ip1", tmp_path / "ip1.txt") == 100
    pre = np.loadtxt(tmp_path / "ip1.txt")
    assert (pre < 0).any() and np.abs(np.maximum(pre, 0) - owl_relu1).max() <= 1e-6


@pytest.fixture(scope="module")
def small_test(trained):
    """The trained weights through a net whose TEST batch is 2 (one batch: few pictures)."""
    d, _, _ = trained
    lenet(d, re.search(r'source: "([^"]+)"', (d / "lenet.prototxt").read_text()).group(1),
          test_batch=2, name="small")
    path = d / "small_solver.prototxt"
    path.write_text(SOLVER.format(net=d / "small.prototxt", prefix=d / "lenet",
                                  test="test_iter: 1 test_interval: 10"))
    return d, str(path)


def test_heatmap_visualizer_draws_brewnet_heatmaps(small_test, tmp_path, capsys):
    from PIL import Image

    d, s = small_test
    assert main(["owl", "heatmap_visualizer", s, "conv2", str(tmp_path / "owl"), "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "owl").iterdir()) == ["0.jpg", "1.jpg"]
    assert main(["heatmap", "--model", str(d / "small.prototxt"), "--weights", str(d / "lenet_iter_30.caffemodel"),
                 "--blob", "conv2", "--out", str(tmp_path / "core")]) == 0
    for k in range(2):                  # owl's JPEG is the core's figure, JPEG-coded (Pillow's default)
        a = np.asarray(Image.open(tmp_path / "owl" / f"{k}.jpg").convert("RGB"), np.float64)
        coded = io.BytesIO()
        Image.open(tmp_path / "core" / f"heatmap_{k:04d}.png").convert("RGB").save(coded, "JPEG")
        b = np.asarray(Image.open(coded), np.float64)
        assert a.shape == b.shape and np.abs(a - b).mean() < 0.5
    assert "heatmap_visualizer" in capsys.readouterr().out


@pytest.mark.parametrize("layer,side", [("conv1", 5 * 3), ("ip2", 28 * 3)])
def test_filter_visualizer_mosaics_are_brewnet_filters_top_patches(small_test, tmp_path, layer, side):
    from PIL import Image

    from brewnet.analysis.filters import scan
    from brewnet.net import Net

    d, s = small_test
    v = owl_tools.FilterVisualizer(s, 3, layer, tmp_path)
    v.build_net()
    written = v.run()
    core = Net(str(d / "small.prototxt"), pb.TEST, weights=str(d / "lenet_iter_30.caffemodel"))
    top = scan(core, layer, 2)
    assert [p.name for p in written] == [f"{c}.jpg" for c in range(len(top.heaps))]
    for c, path in enumerate(written):      # the core's top patches in a 3 x 3 JPEG
        coded = io.BytesIO()
        Image.fromarray(owl_tools.mosaic([p for _, _, p in top.best(c)])).save(coded, "JPEG")
        got, want = np.asarray(Image.open(path)), np.asarray(Image.open(coded))
        assert got.shape == (side, side) and np.array_equal(got, want)


def test_filter_visualizer_script_and_a_bad_layer(small_test, tmp_path, capsys):
    _, s = small_test
    assert main(["owl", "filter_visualizer", s, "conv1", str(tmp_path), "3"]) == 0
    assert len(list(tmp_path.glob("*.jpg"))) == 20
    assert main(["owl", "filter_visualizer", s, "conv9", str(tmp_path), "3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("brewnet owl filter_visualizer: no layer named 'conv9'") and "conv1" in err


def test_two_cpu_workers_split_batch_equal_one_process(trained, tmp_path):
    """NetTrainer(par, 0, 2) as each of the 2 workers its launcher starts (forked here, as
    tests/test_parallel.py's, to spare two interpreter starts)."""
    from test_parallel import workers

    d, _, _ = trained
    par = solver(tmp_path, d / "lenet.prototxt", "par", test_iter=0)    # batch 16: 8 per worker
    results = workers(2, ["owl", "net_trainer", par, "0", "2"], tmp_path / "logs")
    assert [c for c, _ in results] == [0, 0], results
    got, ref = weights(tmp_path / "par_iter_30.caffemodel"), weights(d / "lenet_iter_30.caffemodel")
    assert max_diff(got, weights(d / "lenet_iter_10.caffemodel")) > 100 * TOL
    assert max_diff(got, ref) <= TOL


def test_split_rule_needs_a_divisible_batch(trained):
    from brewnet.parallel import World

    d, s, _ = trained
    t = owl_tools.NetTrainer(s, 0, 3)
    t.world = World(0, 3, 0, "127.0.0.1", 0, True)
    t.owl_net = owl_tools.Net()
    t.builder = owl_tools.CaffeNetBuilder(s)
    t.builder.build_net(t.owl_net, 3)
    with pytest.raises(ValueError, match=r"layer 'mnist': batch_size 16 does not split evenly over 3 devices"):
        t.solver_param()
    t.batch_rule = "full"
    assert [l.data_param.batch_size for l in t.solver_param().net_param.layer if l.type == "Data"] == [16, 50]


def _image_net(folder: Path) -> str:
    """12 colour 40 x 40 PNGs in an ImageData list, a net that crops 32 and its solver."""
    import cv2

    rng = np.random.default_rng(3)
    lines = []
    for i in range(12):
        img = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
        cv2.imwrite(str(folder / f"{i}.png"), img)
        lines.append(f"{i}.png {i % 5}")
    (folder / "list.txt").write_text("\n".join(lines) + "\n")
    (folder / "net.prototxt").write_text(f"""name: "crop"
layer {{ name: "data" type: "ImageData" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ crop_size: 32 mean_value: 104 mean_value: 117 mean_value: 123 }}
  image_data_param {{ source: "{folder / 'list.txt'}" root_folder: "{folder}/" batch_size: 4 }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 8 kernel_size: 5 stride: 2 weight_filler {{ type: "gaussian" std: 0.01 }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.01 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
layer {{ name: "accuracy" type: "Accuracy" bottom: "fc" bottom: "label" top: "accuracy"
  accuracy_param {{ top_k: 2 }} }}
""")
    path = folder / "solver.prototxt"
    path.write_text(f'net: "{folder / "net.prototxt"}" test_iter: 3 test_interval: 10 base_lr: 0.01 '
                    f'max_iter: 10 snapshot: 10 snapshot_prefix: "{folder / "crop"}" random_seed: 5\n')
    return str(path)


def test_ten_views_of_an_imagedata_net_equal_brewnet_test_views(tmp_path, capsys):
    s = _image_net(tmp_path)
    t = owl_tools.NetTester(s, "loss", "accuracy", 0)
    t.build_net()                                   # no snapshot 0: the fillers (seeded)
    t.builder.save_net_to_file(t.owl_net, t.snapshot_dir, 0)
    top2 = t.run(True)
    capsys.readouterr()
    assert main(["test", "--model", str(tmp_path / "net.prototxt"), "--weights",
                 str(tmp_path / "crop_iter_0.caffemodel"), "--views", "10", "--top-k", "1,2",
                 "--iterations", "3"]) == 0
    err = capsys.readouterr().err
    core = {k: float(v) for k, v in re.findall(r"\] top-(\d) = ([\d.]+)", err)}
    assert "Views: 10, images: 12" in err and top2 == pytest.approx(core["2"], abs=1e-6)
    assert main(["owl", "multiview_test", s, "loss", "0"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^Accuracy the \d mb: \d\.0+, batch_size: 4$", out, re.M)) == 3
    assert float(re.search(r"Testing Accuracy: ([\d.]+)", out).group(1)) == pytest.approx(core["1"], abs=1e-6)
    # owl's own loop: ten forward('MULTI_VIEW') calls, their softmax summed, give the same scores.
    from brewnet.analysis.multiview import data_layer_scores

    m = owl_tools.MultiviewTester(s, "loss", 0)
    m.build_net()
    loss = m.owl_net.get_units_by_name("loss")[0]
    total = sum(_view(m.owl_net, loss) for _ in range(10))
    first, _ = next(data_layer_scores(tmp_path / "net.prototxt", str(tmp_path / "crop_iter_0.caffemodel"),
                                      10, 1, "loss"))
    assert np.abs(total / 10 - first).max() < 1e-6


def _view(net, loss):
    net.forward("MULTI_VIEW")
    return loss.ff_y.to_numpy()


def test_an_owl_script_runs_unchanged_through_brewnet_run(small_test, tmp_path):
    if not (REPO / "brewnet" / "tools" / "run.py").exists():
        pytest.skip("brewnet run (brewnet/tools/run.py) is not in this checkout")
    d, s = small_test
    script = tmp_path / "owl_test.py"
    script.write_text(
        "import sys\nimport owl\nimport owl.net as net\nfrom owl.net.trainer import NetTester\n"
        "owl.initialize(sys.argv)\n"
        "tester = NetTester(sys.argv[1], 'loss', 'accuracy', int(sys.argv[2]), 0)\n"
        "tester.build_net()\ntester.run(False)\n"
        "print('units', len(tester.owl_net.units), type(tester.owl_net).__module__)\n")
    r = subprocess.run([sys.executable, "-m", "brewnet.cli", "run", str(script), s, "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    mine = owl_tools.NetTester(s, "loss", "accuracy", 3)
    mine.build_net()
    assert f"Testing Accuracy: {mine.run(False):f}" in r.stdout
    assert "units 11 brewnet.owl.net.net" in r.stdout


def test_a_snapshot_index_without_a_snapshot_interval_is_one_clear_line(trained, tmp_path, capsys):
    d, _, _ = trained
    path = tmp_path / "s.prototxt"
    path.write_text(f'net: "{d / "lenet.prototxt"}" test_iter: 1 test_interval: 10 base_lr: 0.01 max_iter: 1\n')
    assert main(["owl", "net_tester", str(path), "loss", "accuracy", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("brewnet owl net_tester: snapshot index 2: the solver has no 'snapshot' interval to "
                   "turn it into an iteration (snapshot: 0)")


def test_a_layer_whose_shape_changed_is_refilled_as_owl_finetunes(small_test, tmp_path, caplog):
    """ip2 with 5 outputs instead of 10: snapshot 3 loads every layer but ip2, which keeps its
    fillers ("Weight Need Reinit ip2"); NetTrainer resumes from index 3 the same way."""
    import logging

    d, _ = small_test
    five = tmp_path / "five.prototxt"
    five.write_text((d / "small.prototxt").read_text().replace("num_output: 10", "num_output: 5"))
    s = tmp_path / "five_solver.prototxt"
    s.write_text(SOLVER.format(net=five, prefix=d / "lenet", test="").replace("max_iter: 30", "max_iter: 31"))
    trained = weights(d / "lenet_iter_30.caffemodel")
    with caplog.at_level(logging.INFO, logger="brewnet"):
        f = owl_tools.FeatureExtractor(str(s), 3)
        f.build_net()
        t = owl_tools.NetTrainer(str(s), 3)
        t.build_net()
    assert caplog.text.count("Weight Need Reinit ip2") == 2 and "Reinit conv1" not in caplog.text
    for net in (f.owl_net.core("TEST"), t.owl_net.core("TRAIN")):
        conv1 = net.layer_by_name["conv1"].blobs[0].detach().numpy().reshape(-1)
        assert np.array_equal(conv1, trained[("conv1", 0)])
        assert tuple(net.layer_by_name["ip2"].blobs[0].shape) == (5, 500)
    assert t.owl_net.trainer_solver.iter == 30


def test_owls_net_structure_and_passes(trained):
    """What owl code reaches for: units by name (a unit per phase variant), the weighted units,
    out_shape in owl's order, receptive fields, forward/backward and the gradients."""
    from brewnet.owl.net import CaffeNetBuilder, Net

    _, s, _ = trained
    net = Net()
    CaffeNetBuilder(s).build_net(net)
    assert len(net.name_to_uid["mnist"]) == 2 and net.batch_size == 16
    assert [net.units[u].name for u in net.loss_uids] == ["loss"]
    net.compute_size("TRAIN")
    assert [net.units[u].name for u in net.get_weighted_unit_ids()] == ["conv1", "conv2", "ip1", "ip2"]
    conv2 = net.get_units_by_name("conv2")[0]
    assert conv2.out_shape == [8, 8, 50]                       # [W, H, C], as owl's
    assert (conv2.rec_on_ori, conv2.stride_on_ori, conv2.start_on_ori) == (14, 2, 0)
    net.forward("TRAIN")
    net.backward("TRAIN")
    assert conv2.out.shape == [8, 8, 50, 16] and conv2.out.to_numpy().shape == (16, 50, 8, 8)
    assert np.abs(conv2.weightgrad.to_numpy()).sum() > 0
    ip1, relu1 = (net.get_units_by_name(n)[0].out.to_numpy() for n in ("ip1", "relu1"))
    assert (ip1 < 0).any() and np.array_equal(np.maximum(ip1, 0), relu1)
    assert net.get_units_by_name("loss")[0].getloss() > 0


def _caffe_to_owl(model: Path, state: Path, folder: Path) -> None:
    """Minerva's scripts/modelconvertor/caffe2minerva.py (CaffeModelLoader) layout: filters turned
    by 180 degrees, InnerProduct weights transposed; the momentum as owl's delta (-history)."""
    folder.mkdir(parents=True)
    net = read_binary(str(model), pb.NetParameter())
    history = iter(read_binary(str(state), pb.SolverState()).history)
    for l in net.layer:
        for blob, kind in zip(l.blobs, ("weights", "bias")):
            for name, values in ((kind, np.array(blob.data, np.float32)),
                                 (kind + "delta", -np.array(next(history).data, np.float32))):
                shape = tuple(blob.shape.dim)
                if kind == "weights" and l.type == "Convolution":
                    values = np.array([[np.rot90(f, 2) for f in o] for o in values.reshape(shape)])
                elif kind == "weights":
                    values = values.reshape(shape).T
                values.astype(np.float32).tofile(folder / f"{l.name}_{name}.dat")


def test_owls_own_snapshot_folders_load(trained, tmp_path, capsys):
    """A model saved by owl (snapshot<k>/<layer>_weights.dat...) tests as the caffemodel it was
    converted from, and NetTrainer resumes with owl's momentum as Caffe's SGD history."""
    d, _, _ = trained
    _caffe_to_owl(d / "lenet_iter_30.caffemodel", d / "lenet_iter_30.solverstate", tmp_path / "models" / "snapshot3")
    s = solver(tmp_path, d / "lenet.prototxt", "models")        # owl's snapshot_prefix: a folder
    tester = owl_tools.NetTester(s, "loss", "accuracy", 3)
    tester.build_net()
    caffe = owl_tools.NetTester(solver(tmp_path, d / "lenet.prototxt", str(d / "lenet"), name="c"),
                                "loss", "accuracy", 3)
    caffe.build_net()
    assert tester.run(False) == caffe.run(False)
    t = owl_tools.NetTrainer(s, 3)
    t.build_net()
    state = read_binary(str(d / "lenet_iter_30.solverstate"), pb.SolverState())
    s_ = t.owl_net.trainer_solver
    assert s_.iter == 30
    for h, want in zip(s_.history, state.history):
        assert np.array_equal(h.numpy().reshape(-1), np.array(want.data, np.float32))
    got = {(l.name, i): b.detach().numpy().reshape(-1) for l in s_.net.layer_list for i, b in enumerate(l.blobs)}
    assert max_diff(got, weights(d / "lenet_iter_30.caffemodel")) == 0


def test_run_builds_the_net_when_build_net_was_not_called(small_test, tmp_path):
    _, s = small_test
    assert owl_tools.FeatureExtractor(s, 3).run("ip2", tmp_path / "f.txt") == 2
    assert len(owl_tools.FilterVisualizer(s, 3, "conv1", tmp_path / "v").run()) == 20
