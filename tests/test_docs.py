"""The documentation is true: every ``brewnet`` command line in the pages and the README names a
real command and real flags, the CLI reference renders from the parsers, and the code blocks
marked ``<!-- test -->`` run (the Getting started steps after training, on the trained LeNet
from the shared data standing in for the main job's snapshot)."""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SHARED, need

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(?P<marker><!-- test -->\n)?```(?P<lang>[a-z]*)[^\n]*\n(?P<body>.*?)^```", re.M | re.S)


def blocks(path: Path):
    """(language, body, marked) of each fenced block of a page."""
    for m in FENCE.finditer(path.read_text()):
        yield m["lang"], m["body"], bool(m["marker"])


def command_lines(body: str):
    """The ``brewnet ...`` lines of a shell block, continuations joined, comments dropped."""
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
            part = re.sub(r"^[A-Z_]+=\S+\s+", "", part)         # VAR=value brewnet ...
            if part.startswith("brewnet ") or part.startswith("python -m brewnet "):
                yield part.removeprefix("python -m ")


def parsers():
    from brewnet.cli import COMMANDS, add_arguments

    out = {}
    for name, mod in COMMANDS.items():
        p = argparse.ArgumentParser(prog=f"brewnet {name}")
        add_arguments(mod, p)
        out[name] = (p, getattr(mod, "PASS_THROUGH", False))
    return out


def test_every_command_line_in_the_docs_names_real_flags():
    known = parsers()
    seen, bad = 0, []
    for page in PAGES:
        for lang, body, _ in blocks(page):
            if lang not in ("", "bash", "sh", "console"):
                continue
            for line in command_lines(body):
                words = shlex.split(line)[1:]
                if not words or words[0].startswith("-"):       # brewnet --version / --help
                    continue
                where = f"{page.relative_to(ROOT)}: {line}"
                if words[0] not in known:
                    bad.append(f"{where}: no command '{words[0]}'")
                    continue
                parser, pass_through = known[words[0]]
                options = {o for a in parser._actions for o in a.option_strings}
                for w in words[1:]:
                    if pass_through and not w.startswith("-"):  # brewnet run SCRIPT args...
                        break
                    flag = w.split("=")[0]
                    if flag.startswith("-") and flag != "-" and not re.fullmatch(r"-\d.*", flag) \
                            and flag not in options:
                        bad.append(f"{where}: '{words[0]}' has no flag {flag}")
                seen += 1
    assert seen > 40, f"only {seen} command lines found: the block parser is broken"
    assert not bad, "\n".join(bad)


def test_cli_reference_renders_every_command():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import cli_reference
    finally:
        sys.path.pop(0)
    text = cli_reference.cli_reference()
    for name in parsers():
        assert f"## `brewnet {name}`" in text and f"usage: brewnet {name}" in text, name
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert cli_reference.MARKER in page


@pytest.fixture(scope="module")
def trained_lenet(tmp_path_factory):
    """A folder laid out as the checkout after the main job: Caffe's LeNet files, MNIST LMDBs
    (the t10k images, shared data, for both) and the trained caffemodel (shared data)."""
    mnist = need(SHARED / "caffe-models/trained/mnist_t10k/data/mnist")
    weights = need(SHARED / "caffe-models/trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel")
    work = tmp_path_factory.mktemp("getting_started")
    ex = work / "examples" / "mnist"
    ex.mkdir(parents=True)
    shutil.copy(ROOT / "examples/mnist/lenet_train_test.prototxt", ex)
    # Caffe's solver as it is, less the test pass at iteration 0 (10,000 images) that each
    # solver.step() of the pages would start with: the blocks' own calls are what is checked.
    solver = (ROOT / "examples/mnist/lenet_solver.prototxt").read_text()
    (ex / "lenet_solver.prototxt").write_text(solver + "test_initialization: false\n")
    shutil.copy(weights, ex / "lenet_iter_10000.caffemodel")
    subprocess.run([sys.executable, "-m", "brewnet", "convert-mnist", str(mnist / "t10k-images-idx3-ubyte.gz"),
                    str(mnist / "t10k-labels-idx1-ubyte.gz"), str(ex / "mnist_test_lmdb")],
                   check=True, capture_output=True)
    (ex / "mnist_train_lmdb").symlink_to(ex / "mnist_test_lmdb")
    return work


def marked_blocks():
    return [(page, lang, body) for page in PAGES for lang, body, marked in blocks(page) if marked]


def test_marked_blocks_exist():
    pages = {p.relative_to(ROOT).as_posix() for p, _, _ in marked_blocks()}
    assert "docs/getting-started.md" in pages and "docs/coming-from/pycaffe.md" in pages, pages


@pytest.mark.parametrize("page,lang,body", marked_blocks(),
                         ids=lambda v: v.relative_to(ROOT).as_posix() if isinstance(v, Path) else None)
def test_marked_block_runs(page, lang, body, trained_lenet):
    # Each block in a fresh process, in the folder a reader has: what a Solver sets process-wide
    # (threads, allocator, determinism) stays out of the other tests of this worker.
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(trained_lenet),
           "BREWNET_SHARED": str(SHARED)}
    cmd = [sys.executable, "-c", body] if lang == "python" else ["bash", "-euo", "pipefail", "-c", body]
    r = subprocess.run(cmd, cwd=trained_lenet, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{page.relative_to(ROOT)}:\n{body}\n--- stderr:\n{r.stderr[-3000:]}"


def test_every_extra_the_docs_install_exists():
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e for page in PAGES for group in re.findall(r'\.\[([a-z,]+)\]', page.read_text())
             for e in group.split(",")}
    assert named and named <= extras, f"the docs install extras pyproject lacks: {sorted(named - extras)}"


def test_changelog_and_license_match_the_package():
    import tomllib

    import brewnet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert brewnet.__version__ == project["version"]
    assert f"## [{project['version']}]" in (ROOT / "CHANGELOG.md").read_text(), "no CHANGELOG entry"
    assert project["license"] == "BSD-2-Clause" and "BSD 2-Clause" in (ROOT / "LICENSE").read_text()
