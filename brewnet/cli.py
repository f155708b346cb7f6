"""The ``brewnet`` command line: one module per command under ``brewnet/tools``.

Each tool module defines ``COMMAND`` (its name), ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int``. Flags may be spelled Caffe's way (``-solver``) or GNU's (``--solver``).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import pkgutil
import re
import sys

from . import __version__, tools
from .proto import schema
from .tools.common import USER_ERRORS, report


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


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped command or choice."""

    def error(self, message):
        m = re.search(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)", message)
        if m:
            choices = [c.strip(" '") for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.5)
            if close:
                message += f"; did you mean '{close[0]}'?"
        super().error(message)


def _unknown_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Flags in ``argv`` that ``parser`` does not know (exact or an abbreviation), each with
    the close one when there is one. Checked before parsing, so a typo in a required flag is
    reported as the typo, not as the flag missing."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    out = []
    for x in argv:
        if x == "--":
            break
        name = x.split("=")[0]
        if not x.startswith("--") or any(k.startswith(name) for k in known):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        out.append(f"{x} (did you mean {close[0]}?)" if close else x)
    return out


def add_arguments(mod, p) -> None:
    """A command's own flags, and ``--proto`` (every command reads its Caffe files with it)."""
    mod.add_arguments(p)
    if not any("--proto" in a.option_strings for a in p._actions):
        p.add_argument("--proto", "-proto", metavar="CAFFE.PROTO",
                       help="a Caffe fork's caffe.proto: read and write this command's Caffe "
                            "files in the fork's schema (default: $BREWNET_PROTO, else brewnet's)")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="brewnet", description="Caffe on PyTorch.")
    parser.add_argument("--version", action="version", version=f"brewnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in sorted(COMMANDS.items()):
        add_arguments(mod, sub.add_parser(name, help=mod.HELP, description=mod.HELP))
    argv = list(sys.argv[1:] if argv is None else argv)
    k = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if k is not None and getattr(COMMANDS.get(argv[k]), "PASS_THROUGH", False):
        return _run_pass_through(parser, sub, argv, k)
    argv = _gnu_flags(argv)
    if k is not None and argv[k] in sub.choices:
        unknown = _unknown_flags(argv[k + 1:], sub.choices[argv[k]])
        if unknown:
            sub.choices[argv[k]].error("unrecognized arguments: " + " ".join(unknown))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    try:
        with schema.for_command(getattr(args, "proto", None)):
            return COMMANDS[args.command].run(args) or 0
    except KeyboardInterrupt:   # Ctrl-C outside a command's own handlers: no traceback
        print(f"brewnet {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:    # a bad file or definition a command did not catch: one line
        return report(args.command, e)


def _run_pass_through(parser, sub, argv: list[str], k: int) -> int:
    """A command that runs someone else's program (``brewnet run``): brewnet's own flags come
    before the program's name; everything after it is the program's, untouched."""
    mod = COMMANDS[argv[k]]
    if any(a in ("-h", "--help") for a in argv[:k]):
        parser.parse_args(argv)
    args = mod.parse_args(sub.choices[argv[k]], argv[k + 1:])
    args.command = argv[k]
    return mod.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
