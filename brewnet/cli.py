"""The ``brewnet`` command line: one module per command under ``brewnet/tools``.

Each tool module defines ``COMMAND`` (its name), ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``. Flags may be spelled Caffe's way (``-solver``) or GNU's (``--solver``).
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __version__, tools


def _commands() -> dict:
    cmds = {}
    for info in pkgutil.iter_modules(tools.__path__):
        mod = importlib.import_module(f"{tools.__name__}.{info.name}")
        if hasattr(mod, "COMMAND"):
            cmds[mod.COMMAND] = mod
    return cmds


COMMANDS = _commands()


def _gnu_flags(argv: list[str]) -> list[str]:
    # Caffe's gflags accept -flag and -flag=value; argparse wants --flag for long names.
    return ["-" + a if a.startswith("-") and not a.startswith("--") and len(a) > 2 and a[1].isalpha()
            else a for a in argv]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brewnet", description="Caffe on PyTorch.")
    parser.add_argument("--version", action="version", version=f"brewnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
    args = parser.parse_args(_gnu_flags(list(sys.argv[1:] if argv is None else argv)))
    if args.command is None:
        parser.print_help()
        return 1
    return COMMANDS[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
