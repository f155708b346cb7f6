"""Before/after in one run: a benchmark command on an older commit and on this checkout, in turn.

    python benchmarks/ab.py --base 7cddb29 --rounds 3 [--only REGEX] -- benchmarks/train.py --nets LeNet
    python benchmarks/ab.py --base 7cddb29 -- -m brewnet.cli time --model M --iterations 20

The base commit is checked out into a temporary git worktree; the command (a Python script or
``-m module`` with its arguments) runs alternately there and here (``PYTHONPATH`` and the working
directory point at each tree; the machines are shared and noisy, so the two sides interleave),
``--rounds`` times each. Every output line is reduced to a key (its text with the numbers taken
out, glog's prefix dropped) and its numbers; lines with the same key are matched across runs and
the table gives each number's median on both sides and new/base.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOG = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\] ")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def run(tree: Path, cmd: list[str]) -> str:
    out = subprocess.run([sys.executable, *cmd], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                         **_passthrough()}, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"{tree}: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return out.stdout + out.stderr


def _passthrough() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("HOME", "OMP_NUM_THREADS", "BREWNET_SHARED", "LANG")}


def parse(text: str, only: re.Pattern | None) -> dict[str, list[float]]:
    rows = {}
    for line in text.splitlines():
        line = GLOG.sub("", line).strip()
        if only is not None and not only.search(line):
            continue
        nums = [float(x) for x in NUMBER.findall(line)]
        if nums:
            rows.setdefault(NUMBER.sub("#", line), nums)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (the 'before')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="regex: keep only output lines matching it")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the script or -m module and its arguments")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    only = re.compile(args.only) if args.only else None
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True)
        # The shared data sits beside the checkout; the base tree finds it the same way.
        (Path(tmp) / "shared").symlink_to(ROOT.parent / "shared")
        try:
            sides = {"base": [], "new": []}
            for r in range(args.rounds):
                for name, tree in (("base", base), ("new", ROOT)) if r % 2 == 0 else (("new", ROOT), ("base", base)):
                    sides[name].append(parse(run(tree, cmd), only))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"base {args.base} vs this checkout, {args.rounds} rounds each, medians: {' '.join(cmd)}")
    for key in sides["new"][0]:
        runs = [[s.get(key) for s in sides[n]] for n in ("base", "new")]
        if any(v is None for side in runs for v in side):
            continue
        cols = []
        for k in range(len(runs[1][0])):
            b = statistics.median(v[k] for v in runs[0] if k < len(v))
            n = statistics.median(v[k] for v in runs[1])
            if b != n:
                cols.append(f"{b:g} -> {n:g} ({n / b:.2f}x)" if b else f"{b:g} -> {n:g}")
        if cols:
            print(f"{key[:60]:<60} " + "; ".join(cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
