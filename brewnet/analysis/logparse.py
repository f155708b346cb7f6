"""Read Caffe (and brewnet) training logs: the rows of Caffe's ``tools/extra/parse_log.py``.

A row holds ``NumIters``, ``Seconds``, ``LearningRate`` and one column per net output, taken from
``Train net output #k: name = v`` / ``Test net output #k: name = v`` lines. Caffe's rules, kept:
the clock starts at the first line containing ``Solving`` (nothing before it is parsed; outputs
count once an ``Iteration N`` line has been seen); ``Seconds`` comes from the glog timestamp, the
year from the log file's ctime; the learning rate is the last ``lr = x`` seen (NaN before the
first; the first row borrows the second row's); a row starts at the first output of a new
iteration and is complete with as many columns as the first row (an incomplete last row is
dropped). Where Caffe's script crashes or goes wrong this module does something sensible instead:
docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import csv
import datetime
import math
import os
import re
from collections import OrderedDict
from typing import Iterable

ITERATION = re.compile(r"Iteration (\d+)")
TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
GLOG_PREFIX = re.compile(r"^\s*[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,6})\b")
BASE_COLUMNS = ("NumIters", "Seconds", "LearningRate")


def glog_time(line: str, year: int) -> datetime.datetime | None:
    """The timestamp of a glog-prefixed line in ``year``, or None when the line has no prefix."""
    m = GLOG_PREFIX.match(line)
    if not m:
        return None
    month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
    micro = int(m.group(6).ljust(6, "0"))
    try:
        return datetime.datetime(year, month, day, hour, minute, second, micro)
    except ValueError:          # 29 February of a guessed non-leap year
        return None


class _Table:
    """Caffe's row assembly for one of the two tables."""

    def __init__(self, regex: re.Pattern):
        self.regex, self.rows, self.row = regex, [], None

    def feed(self, line: str, iteration: float, seconds: float, lr: float) -> None:
        m = self.regex.search(line)
        if m:
            if self.row is None or self.row["NumIters"] != iteration:
                if self.row is not None:
                    self.rows.append(self.row)
                self.row = OrderedDict(NumIters=iteration, Seconds=seconds, LearningRate=lr)
            self.row[m.group(2)] = float(m.group(3))
        if self.row is not None and self.rows and len(self.row) == len(self.rows[0]):
            self.rows.append(self.row)
            self.row = None

    def finish(self) -> list[OrderedDict]:
        if self.row is not None and not self.rows:
            self.rows.append(self.row)          # Caffe loses a lone row (and then crashes)
        self.row = None
        if len(self.rows) > 1:
            self.rows[0]["LearningRate"] = self.rows[1]["LearningRate"]
        return self.rows


def parse_lines(lines: Iterable[str], year: int | None = None) -> tuple[list, list]:
    """(train rows, test rows) from log lines; each row an OrderedDict in column order."""
    year = datetime.date.today().year if year is None else year
    lines = list(lines)
    start_index = next((i for i, l in enumerate(lines) if "Solving" in l), None)
    if start_index is not None:
        start, body = glog_time(lines[start_index], year), lines[start_index + 1:]
    else:
        start, body = None, lines
    if start is None:
        start = next((t for t in (glog_time(l, year) for l in lines) if t is not None), None)
    train, test = _Table(TRAIN_OUTPUT), _Table(TEST_OUTPUT)
    iteration, lr, seconds = -1.0, math.nan, 0.0
    for line in body:
        m = ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        if iteration == -1:
            continue
        t = glog_time(line, year)
        if t is not None and start is not None:
            if t < start - datetime.timedelta(days=180):   # the log crossed New Year
                t = t.replace(year=t.year + 1)
            seconds = (t - start).total_seconds()
        m = LEARNING_RATE.search(line)
        if m:
            lr = float(m.group(1))
        train.feed(line, iteration, seconds, lr)
        test.feed(line, iteration, seconds, lr)
    return train.finish(), test.finish()


