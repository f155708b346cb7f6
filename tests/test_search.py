"""``brewnet search``: bad space files are one clear error naming the key; a seeded search asks
the same trials and gets the same objectives; a pruned trial leaves its fused or together group
and the others' files equal their unpruned runs; kill -9 and resume; two workers on one journal
and on a real PostgreSQL server finish the study without running a trial twice."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna", reason='brewnet search needs Optuna: pip install "brewnet[search]"')

from brewnet.cli import main  # noqa: E402
from brewnet.many import study as st  # noqa: E402
from brewnet.many.fused import FusedSolvers  # noqa: E402
from brewnet.many.search import Search  # noqa: E402
from brewnet.many.space import SearchError, Space  # noqa: E402
from brewnet.many.together import TrainTogether  # noqa: E402
from helpers import random_digits_lmdb  # noqa: E402

NET = """name: "tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 8 backend: LMDB }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  transform_param {{ scale: 0.00390625 }} data_param {{ source: "{lmdb}" batch_size: 10 backend: LMDB }} }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  inner_product_param {{ num_output: 12 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy" include {{ phase: TEST }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""
SOLVER = ('net: "tiny.prototxt" base_lr: 0.05 lr_policy: "fixed" momentum: 0.9 max_iter: {iters} '
          'display: 0 test_iter: 2 test_interval: 3 solver_mode: CPU')
SPACE = "base_lr: {log_uniform: [0.005, 0.3]}\nmomentum: {uniform: [0.5, 0.95]}\n"
TOPOLOGY = SPACE + "ip1.num_output: {int: [8, 16, step 4]}\n"


@pytest.fixture
def solver_file(tmp_path):
    lmdb = random_digits_lmdb(tmp_path / "lmdb", 40, 6, seed=8)
    (tmp_path / "tiny.prototxt").write_text(NET.format(lmdb=lmdb))
    f = tmp_path / "tiny_solver.prototxt"
    f.write_text(SOLVER.format(iters=6))
    return f


def space(tmp_path, text: str, name: str = "space.yaml") -> Path:
    (tmp_path / name).write_text(text)
    return tmp_path / name


def study_of(out: Path, name: str = "tiny_solver"):
    return st.load(f"journal:{out / 'study.journal'}", name)


@pytest.mark.parametrize("text, error", [
    ("basee_lr: {uniform: [0.1, 0.2]}", r"basee_lr: not a SolverParameter field.*did you mean 'base_lr'\?"),
    ("ipp1.num_output: [4, 8]", r"ipp1.num_output: no layer 'ipp1' in the solver's nets; did you mean 'ip1'\?"),
    ("ip1.num_outptu: [4, 8]", r"ip1.num_outptu: layer 'ip1' \(InnerProduct\) has no field 'num_outptu'.*"
                               r"did you mean 'ip1.num_output'\?"),
    ("ip1.num_output: {uniform: [4, 8]}", r"ip1.num_output takes an integer; a uniform range gives floats"),
    ("max_iter: [10, 2.5]", r"max_iter takes an integer, got '2.5'"),
    ("base_lr: {log_uniform: [0.1, 0.01]}", r"base_lr: empty range \[0.1, 0.01\] \(low > high\)"),
    ("momentum: []", r"momentum: an empty list of values"),
    ("base_lr: {log_uniform: [0, 0.1]}", r"base_lr: a log range needs low > 0"),
    ("ip1.num_output: {int: [8, 30, step 4]}", r"ip1.num_output: the range \[8, 30\] is not a whole number of steps"),
    ("lr_policy: [step, fast]", r"lr_policy: Unknown lr_policy 'fast'"),
    ("solver_mode: [CPU, TPU]", r"solver_mode takes one of CPU, GPU, got 'TPU'"),
    ("momentum: {normal: [0, 1]}", r"momentum: expected one of uniform, log_uniform, int, log_int, choice"),
    ("base_lr: 0.1", r"every field has one value"),
    ("- base_lr", r"expected a map of field: range"),
])
def test_bad_space_files_name_the_key(solver_file, tmp_path, text, error):
    f = space(tmp_path, text + "\n")
    with pytest.raises(SearchError, match=f"^{f}: {error}"):
        Space.load(f, str(solver_file))


def test_bad_input_is_one_line(solver_file, tmp_path, capsys):
    f = space(tmp_path, "momentun: {uniform: [0.5, 0.9]}\n")
    assert main(["search", "--solver", str(solver_file), "--space", str(f), "--trials", "2",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'momentum'?" in err and "Traceback" not in err
    f = space(tmp_path, SPACE)
    assert main(["search", "--solver", str(solver_file), "--space", str(f), "--trials", "2",
                 "--objective", "acc:max", "--out", str(tmp_path / "o")]) == 1
    assert "--objective acc: not an output of the TEST net; its outputs: accuracy, loss" in \
        capsys.readouterr().err


def test_missing_optuna_says_how_to_install(solver_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    assert main(["search", "--solver", str(solver_file), "--space", str(space(tmp_path, SPACE)),
                 "--out", str(tmp_path / "o")]) == 1
    assert 'needs Optuna: pip install "brewnet[search]"' in capsys.readouterr().err


def test_net_fields_apply_to_train_and_test_nets(solver_file, tmp_path):
    s = Space.load(space(tmp_path, TOPOLOGY + "relu1.negative_slope: [0.0, 0.1]\n"), str(solver_file))
    p = s.apply({"base_lr": 0.01, "momentum": 0.8, "ip1.num_output": 16, "relu1.negative_slope": 0.1})
    ip1 = [lp for lp in p.net_param.layer if lp.name == "ip1"][0]
    relu = [lp for lp in p.net_param.layer if lp.name == "relu1"][0]
    assert (ip1.inner_product_param.num_output, relu.relu_param.negative_slope) == (16, pytest.approx(0.1))
    assert not p.HasField("net") and abs(p.base_lr - 0.01) < 1e-9


def run_search(solver_file, out, text=SPACE, trials=5, **kw):
    kw.setdefault("seed", 3)
    return Search(str(solver_file), str(space(solver_file.parent, text, f"{out.name}.yaml")), trials,
                  str(out), **kw).run()


def rows(study):
    return [(t.number, t.state.name, t.params, t.value, t.user_attrs.get("iters"))
            for t in st.counted(study.get_trials())]


def test_seeded_search_is_reproducible(solver_file, tmp_path, capsys):
    a = rows(run_search(solver_file, tmp_path / "a", TOPOLOGY, trials=4, group=2))
    b = rows(run_search(solver_file, tmp_path / "b", TOPOLOGY, trials=4, group=2))
    assert a == b and len(a) == 4 and all(s == "COMPLETE" for _, s, *_ in a)
    assert len({r[2]["ip1.num_output"] for r in a}) > 1          # topologies searched too
    # the CLI's table and files, and --show on the finished study
    out = tmp_path / "cli"
    argv = ["search", "--solver", str(solver_file), "--space", str(space(tmp_path, TOPOLOGY)),
            "--trials", "3", "--group", "3", "--seed", "3", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "accuracy:max" in text and "ip1.num_output" in text and "best: trial" in text
    assert {p.name for p in out.glob("*.png")} == {"optimization_history.png", "parallel_coordinate.png",
                                                   "param_importances.png", "intermediate_values.png"}
    assert (out / "best" / "solver.prototxt").exists() and list((out / "best").glob("*_iter_6.caffemodel"))
    assert main(["search", "--show", "--storage", f"journal:{out / 'study.journal'}", "--study",
                 "tiny_solver"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "Study tiny_solver:" and shown[1:] == text.splitlines()[1:len(shown)]


@pytest.mark.parametrize("kw, want", [
    ({}, {8: "together x4", 12: "together x4", 16: "together x4"}),     # the CPU's default
    ({"exact": False}, {8: "fused x2", 12: "together x2", 16: "together x2"}),
    ({"fuse": False}, {8: "together x4", 12: "together x4", 16: "together x4"}),
], ids=["default", "wide", "no-fuse"])
def test_trials_asked_together_fuse_where_their_nets_are_alike(solver_file, tmp_path, kw, want):
    """Alike nets are fused where that is faster: the wide form, or a GPU; on the CPU the
    exact form is slower than training together (benchmarks/search_engines.py), so by default
    the trials asked at once are one together group there."""
    search = Search(str(solver_file), str(space(tmp_path, TOPOLOGY)), 4, str(tmp_path / "o"), group=4,
                    pruner="none", seed=3, **kw)
    for width, lr in ((8, 0.01), (12, 0.02), (8, 0.03), (16, 0.04)):
        search.study.enqueue_trial({"base_lr": lr, "momentum": 0.9, "ip1.num_output": width})
    engines = {t.params["ip1.num_output"]: t.user_attrs["engine"] for t in search.run().trials}
    assert engines == want


class PruneTrial1(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.number == 1


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "together"])
def test_pruned_trial_leaves_its_group_others_unchanged(solver_file, tmp_path, fuse):
    solver_file.write_text(SOLVER.format(iters=9))
    kw = dict(trials=3, group=3, fuse=fuse)
    pruned = run_search(solver_file, tmp_path / "pruned", pruner=PruneTrial1(), **kw)
    full = run_search(solver_file, tmp_path / "full", pruner="none", **kw)
    got = {t.number: (t.state.name, t.user_attrs["iters"]) for t in pruned.trials}
    assert got == {0: ("COMPLETE", 9), 1: ("PRUNED", 4), 2: ("COMPLETE", 9)}
    assert [t.params for t in pruned.trials] == [t.params for t in full.trials]
    for n in (0, 2):
        a = (tmp_path / "pruned" / "trials" / str(n) / "tiny_solver_iter_9.caffemodel").read_bytes()
        assert a == (tmp_path / "full" / "trials" / str(n) / "tiny_solver_iter_9.caffemodel").read_bytes()
    assert pruned.trials[0].value == full.trials[0].value and pruned.trials[2].value == full.trials[2].value


def test_drop_from_fused_and_together_engines(solver_file, tmp_path):
    """The engines alone: net 1 leaves after 2 iterations; nets 0 and 2 end bit for bit as
    in the run where all three train to the end (fused: the exact formulation, the search's;
    the wide one's float32 sums depend on how many nets are stacked)."""
    from brewnet.many.space import Space

    s = Space.load(space(tmp_path, SPACE), str(solver_file))

    def params(tag):
        ps = []
        for k, lr in enumerate((0.01, 0.05, 0.1)):
            p = s.apply({"base_lr": lr, "momentum": 0.9})
            p.random_seed, p.snapshot_prefix = 10 + k, str(tmp_path / f"{tag}{k}")
            ps.append(p)
        return ps

    for engine in (lambda ps: FusedSolvers(ps, exact=True), TrainTogether):
        runs = []
        for drop in (False, True):
            runner = engine(params(f"{getattr(engine, '__name__', 'fused')}{drop}"))
            for i, _ in enumerate(runner.solving()):
                if drop and i == 1:
                    runner.drop(1)
            runs.append([[t.detach().clone() for t in runner.solvers[k].net.learnable] for k in (0, 2)])
            assert runner.solvers[1].iter == (2 if drop else 6) and runner.solvers[0].iter == 6
        for a, b in zip(*runs):
            assert all(x.equal(y) for x, y in zip(a, b)), type(runner).__name__


def search_cmd(solver_file, out, storage, trials=6, group=2):
    return [sys.executable, "-m", "brewnet", "search", "--solver", str(solver_file), "--space",
            str(solver_file.parent / "space.yaml"), "--trials", str(trials), "--group", str(group),
            "--seed", "5", "--pruner", "none", "--out", str(out), "--storage", storage]


def test_resume_after_kill_9(solver_file, tmp_path):
    space(tmp_path, SPACE)
    # 150 iterations: the last pair of trials must still be running when the watcher, reading
    # the journal every 0.1 s on a loaded machine, sees the first two complete (15 was too few)
    solver_file.write_text(SOLVER.format(iters=150))
    out = tmp_path / "out"
    cmd = search_cmd(solver_file, out, f"journal:{out / 'study.journal'}", trials=4)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            time.sleep(0.1)
            assert proc.poll() is None, "the search ended before it could be killed mid-trial"
            if not (out / "study.journal").exists():
                continue
            trials = study_of(out).trials
            states = [t.state.name for t in trials]
            running = [t for t in trials if t.state.name == "RUNNING"]
            if states.count("COMPLETE") >= 2 and running and all("folder" in t.user_attrs for t in running):
                break                   # (a trial just asked has no worker yet: see fail_dead)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    before = study_of(out).trials
    done = {t.number: t.value for t in before if t.state.name == "COMPLETE"}
    killed = {t.number: t.params for t in before if t.state.name == "RUNNING" and "worker" in t.user_attrs}
    # a trial asked between the watcher's last read and the kill, before its worker named itself:
    # nothing tells it from another host's trial yet, so fail_dead fails it only after its grace
    asked = [t.number for t in before if t.state.name == "RUNNING" and "worker" not in t.user_attrs]
    assert len(done) >= 2 and killed
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = study_of(out).trials
    assert {t.number: t.value for t in after if t.number in done} == done      # kept, not rerun
    assert all(after[n].state.name == "RUNNING" for n in asked)
    for n, params in killed.items():
        assert after[n].state.name == "FAIL"                                   # retried once:
        retry = [t for t in after if t.system_attrs.get("failed_trial") == n]
        assert len(retry) == 1 and retry[0].params == params and retry[0].state.name == "COMPLETE"
    counted = st.counted(after)      # (an asked trial counts towards the 4, as a point asked)
    assert len(counted) == 4 and all(t.state.name == "COMPLETE" for t in counted if t.number not in asked)


def two_workers(solver_file, tmp_path, storage):
    space(tmp_path, SPACE)
    # Trials long enough that the worker which starts second, after its interpreter and torch
    # load, still finds trials to take on a loaded machine: at 40 iterations one worker ran all 8
    # in ~2 s and CI's second worker came later (a clean clone's CI failed so); 600 gives ~7 s.
    solver_file.write_text(SOLVER.format(iters=600))
    outs = [tmp_path / "w0", tmp_path / "w1"]
    procs = [subprocess.Popen(search_cmd(solver_file, o, storage, trials=8), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for o in outs]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    study = st.load(storage, "tiny_solver")
    counted = st.counted(study.get_trials())
    assert len(counted) == 8 and all(t.state.name == "COMPLETE" for t in counted)
    ran = [int(d.name) for o in outs if (o / "trials").is_dir() for d in (o / "trials").iterdir()]
    assert sorted(ran) == sorted(t.number for t in counted)         # each trial ran once, somewhere
    assert len({t.user_attrs["worker"] for t in counted}) == 2         # both workers trained
    assert not [t for t in study.get_trials() if t.state.name in ("RUNNING", "WAITING")]


def test_two_workers_on_one_journal(solver_file, tmp_path):
    two_workers(solver_file, tmp_path, f"journal:{tmp_path / 'shared.journal'}")


def _postgres_bin():
    found = shutil.which("initdb") or next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))), None)
    return Path(found).resolve().parent if found else None


@pytest.fixture
def postgres():
    """A throwaway PostgreSQL server on a localhost port (as user postgres when run as root:
    initdb refuses root)."""
    pytest.importorskip("psycopg2", reason='PostgreSQL storage needs psycopg2: pip install "brewnet[search]"')
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian: apt-get install postgresql)")
    as_user = []
    root = Path(tempfile.mkdtemp(prefix="brewnet-pg-"))    # pytest's tmp is root's alone
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user for initdb")
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"
    subprocess.run(as_user + [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                              "--no-sync", "-E", "UTF8"], check=True, capture_output=True)
    subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o",
                              f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_on_postgresql(solver_file, tmp_path, postgres):
    two_workers(solver_file, tmp_path, postgres)


def _mariadb_bin():
    found = [shutil.which(n) or next((f"{d}/{n}" for d in ("/usr/sbin", "/usr/bin")
                                      if os.access(f"{d}/{n}", os.X_OK)), None)
             for n in ("mariadbd", "mariadb-install-db")]
    return found if all(found) else None


@pytest.fixture
def mysql():
    """A throwaway MariaDB server (MySQL's protocol) on a localhost port, no grant tables (as
    user mysql when run as root: mariadbd refuses root), with an empty database."""
    pymysql = pytest.importorskip("pymysql", reason='MySQL storage needs PyMySQL: pip install "brewnet[search]"')
    found = _mariadb_bin()
    if found is None:
        pytest.skip("MariaDB's mariadbd/mariadb-install-db are not installed (Debian: apt-get install "
                    "mariadb-server)")
    server, install = found
    root = Path(tempfile.mkdtemp(prefix="brewnet-my-"))
    user = []
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("mysql")
        except KeyError:
            pytest.skip("running as root and there is no 'mysql' user for mariadbd")
        shutil.chown(root, "mysql")
        user = ["--user=mysql"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"
    subprocess.run([install, "--no-defaults", f"--datadir={data}", "--skip-test-db",
                    "--auth-root-authentication-method=normal"] + user, check=True, capture_output=True)
    proc = subprocess.Popen([server, "--no-defaults", f"--datadir={data}", f"--socket={root / 'sock'}",
                             f"--port={port}", "--bind-address=127.0.0.1", "--skip-grant-tables",
                             f"--log-error={root / 'err.log'}", "--innodb-flush-log-at-trx-commit=0"] + user,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with pymysql.connect(host="127.0.0.1", port=port, user="root") as c:
                    c.cursor().execute("CREATE DATABASE brewnet")
                break
            except pymysql.err.OperationalError:
                if proc.poll() is not None:
                    pytest.fail(f"mariadbd exited: {(root / 'err.log').read_text()[-2000:]}")
                time.sleep(0.1)
        else:
            pytest.fail("mariadbd did not accept connections in 60 s")
        yield f"mysql://root@127.0.0.1:{port}/brewnet"     # the driver: brewnet's choice (PyMySQL)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_on_mysql(solver_file, tmp_path, mysql):
    two_workers(solver_file, tmp_path, mysql)


def test_rdb_writes_are_issued_again_after_a_deadlock(tmp_path, monkeypatch):
    """Two workers' transactions on MySQL (InnoDB) may deadlock; the database rolls one back
    and expects it issued again, which Optuna leaves to its caller. Other errors raise at once."""
    import sqlalchemy.exc

    calls = []
    real = optuna.storages.RDBStorage.set_trial_user_attr

    def flaky(self, trial_id, key, value):
        calls.append(key)
        if key == "bad" or len(calls) < 3:
            cause = sqlalchemy.exc.OperationalError(
                "INSERT", {}, Exception("(1213, 'Deadlock found when trying to get lock; try "
                                        "restarting transaction')" if key != "bad" else "Data too long"))
            raise optuna.exceptions.StorageInternalError("commit failed") from cause
        return real(self, trial_id, key, value)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_user_attr", flaky)
    study = st.load(f"sqlite:///{tmp_path / 's.db'}", "dl", direction="maximize")
    trial = study.ask()
    trial.set_user_attr("worker", "w")
    assert calls == ["worker"] * 3 and study.trials[0].user_attrs == {"worker": "w"}
    with pytest.raises(optuna.exceptions.StorageInternalError):
        trial.set_user_attr("bad", 1)
    assert calls.count("bad") == 1


def test_silent_worker_on_rdb_storage_is_failed_and_retried(tmp_path):
    """A worker elsewhere stops sending heartbeats mid-trial: its trial is failed after the
    grace period and enqueued again, once (Optuna's heartbeat and retry)."""
    study = st.load(f"sqlite:///{tmp_path / 's.db'}", "hb", direction="maximize", heartbeat=1)
    trial = study.ask()
    trial.suggest_float("base_lr", 0.01, 0.1)
    trial.set_user_attr("worker", "another-host:1")       # not this host's: only heartbeats tell
    study._storage.record_heartbeat(trial._trial_id)
    st.fail_dead(study, grace=3)
    assert study.trials[0].state.name == "RUNNING"
    time.sleep(5)                 # past the 3 s grace (SQLite's clock counts whole seconds)
    st.fail_dead(study, grace=3)
    first, retry = study.trials
    assert first.state.name == "FAIL" and retry.state.name == "WAITING"
    assert retry.params == first.params and "worker" not in retry.user_attrs


def test_workers_creating_the_tables_at_once_load_the_winners(monkeypatch, tmp_path):
    """Two workers starting on a fresh database both create Optuna's tables; the loser's error
    (MySQL: "Duplicate entry" in alembic's version table, a CI run's failure) means load it."""
    calls = []

    def fake_rdb(url, **kw):
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError("(pymysql.err.IntegrityError) (1062, \"Duplicate entry 'v3.2.0.a' "
                               "for key 'PRIMARY'\")\n[SQL: INSERT INTO alembic_version ...]")
        return "storage"

    monkeypatch.setattr(st, "_retrying_rdb", lambda o: fake_rdb)
    monkeypatch.setattr(st.time, "sleep", lambda s: None)
    assert st.storage("mysql://root@127.0.0.1:1/brewnet", str(tmp_path)) == "storage"
    assert len(calls) == 2
    calls.clear()
    monkeypatch.setattr(st, "_retrying_rdb", lambda o: lambda url, **kw: (_ for _ in ()).throw(
        RuntimeError("(pymysql.err.OperationalError) (1045, \"Access denied\")")))
    with pytest.raises(SearchError, match="cannot open the study database: .*Access denied"):
        st.storage("mysql://root@127.0.0.1:1/brewnet", str(tmp_path))
