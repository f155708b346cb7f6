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


MAX_MODULE_DOC = 15     # lines: what the module is for and the decisions a reader must know
MAX_FILE = 600          # lines: a file a reader takes in at once (split one by concept)


def _module_doc_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return len(doc.strip("\n").splitlines()) if doc else 0


def test_module_docstrings_are_short():
    """Measurements and history belong in docs/ and benchmarks/, not in a module docstring."""
    long = {module_name(p): n for p in ROOT.rglob("*.py") if (n := _module_doc_lines(p)) > MAX_MODULE_DOC}
    assert not long, f"module docstrings over {MAX_MODULE_DOC} lines: {long}"


def test_files_are_short():
    long = {module_name(p): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE}
    assert not long, f"files over {MAX_FILE} lines: {long}"


def test_the_way_a_net_runs_has_one_package():
    """Thread policy, determinism, process settings, recording and replay, CUDA graphs, lean
    inference, folding and the fast-path guard live in brewnet/execution, not loose at the top."""
    loose = {"threads", "determinism", "runtime", "graph_record", "lean", "fusion", "fast_path"}
    assert not {n for n in loose if (ROOT / f"{n}.py").exists()}
    for old in ("step_graph", "graph_update", "graph_ops", "cuda_graph"):
        assert not (ROOT / "solvers" / f"{old}.py").exists()
    assert not (ROOT / "many" / "fused_graph.py").exists()


def test_moved_modules_import_from_their_old_paths_with_a_warning():
    import importlib
    import sys
    import warnings

    from brewnet._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod = importlib.import_module(old)
        assert mod is importlib.import_module(new), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
                   for w in caught), old


def test_the_package_map_in_the_docs_is_the_codes():
    """docs/internals.md's map (docs/figures/package_map.dot) is drawn from the imports as they
    are: ``python docs/package_map.py`` redraws it after a change."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_map", ROOT.parent / "docs" / "package_map.py")
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    committed = (ROOT.parent / "docs" / "figures" / "package_map.dot").read_text()
    assert committed == pm.dot(), "the package map is stale: run python docs/package_map.py"
