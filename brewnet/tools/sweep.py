"""``brewnet sweep --solver S --set base_lr=0.001,0.01,0.1 --set random_seed=1,2 [--out DIR]``:
train every variant (the product of the ``--set`` lists) at once: fused when the fused engine
accepts them, else together over shared data (the log says why). Each variant's snapshots and
its own log (``train.log``, its lines without the prefix) go to ``DIR/<variant>/``; the end is a
table per variant (best and final test outputs, final loss, wall time; also ``DIR/sweep.txt``)
and one plot of all training curves (``DIR/sweep.png``).
"""
from __future__ import annotations

import logging

from ..analysis.glog import GlogFormatter
from .common import USER_ERRORS, add_gpu_flag, progress_bar, report, single_device

COMMAND = "sweep"
HELP = "train the variants of a solver (products of --set lists) at once; table and plot"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--solver", "-solver", required=True, metavar="S", help="the solver to vary")
    p.add_argument("--set", "-set", dest="sets", action="append", default=[], metavar="KEY=V1,V2",
                   help="a SolverParameter field and its values; several --set give their product")
    p.add_argument("--out", "-out", default=None, metavar="DIR",
                   help="folder for the variants' snapshots, logs, table and plot "
                        "(default: <solver stem>_sweep)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fuse", dest="fuse", action="store_const", const=True, default=None,
                   help="fuse the variants or fail (default: fuse when they can be)")
    g.add_argument("--no-fuse", dest="fuse", action="store_const", const=False,
                   help="train them together without fusing")
    add_gpu_flag(p)


def _log_files(names, prefixes, out):
    import os

    handlers = []
    for name, prefix in zip(names, prefixes):
        h = logging.FileHandler(os.path.join(out, name, "train.log"), mode="w")
        h.setFormatter(GlogFormatter(strip=prefix))
        h.addFilter(lambda r, p=prefix: r.getMessage().startswith(p))
        log.addHandler(h)
        handlers.append(h)
    return handlers


def _curves_from_logs(results, out) -> None:
    """Losses and test outputs from each variant's own log where the engine ran no callbacks
    (the fused one): its Train/Test net output lines."""
    import os

    from ..analysis.logparse import parse_log

    for r in results:
        path = os.path.join(out, r.name, "train.log")
        if r.losses or not os.path.exists(path):
            continue
        train, test = parse_log(path)
        r.losses = [(row["NumIters"], row["loss"]) for row in train if "loss" in row]
        skip = ("NumIters", "Seconds", "LearningRate")
        r.tests = [(row["NumIters"], {k: v for k, v in row.items() if k not in skip})
                   for row in test] or r.tests


def run(args) -> int:
    import os
    from pathlib import Path

    from ..analysis.glog import setup_logging
    from ..many.sweep import Sweep, parse_sets, plot, table, variants

    setup_logging()
    handlers = []
    try:
        sets = parse_sets(args.sets)
        out = args.out or f"{Path(args.solver).stem}_sweep"
        vs = variants(args.solver, sets, out)
        device = single_device(args.gpu, COMMAND)
        log.info("Sweep of %s: %d variants into %s", args.solver, len(vs), out)
        prefixes = [f"[{n.split('_')[0]}] " for n, _ in vs]
        handlers = _log_files([n for n, _ in vs], prefixes, out)
        sweep = Sweep(vs, device=device, fuse=args.fuse)
        if sweep.engine == "together":
            sweep.runner.size_threads()
        with progress_bar(sum(p.max_iter for _, p in vs), desc="sweep") as bar:
            if bar is not None:
                for s in (s for s in sweep.runner.solvers if hasattr(s, "add_callback")):
                    s.add_callback(on_gradients=lambda r=sweep.runner: bar.update(
                        sum(x.iter for x in r.solvers) + 1 - bar.n))
            results = sweep.run()
        _curves_from_logs(results, out)
        text = f"Sweep of {args.solver} ({sweep.engine}):\n{table(results)}\n"
        Path(out, "sweep.txt").write_text(text)
        plot(results, os.path.join(out, "sweep.png"), title=f"{Path(args.solver).name}: training loss")
    except USER_ERRORS as e:
        return report(COMMAND, e)
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()
    print(text, end="")
    print(f"Table: {os.path.join(out, 'sweep.txt')}; plot: {os.path.join(out, 'sweep.png')}")
    return 0
