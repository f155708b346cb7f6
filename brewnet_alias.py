"""``import caffe`` (and Minerva's ``import owl``) resolved to brewnet, for unmodified code.

An import finder maps ``caffe`` to ``brewnet`` and ``caffe.X`` to ``brewnet.X`` (``owl`` to
``brewnet.owl``): the very same module objects, so ``caffe.io is brewnet.io`` and isinstance
works across both names. ``brewnet run`` installs it for one script; ``brewnet compat install``
writes a ``.pth`` line that installs it at every interpreter start (a Jupyter kernel too).

It lives outside the ``brewnet`` package so that installing it imports nothing heavy: brewnet
(and torch) load at the script's first ``import caffe``. A real Caffe (or owl) that is importable
is never shadowed unless ``shadow=True``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

ALIASES = {"caffe": "brewnet", "owl": "brewnet.owl"}


def real_module(name: str):
    """The spec of a real, non-alias top-level module ``name`` if one is importable, else None.
    A bare directory of that name (a namespace package, e.g. tests beside a script) is none."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            continue
        find = getattr(finder, "find_spec", None)
        spec = find(name, None) if find else None
        if spec is not None and spec.origin is not None:
            return spec
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias by returning the brewnet module itself (no second copy of any code)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec     # the import system set the alias's; brewnet keeps its own


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves the aliased names; first on ``sys.meta_path`` so that ``caffe.proto.caffe_pb2``
    is never loaded a second time from brewnet's files under another name."""

    def __init__(self, shadow: bool = False):
        self.shadow = shadow

    def find_spec(self, name, path=None, target=None):
        head, _, rest = name.partition(".")
        if head not in ALIASES:
            return None
        if not rest:
            if not self.shadow and real_module(head) is not None:
                return None                                  # a real Caffe/owl wins
        else:
            top = importlib.import_module(ALIASES[head])
            if sys.modules.get(head) is not top:
                return None                                  # `caffe` is a real Caffe
        real = ALIASES[head] + ("." + rest if rest else "")
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None
        module = importlib.import_module(real)
        return importlib.machinery.ModuleSpec(name, _AliasLoader(real),
                                              is_package=hasattr(module, "__path__"))


def install(shadow: bool = False) -> AliasFinder:
    """Put the alias finder first on ``sys.meta_path`` (once); returns it."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            finder.shadow = finder.shadow or shadow
            return finder
    finder = AliasFinder(shadow)
    sys.meta_path.insert(0, finder)
    return finder


def uninstall() -> None:
    """Remove the finder and forget the aliased modules (brewnet's own names stay loaded)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]
    for name in [n for n in sys.modules if n.partition(".")[0] in ALIASES]:
        if getattr(sys.modules[name], "__name__", "").startswith("brewnet"):
            del sys.modules[name]
