"""The package's shape, from its import statements (deferred imports inside functions too):
the core knows nothing of pycaffe, the CLI or the analysis tools; layers do not import the data
package; and no two modules import each other, however indirectly."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "brewnet"
# What sits on top of the core: pycaffe's and owl's surfaces, the commands and the analysis helpers.
SHELLS = ("brewnet.pycaffe", "brewnet.owl", "brewnet.tools", "brewnet.cli", "brewnet.__main__",
          "brewnet.analysis")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The brewnet modules ``path`` imports (``from . import x`` counts as module ``pkg.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("brewnet")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("brewnet"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (ROOT.parent / sub.replace(".", "/")).is_dir() else mod)
    out.discard(name)
    return out


GRAPH = {module_name(p): imports(p) for p in ROOT.rglob("*.py")}


def _in(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_the_core_imports_no_shell():
    bad = {m: sorted(d for d in deps if _in(d, SHELLS)) for m, deps in GRAPH.items()
           if m != "brewnet" and not _in(m, SHELLS)}
    assert not {m: d for m, d in bad.items() if d}


def test_layers_do_not_import_the_data_package():
    bad = {m: sorted(d for d in deps if _in(d, ["brewnet.data"]))
           for m, deps in GRAPH.items() if _in(m, ["brewnet.layers"])}
    assert not {m: d for m, d in bad.items() if d}


def _cycle():
    """One import cycle among the modules (package __init__s excluded: importing a submodule
    runs its package first, which is not a dependency of the submodule's code), or None."""
    graph = {m: {d for d in deps if d in GRAPH and not (ROOT.parent / d.replace(".", "/")).is_dir()}
             for m, deps in GRAPH.items() if not (ROOT.parent / m.replace(".", "/")).is_dir()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    assert _cycle() is None


@pytest.mark.parametrize("name", ["logging", "io", "mode", "memory", "summary", "timing"])
def test_no_loose_module_shadows_or_duplicates(name):
    # The stdlib-shadowing logging.py and the loose pycaffe/analysis modules have one home now.
    assert not (ROOT / f"{name}.py").exists()
