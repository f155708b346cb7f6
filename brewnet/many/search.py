"""``brewnet search``: Optuna asks, brewnet trains up to K trials at a time on one data stream.

``Search(solver, space, trials=N, group=K, ...)``: ``run()`` asks the study for up to K trials,
applies each one's values (``space.Space``) and trains them in groups, each batch read once per
group: nets that came out alike fused (``FusedSolvers``, exact by default: a trial's numbers are
those of training it alone, whatever its group; ``exact=False``: the faster wide form), the others
together (``TrainTogether``); on the CPU, unless ``fuse=True`` or ``exact=False``, all in one
together group. Each test but iteration 0's reports a named TEST output to the trial, whose
objective is the last one; a pruned trial leaves its group at once and its slot starts the next.
A trial lives in ``OUT/trials/<number>/`` (its prototxts, last snapshot and ``train.log``);
solvers without a ``random_seed`` get ``seed`` (1701), which also seeds the sampler per trial.
Why, and the rules in full: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from ..solvers.logprefix import log_prefix
from . import study as st
from .space import SearchError, Space, inline_nets, write_prototxts

log = logging.getLogger("brewnet")
NET_SEED = 1701
USER_ERRORS = (ValueError, OSError, FloatingPointError)     # a trial's bad net or diverging loss


@dataclass
class Member:
    """A trial in training: its Optuna trial, solver, folder, and what its tests said."""
    trial: object
    param: object
    folder: str
    t0: float = field(default_factory=time.perf_counter)
    last: float | None = None
    seen: object = None
    handler: object = None
    values: dict = field(default_factory=dict)     # the trial's parameters
    board: object = None                           # its TensorBoard run (``tensorboard=``)

    @property
    def prefix(self) -> str:
        return f"[t{self.trial.number}] "


class Group:
    """Trials trained at once: ``engine`` "fused" or "together"; ``step()`` runs one iteration
    of every member still in; ``drop(i)`` takes member i out; ``done(i)``: solved, last test run."""

    def __init__(self, members, device=None, fuse=None, exact=True):
        from .fused import FusedSolvers, FuseError
        from .together import TrainTogether

        self.members = members
        params = [m.param for m in members]
        prefixes = [m.prefix for m in members]
        self.runner, why = None, "--no-fuse"
        if fuse is not False:
            try:
                self.runner = FusedSolvers(params, device=device, exact=exact, prefixes=prefixes)
            except FuseError as e:
                if fuse:
                    raise SearchError(f"cannot fuse trials {self.numbers()}: {e}") from None
                why = str(e)
        self._done: set[int] = set()
        if self.runner is not None:
            self.engine = "fused"
            self._gen = self.runner.solving()
        else:
            self.engine = "together"
            if len(members) > 1:
                log.info("Trials %s trained together, not fused: %s", self.numbers(), why)
            self.runner = TrainTogether(params, device=device, prefixes=prefixes)
            self._runs = [s.solving() for s in self.runner.solvers]
            self._gen = self._rounds()
        self.out: set[int] = set()           # dropped or done
        self.failed: list[tuple[int, str]] = []     # (member, why) not yet told
        self.over = False

    def _rounds(self):
        return self.runner._rounds(self._runs, True, self._done.add)

    def numbers(self) -> str:
        return ", ".join(str(m.trial.number) for m in self.members)

    @property
    def solvers(self):
        return self.runner.solvers

    def live(self) -> list[int]:
        return [i for i in range(len(self.members)) if i not in self.out]

    def step(self) -> None:
        try:
            next(self._gen)
        except StopIteration:
            self.over = True
        except FloatingPointError as e:      # a diverging net: its trial fails, the rest go on
            k = getattr(e, "solver_index", None)
            if k is None or k in self.out:
                raise
            self.failed.append((k, str(e)))
            self.drop(k)
            if self.engine == "fused":
                self._gen = self.runner._running([s.param.max_iter for s in self.solvers], final=True)
            else:
                self._gen = self._rounds()

    def done(self, i: int) -> bool:
        return i in (self.runner.finished if self.engine == "fused" else self._done)

    def drop(self, i: int) -> None:
        self.out.add(i)
        if not self.over:
            self.runner.drop(i)


class Search:
    """An Optuna study of ``space`` (a ``Space`` or a YAML file) over ``solver``; ``run()``
    trains until the study has ``trials`` trials (see the module docstring). ``objective``:
    "NAME[:max|min]"; ``sampler``/``pruner``: names (``study.SAMPLERS``/``PRUNERS``) or Optuna
    objects; ``storage``: a URL or journal path (default ``out/study.journal``); ``on_told(trial)``
    is called as each trial ends here; ``log_format(prefix)``: the Formatter of a trial's
    train.log (the CLI passes Caffe's glog format); ``tensorboard``: a folder where each trial
    writes a TensorBoard run ``trial_<number>``, its parameters as hparams against the objective."""

    def __init__(self, solver, space, trials: int, out: str, group: int = 4,
                 objective: str = "accuracy:max", sampler="tpe", pruner="median", storage=None,
                 study: str | None = None, seed: int | None = None, device=None, fuse=None,
                 exact: bool = True, heartbeat: int = 60, on_told=None, log_format=None,
                 tensorboard: str | None = None):
        if trials < 1 or group < 1:
            raise SearchError(f"--trials and --group must be >= 1, got {trials} and {group}")
        st.optuna()                                   # installed, or say how, before any work
        self.tensorboard = tensorboard
        if tensorboard:
            from ..solvers.tensorboard import check

            check()
        self.space = space if isinstance(space, Space) else Space.load(space, solver)
        self.trials, self.k, self.out, self.seed = trials, group, os.path.abspath(out), seed
        self.device, self.fuse, self.exact, self.on_told = device, fuse, exact, on_told
        self.heartbeat = heartbeat
        # A trial's train.log: log_format(prefix) -> its Formatter (the CLI's: Caffe's glog lines).
        self.log_format = log_format or (lambda prefix: logging.Formatter("%(message)s"))
        self.objective, direction = st.parse_objective(objective)
        base = self.space.base
        self._check_objective(base)
        self.stem = self.space.path.stem if self.space.path is not None else "solver"
        self.sampler_name = sampler if isinstance(sampler, str) else None
        smp = st.sampler(sampler, seed, self.space) if isinstance(sampler, str) else sampler
        prn = (st.pruner(pruner, base.test_interval, base.max_iter) if isinstance(pruner, str)
               else pruner)
        os.makedirs(self.out, exist_ok=True)
        self.study = st.load(storage, study or self.stem, self.out, direction, heartbeat,
                             sampler=smp, pruner=prn)
        self.study.set_user_attr("objective", f"{self.objective}:{direction[:3]}")
        self._beating: dict[int, int] = {}        # trial number -> trial id, for heartbeats
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.told = 0

    def _check_objective(self, base) -> None:
        import torch

        from ..solvers.nets import make_test_nets

        if not len(base.test_iter) or base.test_interval <= 0:
            raise SearchError(f"--objective {self.objective}: a TEST output; the solver needs "
                              "test_iter and test_interval > 0")
        with log_prefix("[check] "):
            nets = make_test_nets(base, self.space.path, torch.device("cpu"))
        if self.objective not in nets[0].outputs:
            raise SearchError(f"--objective {self.objective}: not an output of the TEST net; its "
                              f"outputs: {', '.join(nets[0].outputs) or 'none'}")

    # -- asking -------------------------------------------------------------------------------
    def _ask(self):
        """The next trial as a Member, or None when the study has its ``trials``."""
        from optuna.trial import TrialState

        st.fail_dead(self.study, 3 * self.heartbeat)
        trials = self.study.get_trials(deepcopy=False)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if not waiting and len(st.counted(trials)) >= self.trials:
            return None
        trial = self.study.ask()
        trial.set_user_attr("worker", st.worker_id())     # at once: fail_dead goes by it
        retried = self.study._storage.get_trial(trial._trial_id).system_attrs.get("failed_trial")
        retry = retried is not None
        if not retry:     # numbers are handed out in order: those below ours were asked first
            mine = [t for t in st.counted(self.study.get_trials(deepcopy=False))
                    if t.number <= trial.number and "failed_trial" not in t.system_attrs]
            if len(mine) > self.trials:
                trial.set_user_attr("over_budget", True)
                self.study.tell(trial, state=TrialState.FAIL)
                return None
        if self.seed is not None and self.sampler_name is not None:   # (seed, number) hashed:
            import numpy as np  # nearby seeds draw alike

            per = int(np.random.SeedSequence([self.seed, trial.number]).generate_state(1)[0])
            self.study.sampler = st.sampler(self.sampler_name, per, self.space)
        values = self.space.suggest(trial)
        folder = os.path.join(self.out, "trials", str(trial.number))
        trial.set_user_attr("folder", folder)
        p = self.space.apply(values)
        if not p.HasField("random_seed") or p.random_seed < 0:
            p.random_seed = self.seed if self.seed is not None else NET_SEED
        p.snapshot, p.snapshot_after_train = 0, True
        p.snapshot_prefix = os.path.join(folder, self.stem)
        write_prototxts(p, folder)
        with self._lock:
            self._beating[trial.number] = trial._trial_id
        log.info("Trial %d%s: %s", trial.number, f" (retry of {retried})"
                 if retry else "", ", ".join(f"{k}={v}" for k, v in values.items()))
        return Member(trial, p, folder, values=dict(values))

    def _fuses_alike(self) -> bool:
        """Whether trials with alike nets are fused (see the module docstring)."""
        import torch

        from ..solvers.nets import pick_device

        if self.fuse is not None:
            return self.fuse
        if not self.exact:
            return True
        base = self.space.base
        if self.device is None and base.HasField("solver_mode") and base.solver_mode == base.GPU:
            return torch.cuda.is_available()        # (pick_device would warn here once more)
        return pick_device(base, self.device).type != "cpu"

    def _start(self, members) -> list[Group]:
        """Members as groups: those with the same nets (a searched net field drew alike) as a
        group each, to be fused; the rest as one group, together (all of them, where alike
        nets are not fused)."""
        if not self._fuses_alike():
            return self._group(members)
        alike: dict[bytes, list[Member]] = {}
        for m in members:
            alike.setdefault(b"".join(n.SerializeToString() for n in inline_nets(m.param)), []).append(m)
        parts = [c for c in alike.values() if len(c) > 1]
        rest = [c[0] for c in alike.values() if len(c) == 1]
        return [g for part in parts + ([rest] if rest else []) for g in self._group(part)]

    def _group(self, members) -> list[Group]:
        """Members as a group; those whose nets cannot be built fail alone (said why)."""
        for m in members:
            m.handler = self._log_file(m)
        try:
            g = Group(members, self.device, self.fuse, self.exact)
            log.info("Trials %s: a %s group of %d", g.numbers(), g.engine, len(members))
            for i, m in enumerate(members):
                m.trial.set_user_attr("engine", f"{g.engine} x{len(members)}")
                if self.tensorboard:
                    from ..solvers.tensorboard import attach

                    m.board = attach(g.solvers[i], os.path.join(self.tensorboard, f"trial_{m.trial.number}"),
                                     hparams=m.values, metrics=[f"test/{self.objective}"])
            return [g]
        except SearchError:
            raise
        except USER_ERRORS as e:
            if len(members) > 1:
                return [g for m in members for g in self._group([m])]
            self._tell(members[0], "FAIL", error=str(e))
            return []

    def _log_file(self, m: Member):
        os.makedirs(m.folder, exist_ok=True)
        h = logging.FileHandler(os.path.join(m.folder, "train.log"), mode="w")
        h.setFormatter(self.log_format(m.prefix))
        h.addFilter(lambda r, p=m.prefix: r.getMessage().startswith(p))
        log.addHandler(h)
        return h

    # -- telling ------------------------------------------------------------------------------
    def _tell(self, m: Member, state: str, value=None, error: str = "") -> None:
        from optuna.trial import TrialState

        t = m.trial
        t.set_user_attr("wall_s", round(time.perf_counter() - m.t0, 3))
        solver = getattr(m, "solver", None)
        t.set_user_attr("iters", solver.iter if solver is not None else 0)
        if m.last is not None:
            t.set_user_attr("last", m.last)
        if error:
            t.set_user_attr("error", error)
            log.warning("%sfailed: %s", m.prefix, error)
        self.study.tell(t, value if state == "COMPLETE" else None, state=TrialState[state])
        with self._lock:
            self._beating.pop(t.number, None)
        if m.handler is not None:
            log.removeHandler(m.handler)
            m.handler.close()
        if m.board is not None:
            m.board.close()
            m.board = None
        self.told += 1
        if self.on_told is not None:
            self.on_told(t)

    def _events(self, g: Group) -> None:
        """Report each new test of a member; prune or complete its trial."""
        for i, why in g.failed:
            g.members[i].solver = g.solvers[i]
            self._tell(g.members[i], "FAIL", error=why)
        g.failed = []
        for i in g.live():
            m, s = g.members[i], g.solvers[i]
            m.solver = s
            scores = s.test_scores[0] if s.test_scores else None
            # a new test ran at the start of the iteration just run, or after the last one
            at = s.iter if g.done(i) else s.iter - 1
            if scores and scores is not m.seen:
                m.seen = scores
                if at == 0:                            # the untrained net's: not reported
                    continue
                m.last = float(scores[self.objective])
                m.trial.report(m.last, at)
                if m.trial.should_prune() and not g.done(i):
                    with log_prefix(m.prefix):
                        log.info("Pruned after the test at iteration %d (%s = %g)", at, self.objective,
                                 m.last)
                    g.drop(i)
                    self._tell(m, "PRUNED")
                    continue
            if g.done(i):
                g.out.add(i)
                if m.last is None:
                    self._tell(m, "FAIL", error="no test ran after iteration 0 (test_interval "
                               "past max_iter?)")
                else:
                    self._tell(m, "COMPLETE", m.last)

    def _heartbeat(self) -> None:
        storage = self.study._storage
        interval = storage.get_heartbeat_interval() if hasattr(storage, "get_heartbeat_interval") else None
        if not interval:
            return
        while not self._stop.wait(interval):
            with self._lock:
                ids = list(self._beating.values())
            for tid in ids:
                storage.record_heartbeat(tid)

    def run(self):
        """Train trials until the study has its count; returns the Optuna study."""
        groups: list[Group] = []
        beat = threading.Thread(target=self._heartbeat, daemon=True, name="search-heartbeat")
        beat.start()
        asking = True
        try:
            while True:
                free = self.k - sum(len(g.live()) for g in groups)
                if asking and free > 0:
                    new = []
                    while len(new) < free:
                        m = self._ask()
                        if m is None:
                            asking = False
                            break
                        new.append(m)
                    if new:
                        groups += self._start(new)
                if not groups:
                    if not asking:
                        break
                    continue
                for g in groups:
                    g.step()
                    self._events(g)
                groups = [g for g in groups if g.live() and not g.over]
        except BaseException:       # an error or Ctrl-C: this worker's trials fail with it and
            for g in groups:         # are enqueued again, once (what a kill -9 leaves to fail_dead)
                for i in g.live():
                    m = g.members[i]
                    self._tell(m, "FAIL", error="the search stopped")
                    st.retry_once()(self.study, self.study._storage.get_trial(m.trial._trial_id))
            raise
        finally:
            self._stop.set()
        return self.study
