"""Many networks over one copy of the data.

``merge_nets`` / ``merge_indep_net_spec``: nideep's merge of independent nets into one net (one
solver). ``TrainTogether``: K solvers, each with its own rule, schedule, log prefix and
snapshots, in one process, each batch read once per data definition. ``Sweep``: the variants of
one solver (the product of ``--set`` lists), fused when ``brewnet.many.fused`` accepts them,
else trained together. ``Search``: an Optuna study of solver and net fields (``Space``), K
trials at a time on one data stream (``brewnet search``). The fused engine (``FusedSolvers``)
lives in ``brewnet.many.fused``.
"""
from .merge import MergeError, merge_indep_net_spec, merge_nets


def __getattr__(name):     # the trainers load torch-heavy modules: only when asked for
    if name in ("TrainTogether", "train_together"):
        from . import together
        return getattr(together, name)
    if name in ("Sweep", "SweepError", "variants"):
        from . import sweep
        return getattr(sweep, name)
    if name in ("Search", "Space", "SearchError"):
        from . import search
        return getattr(search, name)
    raise AttributeError(f"module 'brewnet.many' has no attribute '{name}'")


__all__ = ["MergeError", "merge_indep_net_spec", "merge_nets", "TrainTogether", "train_together",
           "Sweep", "SweepError", "variants", "Search", "Space", "SearchError"]
