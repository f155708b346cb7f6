"""``brewnet serve --model M --weights W [--labels synset_words.txt] [--port 8000]``: a
classification service over HTTP (FastAPI on uvicorn; ``pip install brewnet[serve]``).

The net runs as ``brewnet.deploy.to_torch``'s graph; concurrent requests are batched into one
forward (``--max-batch``, ``--max-delay-ms``). Images are prepared as pycaffe's Classifier does:
``--mean``, ``--raw-scale``, ``--input-scale``, ``--channel-swap``, ``--image-dims``; prepared
inputs come as JSON, ``.npy`` or raw float32 (``serving/app.py``). SIGTERM stops accepting
connections and finishes the requests in flight before exiting (``serving/server.py``).

``GET /``: a demo page (Caffe's ``examples/web_demo``): an image in, the top-k and the server's
time out; ``--heatmap-blob conv5`` adds owl's heatmap of that blob (``POST /heatmap``, a PNG).

``--workers N``: N server processes on one port (uvicorn's supervisor), each with its own copy of
the net and its own batcher, so the HTTP work of one worker (parsing, decoding: most of a small
net's request) runs beside the others' on other cores; ``/metrics`` sums over the workers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

from .common import (
    USER_ERRORS,
    CLIError,
    add_bool,
    add_gpu_flag,
    add_image_flags,
    image_transformer,
    log_to_stderr,
    report,
    single_device,
)

COMMAND = "serve"
HELP = "serve a classifier over HTTP: POST /predict, GET /healthz, GET /metrics, a demo page at /"
log = logging.getLogger("brewnet")
FLAGS_ENV = "BREWNET_SERVE_FLAGS"      # the parent's flags, for the workers (JSON)


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the deploy net (.prototxt)")
    p.add_argument("--weights", "-weights", required=True, metavar="W", help="trained weights")
    p.add_argument("--labels", metavar="FILE", help="one class name per line (synset_words.txt)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=16, help="inputs per forward at most (16)")
    p.add_argument("--max-delay-ms", type=float, default=5.0,
                   help="how long a request waits for others to batch with (5 ms)")
    p.add_argument("--top-k", type=int, default=5, help="classes per answer (5)")
    p.add_argument("--heatmap-blob", metavar="BLOB", default=None,
                   help="an N x C x H x W blob (conv5...): the demo page at / shows owl's heatmap of it "
                        "over the image (POST /heatmap)")
    add_image_flags(p)
    p.add_argument("--max-body-mb", type=float, default=20.0, help="request body limit (20 MB)")
    p.add_argument("--max-pixels", type=float, default=40e6, help="image size limit (40e6 pixels)")
    p.add_argument("--timeout-ms", type=float, default=10000.0, help="time limit per request (10 s)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting at most (256)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes sharing the port, each with its own net (default 1)")
    p.add_argument("--threads", type=int, help="torch threads per forward (default: the CPUs less "
                   "one, which the HTTP event loop needs, shared among the workers)")
    add_bool(p, "fold", "fold Convolution -> BatchNorm -> Scale chains (faster; float rounding)")
    p.add_argument("--engine", default=None, metavar="E",
                   help="auto (timed at start on the largest batch; default, or BREWNET_ENGINE), "
                        "eager, compiled, onnxruntime or openvino")
    add_bool(p, "access_log", "log every request")
    add_gpu_flag(p)


def build(args):
    """(Model, input batch if the net fixes it) for the flags."""
    import torch

    from ..deploy import to_torch
    from ..execution import engines
    from ..net import Net
    from .serving.app import Model
    from .serving.batcher import INLINE_S

    net = Net(args.model, weights=args.weights)
    if len(net.inputs) != 1 or len(net.shapes[net.inputs[0]]) != 4:
        raise CLIError(f"{args.model}: serve takes a net with one (N, C, H, W) input; it has "
                       f"{[(n, net.shapes[n]) for n in net.inputs]}")
    name, shape = net.inputs[0], net.shapes[net.inputs[0]]
    gm = to_torch(net, fold=args.fold)
    device = single_device(args.gpu, COMMAND)
    gm = gm.to(device)
    t, dims = image_transformer(args, name, shape)
    labels = []
    if args.labels:
        with open(args.labels, encoding="utf-8") as f:
            labels = [line.strip() for line in f if line.strip()]
    if device.type == "cpu":
        cpus = len(os.sched_getaffinity(0))
        torch.set_num_threads(args.threads or max(1, (cpus - 1) // args.workers))
    fixed = None if gm.dynamic_batch else shape[0]
    module, engine = gm, "eager"
    if device.type == "cpu":
        example = torch.zeros((fixed or args.max_batch,) + tuple(shape[1:]))
        module, engine, ms = engines.for_module(gm, engines.engine_name(args.engine, "--engine"), example,
                                                torch.get_num_threads())
        if ms:
            log.info("Net '%s': engine %s (%s)", net.name, engine, engines.describe(ms))
    seconds = []
    with torch.inference_mode():    # the first forwards set oneDNN up: not in a request
        for n in [1] + [fixed or args.max_batch] * 3:
            # this thread's CPU time: a busy machine's preemptions do not count
            t0, c0 = time.perf_counter(), time.thread_time()
            module(torch.zeros((n,) + tuple(shape[1:]), device=device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(min(time.perf_counter() - t0, time.thread_time() - c0))
    fastest = min(seconds[2:])
    inline = fastest < INLINE_S
    log.info("Net '%s': a forward of %d takes %.1f ms on %d thread(s) (engine %s)", net.name,
             fixed or args.max_batch, fastest * 1e3, torch.get_num_threads(), engine)
    blob = getattr(args, "heatmap_blob", None)
    if blob is not None:
        from ..analysis.features import check_blobs

        check_blobs(net, [blob])
        if len(net.shapes[blob]) != 4:
            raise CLIError(f"--heatmap-blob {blob}: its shape is {net.shapes[blob]}; a heatmap needs an "
                           "N x C x H x W blob (a convolution or pooling output)")
    model = Model(module, name, shape[1:], t, dims, labels, args.top_k, net.name,
                  heatmap_net=net if blob is not None else None, heatmap_blob=blob)
    return model, fixed, device, inline


def make_app(args):
    """The app for the flags (its net built); ``args.max_batch`` capped at a fixed batch."""
    from ..execution import process
    from .serving.app import Limits, create_app

    model, fixed, device, inline = build(args)
    if fixed is not None and args.max_batch > fixed:
        log.info("Net '%s' fixes its batch at %d: --max-batch %d -> %d", model.name, fixed,
                 args.max_batch, fixed)
        args.max_batch = fixed
    process.configure(device, keep_memory=True)      # steady latency: buffers stay allocated
    limits = Limits(int(args.max_body_mb * (1 << 20)), int(args.max_pixels), args.timeout_ms / 1e3,
                    args.max_queue)
    return create_app(model, limits, args.max_batch, args.max_delay_ms / 1e3, fixed, inline)


def _exit_with_parent() -> None:
    """SIGTERM to this worker when its parent dies: a parent killed outright (SIGKILL) cannot
    stop its workers, which would otherwise go on serving the port, orphaned (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)       # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:           # it died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def worker_app():
    """One worker's app (``--workers N``; uvicorn calls it in the new process)."""
    _exit_with_parent()
    log_to_stderr()
    return make_app(argparse.Namespace(**json.loads(os.environ[FLAGS_ENV])))


