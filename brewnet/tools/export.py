"""``brewnet export --model M [--weights W] --out net.onnx|net.pt2``: the net as a file another
runtime loads (ONNX, or torch.export's ``.pt2``), from ``brewnet.deploy.to_torch``'s graph.

After writing, the file is run once on a random batch (ONNX in onnxruntime when it is installed,
``.pt2`` through ``torch.export.load``) and compared with the brewnet Net; the log gives the
largest difference, and a relative difference over 1e-5 is an error.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .common import USER_ERRORS, CLIError, add_bool, log_to_stderr, report

COMMAND = "export"
HELP = "write a net as ONNX (.onnx) or a torch.export program (.pt2), checked against the Net"
log = logging.getLogger("brewnet")
TOLERANCE = 1e-5


def add_arguments(p) -> None:
    p.add_argument("--model", "-model", required=True, metavar="M", help="the deploy net (.prototxt)")
    p.add_argument("--weights", "-weights", default=None, metavar="W",
                   help="trained weights (.caffemodel or .caffemodel.h5; default: the fillers')")
    p.add_argument("--out", "-out", required=True, metavar="FILE", help="net.onnx or net.pt2")
    p.add_argument("--batch", default="fixed", metavar="dynamic|N",
                   help="'dynamic' (any batch size), a batch size N, or 'fixed' (the prototxt's; default)")
    p.add_argument("--opset", type=int, default=18, metavar="N", help="ONNX opset (>= 17; default 18)")
    add_bool(p, "fold", "fold Convolution -> BatchNorm -> Scale chains into one convolution")


def _net(args):
    import torch

    from ..net import Net

    net = Net(args.model, weights=args.weights)
    if args.batch not in ("dynamic", "fixed"):
        try:
            n = int(args.batch)
        except ValueError:
            raise CLIError(f"--batch '{args.batch}': expected 'dynamic', 'fixed' or a batch size") from None
        if n < 1:
            raise CLIError(f"--batch {n}: the batch size must be positive")
        for name in net.inputs:
            net.blobs[name].reshape(n, *net.shapes[name][1:])
        net.reshape()
    torch.manual_seed(0)
    return net


def _check(net, gm, out: Path) -> float:
    """Largest relative difference between the file's outputs and the Net's on random inputs."""
    import numpy as np
    import torch

    xs = [torch.randn(net.shapes[n]) for n in net.inputs]
    for n, x in zip(net.inputs, xs):
        net.blobs[n].tensor.copy_(x)
    with torch.no_grad():
        net.forward_tensors()
    want = [net.blobs[n].tensor.numpy() for n in net.outputs]
    if out.suffix == ".onnx":
        try:
            import onnxruntime as ort
        except ImportError:
            log.warning("onnxruntime is not installed (pip install brewnet[onnx]): %s not checked", out)
            return float("nan")
        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        got = sess.run(None, {n: x.numpy() for n, x in zip(gm.input_names, xs)})
    else:
        got = torch.export.load(str(out)).module()(*xs)
        got = [t.detach().numpy() for t in (got if isinstance(got, tuple) else (got,))]
    worst = 0.0
    for name, a, b in zip(net.outputs, got, want):
        d = float(np.abs(a - b).max())
        scale = max(float(np.abs(b).max()), 1e-30)
        log.info("%s: output '%s' max |diff| vs the Net %.3g (relative %.3g)", out.name, name, d, d / scale)
        worst = max(worst, d / scale)
    return worst


def run(args) -> int:
    log_to_stderr()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)    # its notes on torchvision ops
    out = Path(args.out)
    if out.suffix not in (".onnx", ".pt2"):
        return report(COMMAND, CLIError(f"--out {out}: the file name must end in .onnx or .pt2"))
    if out.suffix == ".onnx" and args.opset < 17:
        return report(COMMAND, CLIError(f"--opset {args.opset}: brewnet exports ONNX opset 17 or later"))
    try:
        from ..deploy import export_onnx, export_program, to_torch

        net = _net(args)
        dynamic = args.batch == "dynamic"
        gm = to_torch(net, fold=args.fold, dynamic_batch=dynamic)
        if dynamic and not gm.dynamic_batch:
            log.warning("Net '%s' fixes its batch size: exporting batch %d", net.name, gm.input_shapes[0][0])
        if out.suffix == ".onnx":
            export_onnx(gm, out, dynamic_batch=dynamic, opset=args.opset)
        else:
            export_program(gm, out, dynamic_batch=dynamic)
        log.info("Wrote %s (%d bytes)", out, out.stat().st_size)
        worst = _check(net, gm, out)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    if worst > TOLERANCE:
        return report(COMMAND, ValueError(f"{out}: outputs differ from the Net by {worst:.3g} "
                                          f"relative (more than {TOLERANCE:g})"))
    return 0
