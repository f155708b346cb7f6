"""``brewnet run [--shadow-caffe] SCRIPT.py [ARGS...]`` or ``brewnet run -m MODULE [ARGS...]``:
run an unmodified pycaffe (or owl) script as ``python`` would, its ``import caffe`` resolved to
brewnet (``brewnet_alias``). A real Caffe that is importable is never shadowed unless
``--shadow-caffe``; the script's own arguments pass through untouched."""
from __future__ import annotations

import argparse
import os
import runpy
import sys

COMMAND = "run"
HELP = "run an unmodified pycaffe/owl script or module with `import caffe` resolved to brewnet"
PASS_THROUGH = True      # brewnet/cli.py leaves everything after SCRIPT (or -m MODULE) as it is


def add_arguments(p) -> None:
    p.add_argument("--shadow-caffe", action="store_true",
                   help="use brewnet even where a real Caffe (or owl) is importable")
    p.add_argument("-m", dest="module", metavar="MODULE",
                   help="run a module as `python -m MODULE` (e.g. pytest)")
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("args", nargs="*", help="the script's own arguments, passed as they are")


def parse_args(p, argv: list[str]) -> argparse.Namespace:
    """brewnet's flags are those before SCRIPT (or up to -m MODULE); the rest is the program's."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        i += 1
    if i < len(argv) and argv[i] == "-m":
        i += 2
    elif i < len(argv):
        i += 1
    ns = p.parse_args(argv[:i])
    ns.args = argv[i:]
    return ns


def real_caffe_refusal(shadow: bool) -> str | None:
    """Why the alias may not be installed here (None: it may)."""
    import brewnet_alias

    if shadow:
        return None
    for name in brewnet_alias.ALIASES:
        spec = brewnet_alias.real_module(name)
        if spec is not None:
            where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
            return (f"a real '{name}' is importable here ({where}); brewnet will not shadow it. "
                    f"Pass --shadow-caffe to use brewnet anyway, or run without it for the real one")
    return None


def run(args) -> int:
    import brewnet_alias

    from .common import CLIError, report

    if (args.module is None) == (args.script is None):
        return report(COMMAND, CLIError("give a SCRIPT to run or -m MODULE (one of them)"))
    if args.script and not os.path.isfile(args.script):
        return report(COMMAND, CLIError(f"{args.script}: no such file"))
    # The script's own folder (or the working one for -m) comes first, as python puts it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)) if args.script else os.getcwd())
    refusal = real_caffe_refusal(args.shadow_caffe)
    if refusal:
        return report(COMMAND, CLIError(refusal))
    brewnet_alias.install(shadow=args.shadow_caffe)
    sys.argv = [args.module or args.script] + list(args.args)
    try:
        if args.module:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:             # the script's own exit status, as python gives it
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0
