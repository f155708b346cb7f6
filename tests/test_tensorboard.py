"""TensorBoard event files (``brewnet train --tensorboard DIR``, ``brewnet.solvers.tensorboard``,
``brewnet search --tensorboard DIR``) read back with tensorboard's own EventAccumulator: the tags
and steps a short LeNet run logs, a run per solver trained together or fused, a run per search
trial with its parameters as hparams; without the package, one line naming the extra. And
``brewnet plot``'s log axis for the losses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from brewnet.cli import main
from brewnet.solvers.tensorboard import run_names
from helpers import GOLDEN, MODELS, need

pytest.importorskip("tensorboard", reason="TensorBoard event files need tensorboard: "
                                          "pip install 'brewnet[tensorboard]'")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

FASHION_LMDB = GOLDEN / "lmdb" / "fashion_mnist_test_lmdb"
SOLVER = ('net: "{net}" test_iter: 2 test_interval: 10 base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 '
          'lr_policy: "inv" gamma: 0.0001 power: 0.75 display: 5 max_iter: 20 snapshot_prefix: "{prefix}" '
          'random_seed: {seed} solver_mode: CPU type: "{type}"')


def scalars(run: Path) -> dict[str, list[int]]:
    """{tag: the steps it was written at} of one run folder, as TensorBoard reads them."""
    ea = EventAccumulator(str(run))
    ea.Reload()
    return {t: [e.step for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


@pytest.fixture
def lenet(tmp_path):
    """Caffe's LeNet train_test net on the shared Fashion-MNIST LMDB, batches of 16; a solver
    file writer (20 iterations, display 5, tests at 0, 10, 20)."""
    text = (MODELS / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt").read_text()
    for old in ("examples/mnist/mnist_train_lmdb", "examples/mnist/mnist_test_lmdb"):
        text = text.replace(old, str(need(FASHION_LMDB)))
    text = text.replace("batch_size: 64", "batch_size: 16").replace("batch_size: 100", "batch_size: 16")
    net = tmp_path / "lenet_train_test.prototxt"
    net.write_text(text)

    def solver(name: str, seed: int = 7, type: str = "SGD") -> str:
        f = tmp_path / f"{name}.prototxt"
        f.write_text(SOLVER.format(net=net, prefix=tmp_path / name, seed=seed, type=type))
        return str(f)
    return solver


LENET_TAGS = {   # what 20 iterations of LeNet log: displays at 0, 5, 10, 15, tests at 0, 10, 20
    "train/loss": [0, 5, 10, 15],
    "solver/loss": [0, 5, 10, 15, 20],              # the display lines' smoothed loss, and the last
    "solver/lr": [0, 5, 10, 15],
    "solver/seconds_per_iter": [5, 10, 15],         # since the display before
    "test/accuracy": [0, 10, 20],
    "test/loss": [0, 10, 20],
}


def test_lenet_run_reads_back_with_tensorboard(lenet, tmp_path, caplog):
    solver = lenet("lenet_solver")
    assert main(["train", "--solver", solver, "--tensorboard", str(tmp_path / "tb")]) == 0
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["lenet_solver"]
    got = scalars(tmp_path / "tb" / "lenet_solver")
    assert got == LENET_TAGS
    # the values are the log's: the last test accuracy line
    ea = EventAccumulator(str(tmp_path / "tb" / "lenet_solver"))
    ea.Reload()
    logged = [r.getMessage() for r in caplog.records if "Test net output #0: accuracy" in r.getMessage()]
    assert ea.Scalars("test/accuracy")[-1].value == pytest.approx(float(logged[-1].split()[-1]))


def test_python_hook_sees_every_logged_number(lenet):
    from brewnet.solvers import get_solver

    s = get_solver(lenet("hook"))
    seen: dict[str, list[int]] = {}
    s.add_watcher(lambda tag, value, step: seen.setdefault(tag, []).append(step))
    s.solve()
    assert seen == LENET_TAGS


@pytest.mark.parametrize("fuse", [[], ["--fuse", "exact"]], ids=["together", "fused"])
def test_solvers_trained_together_or_fused_get_a_run_each(lenet, tmp_path, fuse):
    files = [lenet("a_solver", seed=1), lenet("b_solver", seed=2)]
    argv = ["train", *fuse, "--tensorboard", str(tmp_path / "tb")] + [x for f in files for x in ("--solver", f)]
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["a_solver", "b_solver"]
    runs = {name: scalars(tmp_path / "tb" / name) for name in ("a_solver", "b_solver")}
    assert runs["a_solver"] == runs["b_solver"] == LENET_TAGS


def test_run_names_are_the_solver_files_stems():
    assert run_names(["x/solver.prototxt", "y/solver.prototxt", "z/adam.prototxt"]) == \
        ["s0_solver", "s1_solver", "adam"]


def test_without_tensorboard_one_line_names_the_extra(lenet, tmp_path):
    solver = lenet("lenet_solver")
    code = ("import sys; sys.modules['tensorboard'] = None; from brewnet.cli import main; "
            f"sys.exit(main(['train', '--solver', {solver!r}, '--tensorboard', {str(tmp_path / 'tb')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "brewnet train: --tensorboard needs the tensorboard package: pip install 'brewnet[tensorboard]'"]
    assert not (tmp_path / "tb").exists() and not list(tmp_path.glob("lenet_solver_iter_*"))


def test_search_writes_a_run_per_trial_with_its_hparams(tmp_path, capsys):
    pytest.importorskip("optuna", reason='brewnet search needs Optuna: pip install "brewnet[search]"')
    from tensorboard.plugins.hparams import plugin_data_pb2

    from helpers import random_digits_lmdb

    lmdb = random_digits_lmdb(tmp_path / "lmdb", 40, 6, seed=8)
    (tmp_path / "tiny.prototxt").write_text(
        'name: "tiny" layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN } '
        f'transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 8 backend: LMDB }} }} '
        'layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST } '
        f'transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 10 backend: LMDB }} }} '
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        'inner_product_param { num_output: 10 weight_filler { type: "xavier" } } } '
        'layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } } '
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }')
    solver = tmp_path / "tiny_solver.prototxt"
    solver.write_text('net: "tiny.prototxt" base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 max_iter: 6 '
                      'display: 3 test_iter: 2 test_interval: 3 solver_mode: CPU')
    (tmp_path / "space.yaml").write_text("base_lr: {log_uniform: [0.005, 0.3]}\nmomentum: [0.5, 0.9]\n")
    out, tb = tmp_path / "search", tmp_path / "tb"
    assert main(["search", "--solver", str(solver), "--space", str(tmp_path / "space.yaml"), "--trials", "3",
                 "--group", "2", "--seed", "3", "--pruner", "none", "--out", str(out),
                 "--tensorboard", str(tb)]) == 0
    text = capsys.readouterr().out
    assert f"Dashboard: optuna-dashboard {out / 'study.journal'}" in text
    assert sorted(p.name for p in tb.iterdir()) == ["trial_0", "trial_1", "trial_2"]
    import optuna

    study = optuna.load_study(study_name="tiny_solver", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))))
    for t in study.trials:
        run = tb / f"trial_{t.number}"
        assert scalars(run)["test/accuracy"] == [0, 3, 6]
        ea = EventAccumulator(str(run))
        ea.Reload()
        content = ea.PluginTagToContent("hparams")
        start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
        hp = {k: v.number_value if v.HasField("number_value") else v.string_value
              for k, v in start.session_start_info.hparams.items()}
        assert hp == pytest.approx(t.params)
        exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
        assert [m.name.tag for m in exp.experiment.metric_infos] == ["test/accuracy"]
        assert ea.Scalars("test/accuracy")[-1].value == pytest.approx(t.value)


def test_the_dashboard_reads_the_default_journal(tmp_path):
    """optuna-dashboard's own app, given what the printed command gives it (the journal file's
    path), lists the study brewnet search leaves by default."""
    import json
    from wsgiref.util import setup_testing_defaults

    optuna = pytest.importorskip("optuna", reason='brewnet search needs Optuna: pip install "brewnet[search]"')
    dashboard = pytest.importorskip("optuna_dashboard", reason="optuna-dashboard: pip install 'brewnet[dashboard]'")
    from brewnet.many import study as st

    s = st.load(None, "tiny", str(tmp_path), "maximize")
    s.add_trial(optuna.trial.create_trial(params={"x": 1.0}, distributions={
        "x": optuna.distributions.FloatDistribution(0, 2)}, value=0.5))
    command = st.dashboard_command(None, str(tmp_path))
    assert command == f"optuna-dashboard {tmp_path / 'study.journal'}"
    app = dashboard.wsgi(command.split(" ", 1)[1])
    environ = {"PATH_INFO": "/api/studies", "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    said = []
    body = b"".join(app(environ, lambda status, headers, exc=None: said.append(status)))
    assert said == ["200 OK"]
    [study] = json.loads(body)["study_summaries"]
    assert study["study_name"] == "tiny"


def test_plot_puts_losses_on_a_log_axis(lenet, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    assert main(["train", "--solver", lenet("plotted")]) == 0
    log = tmp_path / "train.log"
    log.write_text(capsys.readouterr().err)
    scales = []
    orig = Figure.savefig

    def spy(fig, *a, **kw):
        scales.append([ax.get_yscale() for ax in fig.axes])
        return orig(fig, *a, **kw)
    monkeypatch.setattr(Figure, "savefig", spy)
    assert main(["plot", str(log), "-o", str(tmp_path / "a.png")]) == 0
    assert main(["plot", str(log), "-o", str(tmp_path / "b.png"), "--no-log-y"]) == 0
    assert scales == [["log", "linear", "linear"], ["linear", "linear", "linear"]]
