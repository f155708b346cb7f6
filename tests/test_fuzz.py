"""Seeded fuzzing of the load paths: mutated real prototxts and a mutated caffemodel.

Every outcome must be a successful build (then a forward) or load, or one of brewnet's own
error types whose message names the file or a layer; a raw internal error (KeyError,
RuntimeError, IndexError, ...) fails the test with the mutation that caused it. A failed
weight load must leave the parameters as they were.

Seeds: ../shared/caffe-models when present, else the byte-for-byte copies in tests/data/fuzz
(SOURCES.txt there says where each comes from). The caffemodel is made here from a seeded net.
"""
from __future__ import annotations

import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from brewnet import Net, NetError
from brewnet.data.convert import ListError
from brewnet.data.db import DBError
from brewnet.data.transform import TransformError
from brewnet.layers import LayerError
from brewnet.layers.bbox import BoxError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.errors import ProtoError
from brewnet.solvers.guards import LossNotFiniteError
from brewnet.solvers.nets import SolverError
from brewnet.tools.common import CLIError
from helpers import MODELS

OWN_ERRORS = (ProtoError, LayerError, NetError, SolverError, LossNotFiniteError, DBError,
              ListError, TransformError, CLIError, BoxError)
VENDORED = Path(__file__).parent / "data" / "fuzz"
SEEDS = {   # vendored name -> path under ../shared/caffe-models
    "lenet.prototxt": "bvlc/examples/mnist/lenet.prototxt",
    "cifar10_quick.prototxt": "bvlc/examples/cifar10/cifar10_quick.prototxt",
    "lenet_v1.prototxt": "trained/everpeace_caffe_2014_v1format/examples/mnist/lenet.prototxt",
}
PROTOTXT_CASES = int(os.environ.get("BREWNET_FUZZ_CASES", 200))     # per seed file
CAFFEMODEL_CASES = int(os.environ.get("BREWNET_FUZZ_CASES", 200))
# Values that found bugs before (INT_MAX pads, zero batches, huge strides) and their kin.
# (No 100000: as a batch size it is a legal 4 GB net; test_reliability pins the huge stride.)
INTS = ["0", "-1", "1", "2", "3", "7", "65", "1000", "2147483647", "-2147483648", "4294967296"]
OTHERS = ["0.5", "-3.5", "1e30", "nan", "inf", '"x"', "true", "MAX", "BOGUS"]
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])")
QUOTED = re.compile(r'"[^"\n]*"')
MAX_FORWARD_ELEMENTS = 5_000_000    # keep each forward cheap (the seeds need ~1.3M)


def seed_file(name: str) -> Path:
    shared = MODELS / SEEDS[name]
    return shared if shared.is_file() else VENDORED / name


def names_where(msg: str, path: Path) -> bool:
    return str(path) in msg or path.name in msg or bool(re.search(r"[Ll]ayer '", msg))


def mutate_text(text: str, rng: random.Random) -> tuple[str, list[str]]:
    done = []
    for _ in range(rng.randint(1, 3)):
        lines = text.split("\n")
        op = rng.choice(["number", "number", "number", "string", "delete", "dup", "swap",
                         "truncate", "char"])
        if op == "number" and NUMBER.search(text):
            m = rng.choice(list(NUMBER.finditer(text)))
            v = rng.choice(INTS if rng.random() < 0.7 else OTHERS)
            text = text[:m.start()] + v + text[m.end():]
            done.append(f"number@{m.start()} {m.group()}->{v}")
        elif op == "string" and QUOTED.search(text):
            spots = list(QUOTED.finditer(text))
            m, other = rng.choice(spots), rng.choice(spots)
            text = text[:m.start()] + other.group() + text[m.end():]
            done.append(f"string@{m.start()} {m.group()}->{other.group()}")
        elif op in ("delete", "dup", "swap") and len(lines) > 2:
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            if op == "delete":
                del lines[i]
            elif op == "dup":
                lines.insert(i, lines[j])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
            done.append(f"{op} lines {i},{j}")
        elif op == "truncate":
            k = rng.randrange(len(text) + 1)
            text = text[:k]
            done.append(f"truncate@{k}")
        else:
            k = rng.randrange(len(text) + 1)
            c = rng.choice(['{', '}', '"', ':', '\x00', '\xff', '#', ' ', '9', '-', 'é'])
            text = text[:k] + c + text[k:]
            done.append(f"char@{k} {c!r}")
    return text, done


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    b = bytearray(data)
    done = []
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["flip", "flip", "byte", "truncate", "delete", "dup"])
        k = rng.randrange(len(b))
        if op == "flip":
            b[k] ^= 1 << rng.randrange(8)
        elif op == "byte":
            b[k] = rng.choice([0x00, 0x08, 0x0a, 0x12, 0x7f, 0x80, 0xff])
        elif op == "truncate":
            del b[k:]
        elif op == "delete":
            del b[k:k + rng.randint(1, 64)]
        else:
            n = rng.randint(1, 64)
            b[k:k] = b[k:k + n]
        done.append(f"{op}@{k}")
        if not b:
            break
    return bytes(b), done


