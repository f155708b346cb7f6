#!/usr/bin/env bash
# Build the sdist and the wheel, install the wheel (not the checkout) into a fresh virtual
# environment, and use it from outside the checkout: catches package-data, py-module and
# entry-point mistakes that an editable install hides.
#   bash scripts/wheel_smoke.sh [WORKDIR]      # default: a temporary folder, removed after
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${1:-$(mktemp -d)}
[ $# -ge 1 ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
step() { echo "wheel_smoke: $*"; }

step "python -m build -> $WORK/dist"
python -m build --sdist --wheel --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || {
  tail -30 "$WORK/build.log"; echo "wheel_smoke: python -m build failed" >&2; exit 1; }
ls "$WORK"/dist/brewnet-*.tar.gz "$WORK"/dist/brewnet-*.whl
wheel=$(ls "$WORK"/dist/brewnet-*.whl)
python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["brewnet/proto/caffe.proto", "brewnet/proto/caffe_pb2.py", "brewnet/cli.py", "brewnet_alias.py"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"wheel_smoke: the wheel lacks {missing}")
if any(n.startswith(("tests/", "docs/", "benchmarks/")) for n in names):
    sys.exit("wheel_smoke: the wheel carries tests/, docs/ or benchmarks/")
print(f"wheel_smoke: {len(names)} files in the wheel")
PY

step "fresh venv (no system site-packages) with the wheel"
python -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
# The CPU build of torch 2.13.0 is on disk here; an unpinned torch would pull a CUDA build.
"$PY" -m pip install -q --no-compile torch==2.13.0   # no .pyc for torch's thousands of files: faster
"$PY" -m pip install -q --no-compile "$wheel"

step "running it outside the checkout"
cp tests/data/caffe-models/bvlc/examples/mnist/lenet.prototxt "$WORK/lenet.prototxt"
cd "$WORK"
version=$("$WORK/venv/bin/brewnet" --version)
expected="brewnet $(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")"
[ "$version" = "$expected" ] || { echo "wheel_smoke: '$version', expected '$expected'" >&2; exit 1; }
echo "$version"
"$WORK/venv/bin/brewnet" shapes lenet.prototxt | tail -3
cat > forward.py <<'PY'
import sys
from pathlib import Path

import numpy as np

import caffe  # resolved to brewnet by `brewnet run`

assert "site-packages" in caffe.__file__ and sys.argv[1] not in caffe.__file__, caffe.__file__
net = caffe.Net("lenet.prototxt", caffe.TEST)
x = np.random.default_rng(0).random((64, 1, 28, 28), dtype=np.float32)
prob = net.forward(data=x)["prob"]
assert prob.shape == (64, 10) and np.allclose(prob.sum(1), 1, atol=1e-5), prob.shape
print(f"pycaffe forward: prob {prob.shape}, from {Path(caffe.__file__).parent}, "
      f"caffe.io is brewnet.io: {caffe.io is __import__('brewnet').io}")
PY
"$WORK/venv/bin/brewnet" run forward.py "$ROOT"
step "ok"
