"""``brewnet owl SCRIPT ...``: Minerva's ``scripts/learning`` and ``multiview_test``, on ``brewnet.owl``.

    brewnet owl net_trainer SOLVER [SNAPSHOT [NUM_GPU [SYNC_FREQ]]] [--batch-rule split|full]
    brewnet owl net_tester SOLVER SOFTMAX_LAYER ACCURACY_LAYER [SNAPSHOT [GPU_IDX [MULTIVIEW]]]
    brewnet owl multiview_test SOLVER SOFTMAX_LAYER [SNAPSHOT [GPU_IDX]]         # owl's earlier script
    brewnet owl feature_extractor SOLVER LAYER FEATURE_PATH [SNAPSHOT [GPU_IDX]]
    brewnet owl heatmap_visualizer SOLVER LAYER RESULT_PATH [SNAPSHOT [GPU_IDX]]
    brewnet owl filter_visualizer SOLVER LAYER RESULT_PATH [SNAPSHOT [GPU_IDX]]

SNAPSHOT is owl's snapshot index (iteration = index x the solver's ``snapshot``), default 0; the
trailing arguments default as in owl's README (GPU_IDX 0; owl's multiview_test took ``-g``, default
1). owl's lines go to stdout, brewnet's log to stderr; NUM_GPU beyond the GPUs: CPU worker processes.
"""
from __future__ import annotations

import argparse

from .common import USER_ERRORS, report

COMMAND = "owl"
HELP = "Minerva owl's scripts: net_trainer, net_tester, multiview_test, feature_extractor, ..."
OPTIONAL = dict(type=int, nargs="?", default=0)
SCRIPTS = {
    "net_trainer": [("solver_file", {}), ("snapshot", OPTIONAL), ("num_gpu", dict(OPTIONAL, default=1)),
                    ("freq", dict(OPTIONAL, default=1))],
    "net_tester": [("solver_file", {}), ("softmax_layer_name", {}), ("accuracy_layer_name", {}),
                   ("snapshot", OPTIONAL), ("gpu_idx", OPTIONAL), ("multiview", OPTIONAL)],
    "multiview_test": [("solver_file", {}), ("softmax_layer_name", {}), ("snapshot", OPTIONAL),
                       ("gpu_idx", OPTIONAL)],
    "feature_extractor": [("solver_file", {}), ("layer_name", {}), ("feature_path", {}),
                          ("snapshot", OPTIONAL), ("gpu_idx", OPTIONAL)],
    "heatmap_visualizer": [("solver_file", {}), ("layer_name", {}), ("result_path", {}),
                           ("snapshot", OPTIONAL), ("gpu_idx", OPTIONAL)],
    "filter_visualizer": [("solver_file", {}), ("layer_name", {}), ("result_path", {}),
                          ("snapshot", OPTIONAL), ("gpu_idx", OPTIONAL)],
}


# script -> (its tool, how run() is called) from the tool classes' module and the arguments
TOOLS = {
    "net_trainer": lambda t, a: _with(t.NetTrainer(a.solver_file, a.snapshot, a.num_gpu, a.freq,
                                                   a.batch_rule or "split", a.timeout or 300.0)),
    "net_tester": lambda t, a: _with(t.NetTester(a.solver_file, a.softmax_layer_name, a.accuracy_layer_name,
                                                 a.snapshot, a.gpu_idx), bool(a.multiview)),
    "multiview_test": lambda t, a: _with(t.MultiviewTester(a.solver_file, a.softmax_layer_name, a.snapshot,
                                                           a.gpu_idx)),
    "feature_extractor": lambda t, a: _with(t.FeatureExtractor(a.solver_file, a.snapshot, a.gpu_idx),
                                            a.layer_name, a.feature_path),
    "heatmap_visualizer": lambda t, a: _with(t.HeatmapVisualizer(a.solver_file, a.snapshot, a.gpu_idx),
                                             a.layer_name, a.result_path),
    "filter_visualizer": lambda t, a: _with(t.FilterVisualizer(a.solver_file, a.snapshot, a.layer_name,
                                                               a.result_path, a.gpu_idx)),
}


def _with(tool, *args):
    return tool, lambda: tool.run(*args)


def _flags(p) -> None:
    p.add_argument("--batch-rule", choices=("split", "full"), default=None,
                   help="net_trainer on several devices: split the prototxt's batch over them "
                        "(owl's, default) or give each the whole batch (Caffe 1.0's)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="net_trainer on several devices: seconds to wait for a lost worker (300)")
    p.add_argument("-g", "--gpu_idx", dest="gpu_flag", type=int, default=None,
                   help="the GPU to use (owl's multiview_test spelling)")


def add_arguments(p) -> None:
    p.add_argument("script", choices=sorted(SCRIPTS), help="the owl script")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="its arguments")
    _flags(p)


def _script_args(args):
    sp = argparse.ArgumentParser(prog=f"brewnet owl {args.script}")
    for name, kw in SCRIPTS[args.script]:
        sp.add_argument(name, **kw)
    _flags(sp)
    a = sp.parse_args(args.rest)
    for f in ("batch_rule", "timeout", "gpu_flag"):
        if getattr(a, f) is None:
            setattr(a, f, getattr(args, f))
    if a.gpu_flag is not None and hasattr(a, "gpu_idx"):
        a.gpu_idx = a.gpu_flag
    return a


def run(args) -> int:
    from ..analysis.glog import setup_logging
    from ..owl.net import trainer as t

    setup_logging()
    a = _script_args(args)
    name = f"{COMMAND} {args.script}"
    try:
        if args.script == "net_trainer":
            print(" === Training using %d gpus, start from snapshot %d === " % (a.num_gpu, a.snapshot))
        else:
            print(" === %s of snapshot %d, using gpu #%d === " % (args.script, a.snapshot, a.gpu_idx))
        tool, call = TOOLS[args.script](t, a)
        tool.build_net()
        call()
    except USER_ERRORS as e:
        return report(name, e)
    except RuntimeError as e:         # a training worker failed; it logged why
        return report(name, e)
    return 0