def _forward_is_cheap(net) -> bool:
    return sum(b.tensor.numel() for b in net.blobs.values()) <= MAX_FORWARD_ELEMENTS


@pytest.mark.parametrize("seed_name", list(SEEDS))
def test_fuzz_prototxt(tmp_path, seed_name):
    seed = seed_file(seed_name)
    text = seed.read_text()
    Net(str(seed), pb.TEST)          # the seed itself builds
    rng = random.Random(f"brewnet-fuzz-{seed_name}")
    outcomes, bad = Counter(), []
    t0 = time.perf_counter()
    for i in range(PROTOTXT_CASES):
        mutated, how = mutate_text(text, rng)
        path = tmp_path / f"m{i}_{seed_name}"
        path.write_text(mutated, errors="surrogateescape")
        try:
            net = Net(str(path), pb.TEST)
            if _forward_is_cheap(net):
                with torch.no_grad():
                    net.forward_tensors()
                outcomes["built+forward"] += 1
            else:
                outcomes["built"] += 1
        except OWN_ERRORS as e:
            outcomes[type(e).__name__] += 1
            if not names_where(str(e), path):
                bad.append((how, f"{type(e).__name__} names neither file nor layer: {e}"))
        except Exception as e:  # noqa: BLE001 - the point: no raw internal error escapes
            bad.append((how, f"{type(e).__name__}: {e}"))
    print(f"{seed_name}: {PROTOTXT_CASES} mutations in {time.perf_counter() - t0:.2f}s: "
          f"{dict(outcomes)}")
    assert not bad, "\n".join(f"{h}: {m}" for h, m in bad[:10])
    assert sum(outcomes.values()) == PROTOTXT_CASES


def test_fuzz_caffemodel(tmp_path):
    torch.manual_seed(20240601)
    src = Net(str(seed_file("lenet.prototxt")), pb.TEST)   # seeded filler weights
    good = tmp_path / "lenet.caffemodel"
    src.save(str(good))
    data = good.read_bytes()
    net = Net(str(seed_file("lenet.prototxt")), pb.TEST)
    original = [b.detach().clone() for l in net.layer_list for b in l.blobs]
    rng = random.Random("brewnet-fuzz-caffemodel")
    outcomes, bad = Counter(), []
    t0 = time.perf_counter()
    for i in range(CAFFEMODEL_CASES):
        mutated, how = mutate_bytes(data, rng)
        path = tmp_path / f"m{i}.caffemodel"
        path.write_bytes(mutated)
        try:
            net.copy_from(str(path))
            outcomes["loaded"] += 1
        except OWN_ERRORS as e:
            outcomes[type(e).__name__] += 1
            if not names_where(str(e), path):
                bad.append((how, f"{type(e).__name__} names neither file nor layer: {e}"))
            now = [b for l in net.layer_list for b in l.blobs]
            if not all(torch.equal(a, b) for a, b in zip(original, now)):
                bad.append((how, "a failed load changed the parameters"))
        except Exception as e:  # noqa: BLE001
            bad.append((how, f"{type(e).__name__}: {e}"))
        with torch.no_grad():       # back to the original weights for the next case
            for a, b in zip(original, (b for l in net.layer_list for b in l.blobs)):
                b.copy_(a)
    print(f"caffemodel: {CAFFEMODEL_CASES} mutations in {time.perf_counter() - t0:.2f}s: "
          f"{dict(outcomes)}")
    assert not bad, "\n".join(f"{h}: {m}" for h, m in bad[:10])
    assert outcomes["loaded"] < CAFFEMODEL_CASES      # the mutations do reach the checks
