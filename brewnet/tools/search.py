"""``brewnet search --solver S --space space.yaml --trials N [--group K] [--out DIR] ...``: an
Optuna study of solver and net fields (``brewnet.many.space``), K trials at a time on one data
stream, fused when their nets match (on a GPU, or in the wide form), pruned trials replaced at
once (``brewnet.many.search``).
Run it again to resume the study (its journal is ``DIR/study.journal``); run it from N machines
with ``--storage postgresql://...`` to share one study. The end: a table per trial (also
``DIR/search.txt``), the best trial's files in ``DIR/best/``, Optuna's plots as PNGs in ``DIR``.
``brewnet search --show --storage URL --study NAME`` prints the table of a study. Each run prints
the command that opens the study in optuna-dashboard (``pip install 'brewnet[dashboard]'``), which
reads the default journal file as it reads an RDB URL. ``--tensorboard DIR``: a TensorBoard run per
trial (``trial_<number>``), its parameters as hparams.
"""
from __future__ import annotations

import logging

from .common import USER_ERRORS, add_gpu_flag, progress_bar, report, single_device

COMMAND = "search"
HELP = "search solver and net fields with Optuna, K nets per data copy; table, plots, best"
log = logging.getLogger("brewnet")


SAMPLERS = ("tpe", "random", "cmaes", "grid")       # brewnet.many.study's, without its imports
PRUNERS = ("median", "hyperband", "sha", "none")


def add_arguments(p) -> None:
    p.add_argument("--solver", "-solver", metavar="S", help="the solver whose fields and nets are searched")
    p.add_argument("--space", metavar="YAML", help="the fields to search and their ranges")
    p.add_argument("--trials", type=int, default=20, metavar="N",
                   help="trials in the study, over all workers (default 20)")
    p.add_argument("--group", type=int, default=4, metavar="K", help="trials trained at once (default 4)")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna sampler (default tpe)")
    p.add_argument("--pruner", choices=PRUNERS, default="median", help="Optuna pruner (default median)")
    p.add_argument("--objective", default="accuracy:max", metavar="NAME[:max|min]",
                   help="a TEST output to optimise (default accuracy:max)")
    p.add_argument("--storage", metavar="URL", help="sqlite:///F, postgresql://..., mysql://... or a "
                   ".journal file (default DIR/study.journal)")
    p.add_argument("--study", metavar="NAME", help="the study's name (default: the solver's file stem)")
    p.add_argument("--out", "-out", metavar="DIR", help="trials, table, plots, best (default <solver stem>_search)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed the sampler (per trial) and nets without random_seed: a repeatable search")
    p.add_argument("--heartbeat", type=int, default=60, metavar="S",
                   help="RDB storages: a trial whose worker is silent 3*S seconds is failed and retried")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fuse", dest="fuse", action="store_const", const=True, default=None,
                   help="fuse each group or fail (default: fuse the trials whose nets match on a GPU or "
                        "with --fuse-form wide; on the CPU the exact form is slower than together)")
    g.add_argument("--no-fuse", dest="fuse", action="store_const", const=False,
                   help="train groups together without fusing")
    p.add_argument("--fuse-form", choices=("exact", "wide"), default="exact",
                   help="fused groups: each net's own kernels (exact, the default: a trial's numbers "
                        "are its own alone) or wide operators (faster; sums depend on the group)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write a TensorBoard run per trial under DIR (trial_<number>), its parameters "
                        "as hparams (pip install 'brewnet[tensorboard]')")
    p.add_argument("--show", action="store_true", help="print the table of --study in --storage and stop")
    add_gpu_flag(p)


def _show(args) -> int:
    from ..many import study as st

    if not args.study:
        raise ValueError("--show needs --study NAME (and --storage URL, or --out DIR for the journal)")
    s = st.load(args.storage, args.study, args.out or ".")
    print(f"Study {args.study}:\n{st.table(s)}")
    return 0


def run(args) -> int:
    import os
    from pathlib import Path

    from ..analysis.glog import setup_logging
    from ..many import study as st

    setup_logging()
    try:
        if args.show:
            return _show(args)
        if not args.solver or not args.space:
            raise ValueError("--solver and --space are required (or --show)")
        from ..analysis.glog import GlogFormatter
        from ..many.search import Search

        out = args.out or f"{Path(args.solver).stem}_search"
        dashboard = st.dashboard_command(args.storage, out)
        device = single_device(args.gpu, COMMAND)
        with progress_bar(args.trials, desc="trials") as bar:
            search = Search(args.solver, args.space, args.trials, out, group=args.group,
                            objective=args.objective, sampler=args.sampler, pruner=args.pruner,
                            storage=args.storage, study=args.study, seed=args.seed, device=device,
                            fuse=args.fuse, exact=args.fuse_form == "exact", heartbeat=args.heartbeat,
                            on_told=None if bar is None else lambda t: bar.update(1),
                            log_format=lambda prefix: GlogFormatter(strip=prefix),
                            tensorboard=args.tensorboard)
            log.info("Watch the study: %s (pip install 'brewnet[dashboard]')", dashboard)
            if bar is not None:         # a resumed study: the trials it has finished
                bar.update(min(args.trials, sum(t.state.is_finished() for t in
                                                st.counted(search.study.get_trials(deepcopy=False)))))
            study = search.run()
        text = f"Search of {args.solver} (study {study.study_name}):\n{st.table(study)}\n"
        Path(out, "search.txt").write_text(text)
        best = st.copy_best(study, out)
        pngs = st.plots(study, out)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    print(text, end="")
    print(f"Table: {os.path.join(out, 'search.txt')}; best: {best or '-'}; plots: "
          f"{', '.join(os.path.basename(p) for p in pngs) or '-'}")
    print(f"Dashboard: {dashboard}   (pip install 'brewnet[dashboard]')")
    return 0
