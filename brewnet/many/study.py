"""The Optuna side of ``brewnet search``: the study (storage, sampler, pruner), the stale trials
of dead workers, and what a user reads afterwards (the table, the best trial's files, plots).

Storage: a URL (``sqlite:///f.db``, ``postgresql://user@host/db``, ``mysql://...``: Optuna's
RDBStorage, with heartbeats) or a journal file (``journal:PATH`` or a path ending ``.journal``;
the default is ``OUT/study.journal``, which workers on one machine share through its file lock).
A trial whose worker died is failed and retried once (Optuna's ``RetryFailedTrialCallback``):
on an RDB storage when its heartbeat stops (``grace`` seconds after), on any storage at once
when its worker ran on this host and its process is gone.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import shutil
import socket
import time
import warnings

from .space import SearchError

log = logging.getLogger("brewnet")
SAMPLERS = ("tpe", "random", "cmaes", "grid")
PRUNERS = ("median", "hyperband", "sha", "none")
INSTALL = 'pip install "brewnet[search]"'
RUN_ATTRS = ("worker", "folder", "iters", "wall_s", "last", "error", "engine")   # what a run of a trial records


def optuna():
    """Optuna, or a SearchError saying how to install it."""
    try:
        import optuna as o
    except ImportError:
        raise SearchError(f"brewnet search needs Optuna: {INSTALL}") from None
    o.logging.set_verbosity(o.logging.WARNING)
    return o


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def parse_objective(spec: str) -> tuple[str, str]:
    """``"accuracy:max"`` -> ("accuracy", "maximize"); no direction: minimise a loss, else maximise."""
    name, _, way = spec.partition(":")
    name, way = name.strip(), way.strip().lower()
    if not name:
        raise SearchError(f"--objective '{spec}': expected NAME[:max|min] (a TEST output, e.g. accuracy:max)")
    if way and way not in ("max", "min"):
        raise SearchError(f"--objective '{spec}': the direction is max or min, got '{way}'")
    if not way:
        way = "min" if "loss" in name else "max"
    return name, "maximize" if way == "max" else "minimize"


def storage(url: str | None, out: str, heartbeat: int = 60):
    """Optuna storage for ``url`` (None: the journal file under ``out``)."""
    o = optuna()
    if url is None or url.startswith("journal:") or url.endswith(".journal"):
        from optuna.storages.journal import JournalFileBackend

        path = os.path.join(out, "study.journal") if url is None else url.removeprefix("journal:")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return o.storages.JournalStorage(JournalFileBackend(path))
    if url.split(":", 1)[0].split("+")[0] not in ("sqlite", "postgresql", "mysql"):
        raise SearchError(f"--storage '{url}': expected sqlite:///FILE, postgresql://..., "
                          "mysql://... or a .journal file")
    url = _mysql_driver(url)
    for attempt in range(5):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", o.exceptions.ExperimentalWarning)
                return _retrying_rdb(o)(url, heartbeat_interval=heartbeat, grace_period=3 * heartbeat,
                                        heartbeat_stale_trial_callback=retry_once())
        except ImportError as e:
            raise SearchError(f"--storage {url.split(':')[0]}: a database driver is missing ({e}); "
                              f"{INSTALL} installs PostgreSQL's and MySQL's") from None
        except Exception as e:   # sqlalchemy's OperationalError...: one line, the server's words
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # workers creating the tables at once: one wins, load it (MySQL says "Duplicate entry")
            if "duplicate" in first.lower() or "already exists" in first.lower():
                time.sleep(0.5 + attempt)
                continue
            raise SearchError(f"--storage {url}: cannot open the study database: {first}") from None
    raise SearchError(f"--storage {url}: cannot create the study tables: {first}")


def dashboard_command(url: str | None, out: str) -> str:
    """The one command that opens the study's storage in optuna-dashboard (which reads a journal
    file by its path, and an RDB by its SQLAlchemy URL)."""
    import shlex

    if url is None or url.startswith("journal:") or url.endswith(".journal"):
        target = os.path.join(out, "study.journal") if url is None else url.removeprefix("journal:")
    else:
        target = _mysql_driver(url)
    return f"optuna-dashboard {shlex.quote(target)}"


# The storage calls that write: a deadlock (InnoDB between two workers' locks; PostgreSQL too)
# rolls the whole transaction back, so it is safe to issue again, which Optuna does not do.
WRITES = ("create_new_study", "create_new_trial", "set_trial_param", "set_trial_state_values",
          "set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr",
          "set_study_user_attr", "set_study_system_attr", "record_heartbeat")
TRANSIENT = ("deadlock", "lock wait timeout", "could not serialize")


def _retrying_rdb(o):
    """Optuna's RDBStorage whose writes are issued again (5 tries) after a deadlock."""
    def retrying(name):
        method = getattr(o.storages.RDBStorage, name)

        def call(self, *args, **kw):
            for attempt in range(5):
                try:
                    return method(self, *args, **kw)
                except o.exceptions.StorageInternalError as e:
                    why = str(e.__cause__ or e).lower()
                    if attempt == 4 or not any(t in why for t in TRANSIENT):
                        raise
                    log.debug("%s: %s; issued again", name, why.splitlines()[0])
                    time.sleep(0.05 * 2 ** attempt)
        call.__name__ = name
        return call

    return type("RetryingRDBStorage", (o.storages.RDBStorage,), {n: retrying(n) for n in WRITES})


