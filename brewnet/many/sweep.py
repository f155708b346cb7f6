"""Sweeps: the variants of one solver, trained at once (``brewnet sweep``).

``parse_sets(["base_lr=0.001,0.01", "random_seed=1,2"])`` checks each key against the
SolverParameter schema (an unknown key suggests the close one) and each value against the
field's type; ``variants(solver, sets, out)`` is their product, each variant a SolverParameter
with its own ``snapshot_prefix`` under ``out/<name>/``. ``Sweep`` trains them fused when
``brewnet.many.fused.FusedSolvers`` accepts them (one architecture), else together over shared
data (``TrainTogether``), saying why; it keeps per variant its train losses, its test outputs
at each test, the final loss and the wall time until it finished.
"""
from __future__ import annotations

import difflib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

from google.protobuf.descriptor import FieldDescriptor as FD

from ..proto import caffe_pb2 as pb
from ..solvers import SolverError, load_solver_param
from ..solvers.nets import resolve

log = logging.getLogger("brewnet")
_INTS = {FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_SINT32,
         FD.TYPE_SINT64}
_FLOATS = {FD.TYPE_FLOAT, FD.TYPE_DOUBLE}


class SweepError(SolverError):
    """A ``--set`` that cannot be applied; the message names the key and value."""


def _value(fd, key: str, text: str, where: str | None = None):
    """``text`` as a value of field ``fd``; errors start with ``where`` (default ``--set KEY``)."""
    where = where or f"--set {key}"
    t = text.strip()
    try:
        if fd.type in _FLOATS:
            return float(t)
        if fd.type in _INTS:
            return int(t)
    except ValueError:
        kind = "a number" if fd.type in _FLOATS else "an integer"
        raise SweepError(f"{where}: {key} takes {kind}, got '{t}'") from None
    if fd.type == FD.TYPE_BOOL:
        if t.lower() not in ("true", "false", "1", "0"):
            raise SweepError(f"{where}: {key} takes true or false, got '{t}'")
        return t.lower() in ("true", "1")
    if fd.type == FD.TYPE_ENUM:
        names = [v.name for v in fd.enum_type.values]
        if t not in names:
            raise SweepError(f"{where}: {key} takes one of {', '.join(names)}, got '{t}'")
        return fd.enum_type.values_by_name[t].number
    if fd.type == FD.TYPE_STRING:
        return t
    raise SweepError(f"{where}: {key} is a message; give scalar fields only")


def parse_sets(specs) -> list[tuple[str, list]]:
    """``["key=v1,v2", ...]`` -> ``[(key, [typed values])]``, checked against SolverParameter."""
    fields = pb.SolverParameter.DESCRIPTOR.fields_by_name
    out = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise SweepError(f"--set '{spec}': expected KEY=V1,V2,... (e.g. base_lr=0.001,0.01)")
        fd = fields.get(key)
        if fd is None:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise SweepError(f"--set {key}: not a SolverParameter field{hint}")
        if fd.is_repeated and fd.type != FD.TYPE_FLOAT:
            raise SweepError(f"--set {key}: a repeated field; sweep scalar fields only")
        if any(k == key for k, _ in out):
            raise SweepError(f"--set {key} is given twice; put all its values in one list")
        out.append((key, [_value(fd, key, v) for v in values.split(",")]))
    return out


