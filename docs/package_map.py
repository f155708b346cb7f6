"""The package map of docs/internals.md: brewnet's packages as boxes, their imports as arrows.

    python docs/package_map.py          # writes docs/figures/package_map.dot and .svg (Graphviz)

Read from the import statements (deferred imports inside functions too), as tests/test_structure.py
reads them; that test fails when the committed .dot no longer matches the code.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "brewnet"
OUT = ROOT / "docs" / "figures"
CORE = "core\\n(net, blob, fillers, params,\\nweights, errors, testing)"
SURFACES = ("pycaffe", "owl", "tools", "analysis")
LABELS = {"proto": "proto\\n(schema, I/O, upgrades, FilterNet)", "layers": "layers\\n(one module per family)",
          "execution": ("execution\\n(threads, determinism, recordings,\\nCUDA graphs, lean, folding,"
                        " post-ops,\\nengines, guard)"),
          "solvers": "solvers\\n(one module per update rule)", "data": "data\\n(databases, transforms, prefetch)",
          "parallel": "parallel\\n(torch.distributed)", "many": "many\\n(merge, together, fused, search)",
          "deploy": "deploy\\n(to_torch, ONNX, surgery)", "video": "video", "pycaffe": "pycaffe",
          "convert": "convert\\n(from_torch, from_onnx)",
          "owl": "owl", "tools": "tools\\n(one module per command)", "analysis": "analysis"}


def group(module: str) -> str | None:
    """The box of ``module`` (brewnet.x.y): its subpackage, or the core for the top-level modules."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("_moved",):
        return None                        # the package root re-exports everything
    if parts[1] in ("cli", "__main__"):
        return "tools"
    return parts[1] if (PKG / parts[1]).is_dir() else "core"


def imports(path: Path) -> tuple[set[str], str]:
    """(the brewnet modules ``path`` imports, its own module name)."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("brewnet")}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            if mod.startswith("brewnet"):
                out |= {f"{mod}.{a.name}" if (ROOT / f"{mod}.{a.name}".replace(".", "/")).exists()
                        or (ROOT / (f"{mod}.{a.name}".replace(".", "/") + ".py")).exists() else mod
                        for a in node.names}
    return out, name


def edges() -> list[tuple[str, str]]:
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        deps, name = imports(path)
        a = group(name)
        for d in deps:
            b = group(d)
            if a and b and a != b:
                found.add((a, b))
    return sorted(found)


def dot() -> str:
    es = edges()
    boxes = sorted({x for e in es for x in e})
    lines = ["digraph brewnet {", '  rankdir=BT; node [shape=box, fontname="Helvetica", fontsize=11];']
    for b in boxes:
        label = CORE if b == "core" else LABELS.get(b, b)
        style = ', style=filled, fillcolor="#f3e5d8"' if b in SURFACES else ""
        lines.append(f'  "{b}" [label="{label}"{style}];')
    lines += [f'  "{a}" -> "{b}";' for a, b in es]
    return "\n".join(lines + ["}"]) + "\n"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    text = dot()
    (OUT / "package_map.dot").write_text(text)
    svg = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, check=True).stdout
    (OUT / "package_map.svg").write_text(svg)
    print(f"wrote {OUT / 'package_map.dot'} and .svg ({len(text.splitlines()) - 3} lines)", file=sys.stderr)


if __name__ == "__main__":
    main()