def _mysql_driver(url: str) -> str:
    """``mysql://`` names SQLAlchemy's default driver, mysqlclient (a C build); where it is not
    installed, PyMySQL (the search extra's, pure Python) serves the same URL."""
    if not url.startswith("mysql://"):
        return url
    import importlib.util

    if importlib.util.find_spec("MySQLdb") is None and importlib.util.find_spec("pymysql") is not None:
        return "mysql+pymysql://" + url.removeprefix("mysql://")
    return url


def retry_once():
    """Optuna's callback that enqueues a dead worker's trial again, once (without what the dead
    run recorded: its worker, folder, iterations)."""
    import copy

    from optuna import storages

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(storages, "RetryHeartbeatStaleTrialCallback", None) or storages.RetryFailedTrialCallback
        retry = cls(max_retry=1)

    def call(study, trial):
        trial = copy.copy(trial)
        trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in RUN_ATTRS}
        retry(study, trial)
    return call


def sampler(name: str, seed, space):
    o = optuna()
    if name == "tpe":
        return o.samplers.TPESampler(seed=seed)
    if name == "random":
        return o.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise SearchError("--sampler cmaes needs the cmaes package: pip install cmaes") from None
        return o.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "grid":
        return o.samplers.GridSampler({d.key: d.grid(space.where) for d in space.searched()}, seed=seed)
    raise SearchError(f"--sampler {name}: unknown; known: {', '.join(SAMPLERS)}")


def pruner(name: str, min_iters: int, max_iters: int):
    o = optuna()
    if name == "median":
        return o.pruners.MedianPruner()
    if name == "hyperband":
        return o.pruners.HyperbandPruner(min_resource=min_iters, max_resource=max_iters)
    if name == "sha":
        return o.pruners.SuccessiveHalvingPruner(min_resource=min_iters)
    if name == "none":
        return o.pruners.NopPruner()
    raise SearchError(f"--pruner {name}: unknown; known: {', '.join(PRUNERS)}")


def load(url, name, out=None, direction=None, heartbeat: int = 60, **kw):
    """The study ``name`` in ``url``: created (``direction`` given) or loaded."""
    o = optuna()
    st = storage(url, out or ".", heartbeat)
    if direction is None:
        try:
            return o.load_study(study_name=name, storage=st)
        except KeyError:
            names = [s.study_name for s in o.get_all_study_summaries(st)]
            raise SearchError(f"--study {name}: no such study in {url or out}; it has "
                              f"{', '.join(names) or 'none'}") from None
    study = o.create_study(storage=st, study_name=name, direction=direction, load_if_exists=True, **kw)
    if study.direction.name.lower() != direction:
        raise SearchError(f"--study {name}: it {study.direction.name.lower()}s its objective; "
                          f"this search would {direction.removesuffix('e')}e it")
    return study


