"""``brewnet serve --model M --weights W [--labels synset_words.txt] [--port 8000]``: a
classification service over HTTP (FastAPI on uvicorn; ``pip install brewnet[serve]``).

The net runs as ``brewnet.deploy.to_torch``'s graph; concurrent requests are batched into one
forward (``--max-batch``, ``--max-delay-ms``). Images are prepared as pycaffe's Classifier does:
``--mean``, ``--raw-scale``, ``--input-scale``, ``--channel-swap``, ``--image-dims``. SIGTERM
stops accepting connections and finishes the requests in flight before exiting.
"""
from __future__ import annotations

import logging

from .common import (USER_ERRORS, CLIError, add_bool, add_gpu_flag, add_image_flags, image_transformer,
                     log_to_stderr, report, single_device)

COMMAND = "serve"
HELP = "serve a classifier over HTTP: POST /predict, GET /healthz, GET /metrics"
log = logging.getLogger("brewnet")


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
    add_image_flags(p)
    p.add_argument("--max-body-mb", type=float, default=20.0, help="request body limit (20 MB)")
    p.add_argument("--max-pixels", type=float, default=40e6, help="image size limit (40e6 pixels)")
    p.add_argument("--timeout-ms", type=float, default=10000.0, help="time limit per request (10 s)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting at most (256)")
    add_bool(p, "fold", "fold Convolution -> BatchNorm -> Scale chains (faster; float rounding)")
    add_bool(p, "access_log", "log every request")
    add_gpu_flag(p)


def build(args):
    """(Model, input batch if the net fixes it) for the flags."""
    import torch

    from ..deploy import to_torch
    from ..net import Net
    from .serving.app import Model

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
    with torch.inference_mode():    # the first forward sets oneDNN up: not in a request
        gm(torch.zeros((1 if gm.dynamic_batch else shape[0],) + tuple(shape[1:]), device=device))
    model = Model(gm, name, shape[1:], t, dims, labels, args.top_k, net.name)
    return model, (None if gm.dynamic_batch else shape[0]), device


def run(args) -> int:
    log_to_stderr()
    try:
        import uvicorn

        from .serving.app import Limits, create_app
    except ImportError as e:
        return report(COMMAND, CLIError(f"{e.name} is missing: pip install 'brewnet[serve]'"))
    from .. import runtime

    try:
        if args.max_batch < 1:
            raise CLIError("--max-batch must be at least 1")
        model, fixed, device = build(args)
        if fixed is not None and args.max_batch > fixed:
            log.info("Net '%s' fixes its batch at %d: --max-batch %d -> %d", model.name, fixed,
                     args.max_batch, fixed)
            args.max_batch = fixed
    except USER_ERRORS as e:
        return report(COMMAND, e)
    runtime.configure(device, keep_memory=True)      # steady latency: buffers stay allocated
    limits = Limits(int(args.max_body_mb * (1 << 20)), int(args.max_pixels), args.timeout_ms / 1e3,
                    args.max_queue)
    app = create_app(model, limits, args.max_batch, args.max_delay_ms / 1e3, fixed)
    # log_config=None: uvicorn's lines go through brewnet's log format.
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=args.access_log,
                timeout_graceful_shutdown=30)
    return 0
