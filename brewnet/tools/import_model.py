"""``brewnet import model.onnx --out PREFIX`` and ``brewnet import --torch pkg.module:factory
--input-shape 1,3,224,224 --out PREFIX``: a PyTorch or ONNX model as Caffe files
(``PREFIX.prototxt`` + ``PREFIX.caffemodel``), proven in brewnet against the source model.

``--dialect bvlc`` (default) writes only BVLC Caffe 1.0 layers and fields; ``ssd`` and ``forks``
allow those forks' layers. After writing, the files are run on the example input and each
output's worst difference is printed (``--compare layers``: every mapped layer's); beyond
``--tolerance`` (relative to the output's largest magnitude) the command fails naming the
first layer that diverges. ``--check`` lists the ops that will not convert, writing nothing.
"""
from __future__ import annotations

import importlib
import logging
import sys

from .common import USER_ERRORS, CLIError, add_bool, report

COMMAND = "import"
HELP = "convert a PyTorch or ONNX model to a Caffe prototxt + caffemodel, proven layer by layer"
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL.onnx", help="an ONNX model")
    p.add_argument("--torch", default=None, metavar="PKG.MODULE:FACTORY",
                   help="a PyTorch model: a callable that returns the nn.Module (importable from here)")
    p.add_argument("--input-shape", action="append", default=None, metavar="N,C,H,W",
                   help="the example input's shape (once per input; needed with --torch)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="the written Input's fixed batch (replaces --input-shape's first number; "
                        "sets an ONNX model's batch axis, symbolic or not)")
    p.add_argument("--out", "-out", default=None, metavar="PREFIX",
                   help="writes PREFIX.prototxt and PREFIX.caffemodel")
    p.add_argument("--dialect", default="bvlc", choices=("bvlc", "ssd", "forks"),
                   help="bvlc: BVLC Caffe 1.0 layers only (default); ssd, forks: those forks' layers too")
    p.add_argument("--compare", default="outputs", choices=("outputs", "layers", "none"),
                   help="prove the outputs (default), every mapped layer, or skip the proof")
    p.add_argument("--tolerance", type=float, default=1e-4, metavar="T",
                   help="largest difference allowed, relative to each output's scale (default 1e-4)")
    p.add_argument("--input-name", default=None, metavar="A,B",
                   help="the Input layers' names (default: data)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random example input (default 0)")
    add_bool(p, "fold_bn", "fold each BatchNorm into the convolution or inner product before it")
    add_bool(p, "check", "list the ops that will not convert (counts and source lines), write nothing")


def _factory(spec: str):
    mod, _, attr = spec.partition(":")
    if not attr:
        raise CLIError(f"--torch {spec}: expected pkg.module:factory")
    sys.path.insert(0, "")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise CLIError(f"--torch {spec}: {type(e).__name__}: {e}") from None
    import torch

    module = obj if isinstance(obj, torch.nn.Module) else obj()
    if not isinstance(module, torch.nn.Module):
        raise CLIError(f"--torch {spec}: gave a {type(module).__name__}, not a torch.nn.Module")
    return module


def _shapes(args) -> list:
    out = []
    for s in args.input_shape or []:
        try:
            out.append(tuple(int(d) for d in s.split(",")))
        except ValueError:
            raise CLIError(f"--input-shape {s}: expected integers separated by ','") from None
    return out


def _print_check(rows, dialect: str) -> int:
    if not rows:
        print(f"every op converts in the {dialect} dialect")
        return 0
    print(f"{sum(r[1] for r in rows)} op(s) the {dialect} dialect cannot write:")
    for op, count, why, could, sources in rows:
        alt = f"; --dialect {'/'.join(could)} can" if could else ""
        print(f"  {op} x{count}: {why}{alt}")
        for s in sources[:5]:
            print(f"      at {s}")
    return 1


def run(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    if (args.model is None) == (args.torch is None):
        return report(COMMAND, CLIError("give an ONNX model or --torch pkg.module:factory (one of them)"))
    if not args.check and not args.out:
        return report(COMMAND, CLIError("--out PREFIX is required (or --check)"))
    names = args.input_name.split(",") if args.input_name else None
    try:
        from .. import convert

        if args.torch:
            import torch

            shapes = [((args.batch,) + s[1:]) if args.batch and s else s for s in _shapes(args)]
            if not shapes:
                raise CLIError("--torch needs --input-shape N,C,H,W (once per input)")
            module = _factory(args.torch)
            torch.manual_seed(args.seed)
            xs = tuple(torch.randn(s) for s in shapes)
            if args.check:
                return _print_check(convert.check_torch(module, xs, args.dialect), args.dialect)
            res = convert.from_torch(module, xs, args.out, dialect=args.dialect, fold_bn=args.fold_bn,
                                     input_names=names, compare=args.compare,
                                     tolerance=args.tolerance, prove_it=args.compare != "none")
        else:
            if args.check:
                return _print_check(convert.check_onnx(args.model, args.dialect, args.batch), args.dialect)
            res = convert.from_onnx(args.model, args.out, dialect=args.dialect, fold_bn=args.fold_bn,
                                    input_names=names, compare=args.compare, tolerance=args.tolerance,
                                    prove_it=args.compare != "none", batch=args.batch)
    except USER_ERRORS as e:
        return report(COMMAND, e)
    print(f"wrote {res.prototxt} and {res.caffemodel}: {res.layers} layers ({res.dialect}), "
          f"{res.seconds:.1f} s")
    for row in res.intermediates:
        print(f"  layer {row[0]} ({row[1]}): max |diff| {row[2]:.3g}, relative {row[4]:.3g}")
    for blob, d, scale, rel in res.outputs:
        print(f"  output {blob}: max |diff| {d:.3g}, relative {rel:.3g} (scale {scale:.3g}; "
              f"tolerance {res.tolerance:g})")
    return 0
