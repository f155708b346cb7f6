"""MkDocs hook: the CLI reference page is generated from brewnet's own argparse parsers.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; at build time it is
replaced by every command's ``--help`` text, built the way ``brewnet.cli.main`` builds its
parser (each ``brewnet/tools`` module's ``add_arguments``), nested sub-commands included, and the
positional arguments of a command's ``SCRIPTS`` (``brewnet owl SCRIPT ...``).
Nothing in the reference is written by hand, so it cannot drift from the code.
"""
from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-reference -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _section(parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{parser.prog}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for child in _subparsers(parser).values():
        out += _section(child, level + 1)
    return out


def cli_reference() -> str:
    """Markdown for every ``brewnet`` command: its one-line help and its full ``--help``."""
    os.environ.setdefault("COLUMNS", "100")   # argparse wraps to the terminal; fix it for the page
    from brewnet.cli import COMMANDS

    lines = ["| command | does |", "|---|---|"]
    lines += [f"| [`{name}`](#brewnet-{name}) | {mod.HELP} |" for name, mod in sorted(COMMANDS.items())]
    lines.append("")
    for name, mod in sorted(COMMANDS.items()):
        p = argparse.ArgumentParser(prog=f"brewnet {name}", description=mod.HELP)
        mod.add_arguments(p)
        lines += _section(p, 2)
        for script, positionals in getattr(mod, "SCRIPTS", {}).items():   # brewnet owl SCRIPT ...
            sp = argparse.ArgumentParser(prog=f"brewnet {name} {script}", add_help=False)
            for arg, kw in positionals:
                sp.add_argument(arg, **kw)
            lines += [f"### `{sp.prog}`", "", "```text", sp.format_usage().rstrip(), "```", ""]
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):   # noqa: ARG001 (MkDocs hook signature)
    """Replace the marker on the CLI reference page with the generated reference."""
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
