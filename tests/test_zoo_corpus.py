"""benchmarks/zoo/corpus.py is well formed: its files are there, each net's provenance is in
benchmarks/zoo/SOURCES.md, and it is as large and as varied as issue 38 asks (>= 100 nets from
>= 40 repositories). The forward runs are benchmarks/load_all.py's (too slow for CI)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "zoo"))
import corpus  # noqa: E402

SOURCES = (ROOT / "benchmarks" / "zoo" / "SOURCES.md").read_text()
FIELDS = {"name", "repo", "path", "category", "input_shape", "opencv", "note"}
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def rows() -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in SOURCES.splitlines() if line.startswith("| ") and not line.startswith("| ---")]


def provenance(entry) -> list[str] | None:
    """The SOURCES.md row of ``entry``: (file, repository, path in repo, commit, bytes, licence) for
    a vendored net, (name, path, repository, path in repo, commit, licence) for the others."""
    vendored = entry["path"].startswith("benchmarks/zoo/")
    key = entry["path"][len("benchmarks/zoo/"):] if vendored else entry["name"]
    for r in rows():
        if r and r[0] == key:
            return [r[0], r[1], r[2], r[3], r[4], r[5]] if vendored else [r[1], r[2], r[3], r[4], "", r[5]]
    return None


def test_entries_are_well_formed():
    names = [e["name"] for e in corpus.NETS]
    assert len(names) == len(set(names)), "duplicate names"
    for e in corpus.NETS:
        assert set(e) - {"caffe_refuses"} == FIELDS, e["name"]
        assert isinstance(e.get("caffe_refuses", ""), str), e["name"]
        assert re.fullmatch(r"[a-z0-9_]+", e["name"]), e["name"]
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", e["repo"]), e["name"]
        assert e["path"].endswith(".prototxt"), e["name"]
        assert e["path"].startswith(("benchmarks/zoo/nets/", "tests/data/", corpus.SHARED_PREFIX)), e["name"]
        assert e["category"] and e["note"], e["name"]
        assert e["opencv"] in (True, False, None), e["name"]
        shape = e["input_shape"]
        assert shape is None or (isinstance(shape, tuple) and len(shape) == 3
                                 and all(isinstance(d, int) and d > 0 for d in shape)), e["name"]


def test_files_exist_where_kept_in_the_repository():
    for e in corpus.NETS:
        if not e["path"].startswith(corpus.SHARED_PREFIX):
            assert corpus.available(e, ROOT), e["path"]
    vendored = {e["path"] for e in corpus.NETS if e["path"].startswith("benchmarks/zoo/nets/")}
    on_disk = {f"benchmarks/zoo/nets/{p.name}" for p in (ROOT / "benchmarks" / "zoo" / "nets").glob("*.prototxt")}
    assert on_disk == vendored, "files in benchmarks/zoo/nets/ without an entry, or entries without a file"


def test_each_net_has_its_provenance():
    for e in corpus.NETS:
        row = provenance(e)
        assert row, f"{e['name']}: no row in SOURCES.md"
        assert row[1].split(" ")[0] == e["repo"], f"{e['name']}: SOURCES.md says {row[1]}"
        assert row[2] and row[5], e["name"]
        assert COMMIT.match(row[3]) or e["repo"] == "yahoo/open_nsfw", f"{e['name']}: commit {row[3]}"
        if e["path"].startswith("benchmarks/zoo/nets/"):
            assert int(row[4]) == (ROOT / e["path"]).stat().st_size, f"{e['name']}: size differs from SOURCES.md"


def test_size_and_variety():
    assert len(corpus.NETS) >= 100
    with_commit = {e["repo"] for e in corpus.NETS if COMMIT.match(provenance(e)[3])}
    assert len(with_commit) >= 40, sorted(with_commit)
    assert len({e["category"] for e in corpus.NETS}) >= 10
