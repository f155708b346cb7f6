"""``brewnet time --model M --iterations N``: Caffe's ``caffe time``.

Builds the net (phase TRAIN unless ``--phase TEST``), runs one clean forward and backward, then
times ``iterations`` passes layer by layer with the Net's own per-layer steps (see
``brewnet.analysis.timing`` for how backward is split per layer) and logs Caffe's table and
summary: ``Average Forward pass: X ms.``, ``Average Backward pass: X ms.``,
``Average Forward-Backward: X ms.``, ``Total Time: X ms.``. Input blobs are timed
as they are (zeros); a net with Data layers reads its database, which must exist.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ..execution.threads import plan_beside
from .common import (
    USER_ERRORS,
    CLIError,
    add_gpu_flag,
    add_net_state_flags,
    report,
    single_device,
    stages,
)

COMMAND = "time"
HELP = "benchmark a model: average forward/backward time per layer and in total (Caffe's 'caffe time')"
TIMED_ENGINES = "eager,onnxruntime,onnxruntime-1thread,onnxruntime-nospin,openvino,opencv,compiled"   # --engines alone
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the net definition (.prototxt)")
    p.add_argument("--iterations", "-iterations", type=int, default=50, metavar="N",
                   help="number of timed passes (default 50)")
    p.add_argument("--phase", "-phase", default="TRAIN", choices=["TRAIN", "TEST"],
                   help="network phase (default TRAIN)")
    p.add_argument("--engines", nargs="?", metavar="A,B", const=TIMED_ENGINES,
                   help="time whole forwards of a deploy net on each inference engine instead "
                        f"(default: {TIMED_ENGINES}) and say which auto picks")
    p.add_argument("--weights", "-weights", metavar="W", help="with --engines: trained weights")
    add_gpu_flag(p)
    add_net_state_flags(p)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.iterations < 1:
        return report(COMMAND, f"--iterations must be at least 1, got {args.iterations}")
    if args.engines is not None:
        return run_engines(args)
    try:
        from ..analysis.timing import time_net
        from ..execution import process
        from ..net import Net
        from ..proto import caffe_pb2 as pb

        device = single_device(args.gpu, COMMAND)
        process.configure(device, keep_memory=True)   # time steady-state steps, as training runs them
        phase = pb.TRAIN if args.phase == "TRAIN" else pb.TEST
        net = Net(args.model, phase, level=args.level, stages=stages(args.stage), device=device)
        plan_beside(net.layer_list)
        log.info("Performing Forward")
        log.info("Initial loss: %g", net.forward_tensors().item())
        log.info("Performing Backward")
        net.backward_tensors(blob_diffs=False)
        log.info("*** Benchmark begins ***")
        log.info("Testing for %d iterations.", args.iterations)
        t = time_net(net, args.iterations, on_iteration=lambda j, ms: log.info(
            "Iteration: %d forward-backward time: %g ms.", j, ms))
    except USER_ERRORS as e:
        return report(COMMAND, e)
    n = t.iterations
    log.info("Average time per layer: ")
    for name, fw, bw in zip(t.names, t.forward_ms, t.backward_ms):
        log.info("%10s\tforward: %g ms.", name, fw / n)
        log.info("%10s\tbackward: %g ms.", name, bw / n)
    log.info("Average Forward pass: %g ms.", t.forward_total_ms / n)
    log.info("Average Backward pass: %g ms.", t.backward_total_ms / n)
    log.info("Average Forward-Backward: %g ms.", t.total_ms / n)
    log.info("Total Time: %g ms.", t.total_ms)
    log.info("*** Benchmark ends ***")
    return 0


def time_engines(model, names, iterations: int, weights=None, level: int = 0, stages=()) -> tuple:
    """({engine: median ms per whole forward}, whether the net is cut) of a deploy net on each
    engine in ``names`` (brewnet/execution/engines.py), on one fixed random input, the engines'
    calls interleaved after each has switched on; an engine that cannot run the net maps to the
    reason. A cut net (execution/cut.py) is timed with its eager tail, as it runs."""
    from ..errors import NetError
    from ..execution.lean import AFTER
    from ..pycaffe import Net

    nets, out = {}, {}
    for name in names:
        net = Net(model, 1, level=level, stages=stages, weights=weights, engine=name)
        if not net.inputs:
            raise NetError(f"{model}: --engines times a deploy net (one with Input layers)")
        nets[name] = net
    rng = np.random.default_rng(0)
    feed = {n: rng.standard_normal(nets[names[0]].blobs[n].data.shape).astype(np.float32)
            for n in nets[names[0]].inputs}
    for name, net in nets.items():
        for _ in range(AFTER + 2):
            net.forward(**feed)
        if name != "eager" and net._lean.engine is None:
            out[name] = net._lean.guard.off or "it could not run the net (see the log)"
    times = {name: [] for name in nets if name not in out}
    for _ in range(iterations):
        for name in times:
            t0 = time.perf_counter()
            nets[name].forward(**feed)
            times[name].append(1e3 * (time.perf_counter() - t0))
    out.update({name: float(np.median(v)) for name, v in times.items()})
    return out, any(net._lean.cut is not None for net in nets.values())


def run_engines(args) -> int:
    """``--engines``: one table line per engine, then auto's pick among its candidates."""
    from ..execution import engines

    try:
        names = [engines.engine_name(n.strip(), "--engines") for n in args.engines.split(",") if n.strip()]
        if "auto" in names or not names:
            raise CLIError(f"--engines lists engines to time: {TIMED_ENGINES.replace(',', ', ')}")
        if "eager" not in names:
            names.insert(0, "eager")
        ms, cut = time_engines(args.model, names, args.iterations, args.weights, args.level, stages(args.stage))
    except USER_ERRORS as e:
        return report(COMMAND, e)
    log.info("%-19s %12s %9s", "engine", "ms/forward", "vs eager")
    for name, v in ms.items():
        if isinstance(v, str):
            log.info("%-19s %12s %9s  (%s)", name, "-", "-", v[:200])
        else:
            log.info("%-19s %12.3f %8.2fx", name, v, v / ms["eager"])
    auto = engines.candidates("auto")          # and the ONNX Runtime variants auto tries
    auto += engines.ort_variants(auto, isinstance(ms["eager"], float)
                                 and ms["eager"] < 1e3 * engines.ONE_THREAD_UNDER_S, cut)
    timed = {n: v for n, v in ms.items() if isinstance(v, float) and n in auto}
    log.info("auto picks %s among %s (compiled is asked for by name)", min(timed, key=timed.get),
             ", ".join(timed))
    return 0