def _label(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def variants(solver, sets, out_dir) -> list[tuple[str, "pb.SolverParameter"]]:
    """(name, SolverParameter) per point of the product of ``sets``; net paths made absolute,
    each variant snapshotting to ``out_dir/<name>/<solver file stem>``."""
    param, path = load_solver_param(solver)
    for f in ("net", "train_net"):
        if param.HasField(f):
            setattr(param, f, str(resolve(getattr(param, f), path, "net").resolve()))
    for k, name in enumerate(param.test_net):
        param.test_net[k] = str(resolve(name, path, "test net").resolve())
    stem = path.stem if path is not None else "solver"
    keys = [k for k, _ in sets]
    out = []
    for i, combo in enumerate(itertools.product(*[v for _, v in sets])):
        # s<i>: the log prefix ([s<i>]) of variant i, fused or together
        name = f"s{i}_" + "_".join(f"{k}-{_label(v)}" for k, v in zip(keys, combo)) if keys else "s0"
        p = pb.SolverParameter()
        p.CopyFrom(param)
        for k, v in zip(keys, combo):
            fd = p.DESCRIPTOR.fields_by_name[k]
            if fd.is_repeated:
                getattr(p, k)[:] = [v]
            else:
                setattr(p, k, v)
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        p.snapshot_prefix = os.path.join(folder, stem)
        out.append((name, p))
    return out


@dataclass
class Result:
    """What one variant did: (iter, loss) per iteration, (iter, {output: value}) per test."""
    name: str
    losses: list = field(default_factory=list)
    tests: list = field(default_factory=list)
    final_loss: float = float("nan")
    wall_s: float = float("nan")

    def best(self, output: str):
        """The best value of a test output: highest, lowest for a loss."""
        vals = [t[output] for _, t in self.tests if output in t and isinstance(t[output], float)]
        if not vals:
            return float("nan")
        return min(vals) if "loss" in output else max(vals)


def _fused(params, device):
    """A FusedSolvers over ``params`` or (None, why not)."""
    try:
        from .fused import FusedSolvers, FuseError
    except ImportError:
        return None, "the fused engine (brewnet.many.fused) is not in this install"
    try:
        return FusedSolvers(params, device=device), ""
    except FuseError as e:
        return None, str(e)


class Sweep:
    """Train ``variants`` (a list of (name, SolverParameter)); ``fuse``: True (must), False
    (never) or None (when it can). ``engine`` says which ran: "fused" or "together"."""

    def __init__(self, variant_list, device=None, fuse=None):
        from .together import TrainTogether

        self.names = [n for n, _ in variant_list]
        params = [p for _, p in variant_list]
        self.prefixes = [f"[{n.split('_')[0]}] " for n in self.names]
        self.runner, why = (None, "--no-fuse") if fuse is False else _fused(params, device)
        if self.runner is None and fuse:
            raise SweepError(f"cannot fuse the variants: {why}")
        if self.runner is not None:
            self.engine = "fused"
            log.info("Sweep: %d variants fused into one net", len(params))
        else:
            self.engine = "together"
            log.info("Sweep: %d variants trained together, not fused: %s", len(params), why)
            self.runner = TrainTogether(params, device=device, prefixes=self.prefixes)
        self.results = [Result(n) for n in self.names]
        self._checks = [self._watch(s, r) for s, r in zip(self.runner.solvers, self.results)
                        if hasattr(s, "add_callback")]

    @staticmethod
    def _watch(solver, result: Result):
        """Record losses and test outputs through the solver's callbacks; returns the check
        that picks up a test run after the last iteration."""
        seen = [None]

        def tests(s=solver):     # after a test, before the next iteration's forward
            scores = s.test_scores[0] if s.test_scores else None
            if scores and scores is not seen[0]:
                seen[0] = scores
                result.tests.append((s.iter, dict(scores)))

        solver.add_callback(on_start=tests,
                            on_gradients=lambda s=solver: result.losses.append((s.iter, float(s.loss))))
        return tests

    def run(self) -> list[Result]:
        t0 = time.perf_counter()
        done = {}
        if self.engine == "together":
            self.runner.solve(on_finished=lambda k: done.setdefault(k, time.perf_counter() - t0))
        else:
            self.runner.solve()
        wall = time.perf_counter() - t0
        for check in self._checks:
            check()
        for k, (s, r) in enumerate(zip(self.runner.solvers, self.results)):
            r.final_loss = float(getattr(s, "smoothed_loss", getattr(s, "loss", float("nan"))))
            r.wall_s = done.get(k, wall)
        return self.results


def table(results) -> str:
    """One line per variant: best and final value of each test output, final loss, wall time."""
    outputs = sorted({o for r in results for _, t in r.tests for o in t})
    head = ["variant"] + [f"{o} best/final" for o in outputs] + ["final loss", "wall s"]
    rows = []
    for r in results:
        last = r.tests[-1][1] if r.tests else {}
        cells = [r.name] + [f"{r.best(o):.4g} / {last.get(o, float('nan')):.4g}"
                            if isinstance(last.get(o, 0.0), float) else "-" for o in outputs]
        rows.append(cells + [f"{r.final_loss:.4g}", f"{r.wall_s:.3g}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def plot(results, out: str, title: str = "sweep") -> str:
    """One PNG: every variant's training loss against iteration (Agg canvas, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot(1, 1, 1)
    for r in results:
        if r.losses:
            its, losses = zip(*r.losses)
            ax.plot(its, losses, label=r.name, linewidth=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    if any(r.losses for r in results):
        ax.legend(fontsize="small")
    FigureCanvasAgg(fig).print_png(out)
    return out
