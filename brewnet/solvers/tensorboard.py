"""TensorBoard event files of a training run, through ``torch.utils.tensorboard``
(``pip install 'brewnet[tensorboard]'``).

``attach(solver, logdir, hparams=None, metrics=())`` adds a watcher (``Solver.add_watcher``) that
writes every number the solver logs as a scalar at its iteration: ``train/<output>`` at each
display, ``test/<output>`` at each test, ``solver/loss`` (the smoothed loss of the display line),
``solver/lr`` and ``solver/seconds_per_iter``. ``logdir`` is one TensorBoard run; several solvers
(``brewnet train`` with several ``--solver``, fused or not; ``brewnet search``'s trials) each get
their own folder under one ``--tensorboard DIR`` (``run_names``). ``hparams``: the run's
parameters for TensorBoard's HParams tab, with ``metrics`` the scalar tags it tabulates against
them (a search trial's objective, ``test/accuracy``).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

EXTRA = "pip install 'brewnet[tensorboard]'"
FLUSH_SECS = 10      # what a TensorBoard watching the run waits for at most


class TensorBoardMissing(ValueError):
    """The ``tensorboard`` package is not installed (a ValueError: the CLI's one-line errors)."""


def writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or TensorBoardMissing with the way forward."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TensorBoardMissing(f"--tensorboard needs the tensorboard package: {EXTRA}") from None
    return SummaryWriter


def check() -> None:
    """Raise TensorBoardMissing now, before anything trains."""
    writer_class()


class TensorBoardRun:
    """One run's event files (a ``SummaryWriter`` on ``logdir``); call it as a solver watcher."""

    def __init__(self, logdir, hparams: dict | None = None, metrics=()):
        self.logdir = os.fspath(logdir)
        self.writer = writer_class()(self.logdir, flush_secs=FLUSH_SECS)
        self._end = None
        if hparams:
            from torch.utils.tensorboard.summary import hparams as hp_summary

            values = {k: _hparam_value(v) for k, v in hparams.items()}
            exp, start, self._end = hp_summary(values, {m: 0.0 for m in metrics})
            fw = self.writer._get_file_writer()       # this run's own events file
            fw.add_summary(exp)
            fw.add_summary(start)

    def __call__(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._end is not None:
            self.writer._get_file_writer().add_summary(self._end)
            self._end = None
        self.writer.close()


def _hparam_value(v):
    """HParams take bool, int, float or str."""
    if isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def attach(solver, logdir, hparams: dict | None = None, metrics=()) -> TensorBoardRun:
    """Write ``solver``'s logged numbers as TensorBoard scalars under ``logdir``; close the
    returned run when training ends (its last events are flushed then)."""
    run = TensorBoardRun(logdir, hparams, metrics)
    solver.add_watcher(run)
    return run


def run_names(solver_files) -> list[str]:
    """A run folder per solver, named by its file's stem; stems that collide become
    ``s<k>_<stem>`` (the log's ``[s<k>]`` prefix)."""
    stems = [re.sub(r"[^\w.-]", "_", Path(os.fspath(f)).stem) or "solver" for f in solver_files]
    return [s if stems.count(s) == 1 else f"s{k}_{s}" for k, s in enumerate(stems)]