def fail_dead(study, grace: float = 180) -> None:
    """Fail (and retry once) the running trials whose worker is gone: stale heartbeats, a
    worker on this host whose process no longer exists, or none named ``grace`` s after start."""
    o = optuna()
    from optuna.trial import TrialState

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", o.exceptions.ExperimentalWarning)
        o.storages.fail_stale_trials(study)
    host = socket.gethostname()
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who, _, pid = str(t.user_attrs.get("worker", "")).rpartition(":")
        if not who:       # killed between ask and saying who it is: dead once a grace has passed
            if (now - t.datetime_start).total_seconds() < grace:
                continue
        elif who != host or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            won = study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        except o.exceptions.UpdateFinishedTrialError:
            won = False
        if won:
            log.info("Trial %d: its worker (process %s) is gone; failed, retried once", t.number, pid)
            retry_once()(study, study._storage.get_trial(t._trial_id))


def _alive(pid: int) -> bool:
    from ..proto.io import _pid_alive

    if pid == os.getpid():
        return True
    if not _pid_alive(pid):
        return False
    try:                                 # a zombie (killed, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def counted(trials) -> list:
    """The trials that stand for a point of the search: not a dead worker's failed attempt that
    was retried, nor one asked over the --trials budget."""
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    return [t for t in trials if t.number not in retried and not t.user_attrs.get("over_budget")]


def _fmt(v) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return "-" if v is None else str(v)


def table(study) -> str:
    """One line per trial: its params, objective, iterations run, state, wall time."""
    trials = counted(study.get_trials(deepcopy=False))
    keys = sorted({k for t in trials for k in t.params})
    obj = study.user_attrs.get("objective", "objective")
    best = _best(study)
    head = ["trial", *keys, obj, "iters", "state", "wall s"]
    rows = []
    for t in trials:
        value = t.value if t.value is not None else t.user_attrs.get("last")
        rows.append([f"{t.number}{'*' if best is not None and t.number == best.number else ''}",
                     *[_fmt(t.params.get(k)) for k in keys], _fmt(value), _fmt(t.user_attrs.get("iters")),
                     t.state.name.lower(), _fmt(t.user_attrs.get("wall_s"))])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    text = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    if best is not None:
        text.append(f"best: trial {best.number}, {obj} = {best.value:.6g}")
    return "\n".join(text)


def _best(study):
    try:
        return study.best_trial
    except ValueError:            # no trial completed yet
        return None


def copy_best(study, out: str) -> str | None:
    """The best trial's prototxts and last snapshot into ``out/best/``; its folder or None."""
    best = _best(study)
    folder = best.user_attrs.get("folder") if best is not None else None
    if not folder or not os.path.isdir(folder):
        if best is not None:
            log.info("Best trial %d ran on %s; its files are there (%s)", best.number,
                     best.user_attrs.get("worker", "?"), folder)
        return None
    dest = os.path.join(out, "best")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    names = sorted(os.listdir(folder))
    it = best.user_attrs.get("iters")
    for n in names:
        if n.endswith(".prototxt") or (f"_iter_{it}." in n and not n.endswith(".tmp")):
            shutil.copy2(os.path.join(folder, n), dest)
    return dest


def plots(study, out: str) -> list[str]:
    """Optuna's plots as PNGs in ``out``: optimisation history, parallel coordinates, parameter
    importances, intermediate values (a plot the trials cannot make yet is skipped, said why)."""
    import warnings

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optuna()
    from optuna.visualization import matplotlib as vis

    made = []
    for name in ("optimization_history", "parallel_coordinate", "param_importances",
                 "intermediate_values"):
        path = os.path.join(out, f"{name}.png")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = getattr(vis, f"plot_{name}")(study)
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.set_size_inches(9, 6)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            made.append(path)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            log.info("Plot %s skipped: %s", name, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return made
