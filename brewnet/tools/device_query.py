"""``brewnet device-query [--gpu IDS]``: Caffe's ``caffe device_query``, from torch's view.

Logs each device's properties as Caffe's ``Caffe::DeviceQuery`` does (as far as torch reports
them). Without ``--gpu`` every visible device is queried (Caffe queries none). With no CUDA
device it says so in one line and exits with status 1.
"""
from __future__ import annotations

import logging

from .common import USER_ERRORS, add_gpu_flag, parse_gpus, report

COMMAND = "device-query"
HELP = "show the CUDA devices' properties, or say that none is available"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    add_gpu_flag(p)


def properties(i: int) -> list[tuple[str, object]]:
    """(label, value) rows for device ``i``, in Caffe's order, skipping what torch lacks."""
    import torch

    p = torch.cuda.get_device_properties(i)
    rows = [("Device id", i), ("Major revision number", p.major), ("Minor revision number", p.minor),
            ("Name", p.name), ("Total global memory", p.total_memory)]
    optional = [("Total shared memory per block", "shared_memory_per_block"),
                ("Total registers per block", "regs_per_multiprocessor"),
                ("Warp size", "warp_size"),
                ("Maximum threads per block", "max_threads_per_block"),
                ("Maximum threads per multiprocessor", "max_threads_per_multi_processor"),
                ("L2 cache size", "L2_cache_size"),
                ("Number of multiprocessors", "multi_processor_count"),
                ("Integrated", "is_integrated"),
                ("UUID", "uuid")]
    rows += [(label, getattr(p, attr)) for label, attr in optional if hasattr(p, attr)]
    return rows


def run(args) -> int:
    import torch

    from ..analysis.glog import setup_logging

    setup_logging()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no device is visible"
        log.info("No CUDA device is available (%s; torch %s).", why, torch.__version__)
        return 1
    try:
        ids = parse_gpus(args.gpu) if args.gpu else list(range(torch.cuda.device_count()))
    except USER_ERRORS as e:
        return report(COMMAND, e)
    log.info("Querying GPUs %s", args.gpu or "all")
    for i in ids:
        for label, value in properties(i):
            log.info("%-31s%s", label + ":", value)
    return 0