def run(args) -> int:
    log_to_stderr()
    try:
        from .serving import app as _  # noqa: F401  (FastAPI, prometheus_client)
        from .serving.server import serve, serve_workers
    except ImportError as e:
        return report(COMMAND, CLIError(f"{e.name} is missing: pip install 'brewnet[serve]'"))
    try:
        if args.max_batch < 1:
            raise CLIError("--max-batch must be at least 1")
        if args.threads is not None and args.threads < 1:
            raise CLIError("--threads must be at least 1")
        if args.workers < 1:
            raise CLIError("--workers must be at least 1")
        app = make_app(args)        # with several workers: a check that the net loads, here
    except USER_ERRORS as e:
        return report(COMMAND, e)
    if args.workers == 1:
        serve(app, args.host, args.port, args.access_log)
        return 0
    del app
    shared = tempfile.mkdtemp(prefix="brewnet-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared      # before any worker makes a metric
    os.environ[FLAGS_ENV] = json.dumps({k: v for k, v in vars(args).items()
                                        if isinstance(v, (str, int, float, bool, type(None), list))})
    try:
        serve_workers(f"{__name__}:worker_app", args.workers, args.host, args.port, args.access_log)
    except OSError as e:                                  # the port is taken
        return report(COMMAND, e)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return 0
