"""Flag helpers shared by the tool modules."""
from __future__ import annotations

import logging


def add_bool(p, name: str, help: str) -> None:
    """A gflags-style boolean: ``--name`` sets it, ``--noname`` clears it (Caffe's ``-name``
    reaches here as ``--name``)."""
    p.add_argument(f"--{name}", action="store_true", default=False, help=help)
    p.add_argument(f"--no{name}", dest=name, action="store_false", help="(the default)")


def log_to_stderr() -> None:
    """INFO lines on stderr unless the program configured logging already."""
    logging.basicConfig(level=logging.INFO, format="%(levelname).1s %(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
