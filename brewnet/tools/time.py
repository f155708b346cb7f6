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

from ..execution.threads import plan_beside
from .common import (
    USER_ERRORS,
    add_gpu_flag,
    add_net_state_flags,
    report,
    single_device,
    stages,
)

COMMAND = "time"
HELP = "benchmark a model: average forward/backward time per layer and in total (Caffe's 'caffe time')"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the net definition (.prototxt)")
    p.add_argument("--iterations", "-iterations", type=int, default=50, metavar="N",
                   help="number of timed passes (default 50)")
    p.add_argument("--phase", "-phase", default="TRAIN", choices=["TRAIN", "TEST"],
                   help="network phase (default TRAIN)")
    add_gpu_flag(p)
    add_net_state_flags(p)


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.iterations < 1:
        return report(COMMAND, f"--iterations must be at least 1, got {args.iterations}")
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