def parse_log(path, prefix: str | None = None) -> tuple[list, list]:
    """(train rows, test rows) of the log file at ``path`` (year from the file's ctime, as Caffe);
    ``prefix``: only the lines of the solver whose messages start with it (``[s1]``)."""
    year = datetime.datetime.fromtimestamp(os.path.getctime(path)).year
    with open(path, errors="replace") as f:
        return parse_lines(f if prefix is None else with_prefix(f, prefix), year)


def with_prefix(lines: Iterable[str], prefix: str) -> list[str]:
    """The lines whose message (after glog's ``] ``, or the line itself) starts with ``prefix``:
    one solver's lines of a log several solvers wrote (``brewnet.many``)."""
    prefix = prefix.strip()
    out = []
    for line in lines:
        head, sep, msg = line.partition("] ")
        if (msg if sep and GLOG_PREFIX.match(head) else line).startswith(prefix):
            out.append(line)
    return out


def learning_rates(path) -> tuple[list[float], list[float]]:
    """(iterations, rates) from the solver's ``Iteration N, lr = x`` lines: the rate each
    iteration really used (the CSV's LearningRate column lags one display behind, as Caffe's)."""
    its, rates = [], []
    with open(path, errors="replace") as f:
        for line in f:
            it, lr = ITERATION.search(line), LEARNING_RATE.search(line)
            if it and lr:
                its.append(float(it.group(1)))
                rates.append(float(lr.group(1)))
    return its, rates


def write_csv(path, rows: list, delimiter: str = ",") -> None:
    """One table as Caffe writes it: ``csv.excel`` dialect (CRLF line ends), header from the
    first row's columns, floats as Python prints them."""
    columns = list(rows[0].keys()) if rows else list(BASE_COLUMNS)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, dialect=csv.excel, delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)


def save_csv_files(log_path, output_dir, train: list, test: list, delimiter: str = ",") -> tuple[str, str]:
    """Write ``<output_dir>/<log name>.train`` and ``.test``; returns their paths."""
    base = os.path.join(output_dir, os.path.basename(log_path))
    write_csv(base + ".train", train, delimiter)
    write_csv(base + ".test", test, delimiter)
    return base + ".train", base + ".test"


def plot_log(path, out, title: str | None = None, log_y: bool = True) -> str:
    """PNG of train outputs and test losses, the test net's other outputs (accuracy...) and the
    learning rate against iteration; returns ``out``. ``log_y``: the loss panel on a log axis
    (where every value in it is positive). Uses the Agg canvas, never pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, test = parse_log(path)
    if not train and not test:
        raise ValueError(f"{path}: no 'Train net output' or 'Test net output' lines after "
                         "an 'Iteration' line; is it a training log?")

    def series(rows, name):
        pts = [(r["NumIters"], r[name]) for r in rows if name in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def columns(rows):
        return [c for c in (rows[0] if rows else {}) if c not in BASE_COLUMNS]

    test_other = [c for c in columns(test) if "loss" not in c.lower()]
    panels = ["loss"] + (["test"] if test_other else []) + ["lr"]
    fig = Figure(figsize=(8, 3 * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    for c in columns(train):
        ax.plot(*series(train, c), label=f"train {c}")
    for c in columns(test):
        if "loss" in c.lower():
            ax.plot(*series(test, c), "o-", label=f"test {c}")
    ax.set_ylabel("loss")
    ys = [y for line in ax.lines for y in line.get_ydata()]
    if log_y and ys and min(ys) > 0:
        ax.set_yscale("log")
    if "test" in panels:
        ax = axes[panels.index("test")]
        for c in test_other:
            ax.plot(*series(test, c), "o-", label=f"test {c}")
        ax.set_ylabel("test output")
    ax = axes[-1]
    its, rates = learning_rates(path)
    if not its:
        rows = train or test
        its, rates = [r["NumIters"] for r in rows], [r["LearningRate"] for r in rows]
    ax.plot(its, rates, drawstyle="steps-post", label="lr")
    ax.set_ylabel("learning rate")
    ax.set_xlabel("iteration")
    for ax in axes:
        if ax.lines:
            ax.legend(loc="best", fontsize="small")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or os.path.basename(os.fspath(path)))
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)
    return os.fspath(out)
