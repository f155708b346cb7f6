"""The old import paths of modules that moved, kept for one deprecation release: importing one
gives the module at its new path (the same object, so a patch of one is a patch of both) and a
``DeprecationWarning`` naming the new path."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED: dict[str, str] = {     # old path: new path
    "brewnet.surgery": "brewnet.deploy.surgery",
    "brewnet.deploy.graph": "brewnet.deploy.fx_export",
    "brewnet.passes": "brewnet.proto.filter",
    "brewnet.many.fused_graph": "brewnet.execution.recorded_fused_step",
    "brewnet.solvers.cuda_graph": "brewnet.execution.cuda_graph",
    "brewnet.solvers.graph_ops": "brewnet.execution.passes",
    "brewnet.solvers.graph_update": "brewnet.execution.recorded_update",
    "brewnet.solvers.step_graph": "brewnet.execution.recorded_step",
    "brewnet.lean": "brewnet.execution.lean",
    "brewnet.fusion": "brewnet.execution.folding",
    "brewnet.graph_record": "brewnet.execution.recording",
    "brewnet.runtime": "brewnet.execution.process",
    "brewnet.determinism": "brewnet.execution.determinism",
    "brewnet.threads": "brewnet.execution.threads",
}


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, _OldPath) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPath())
