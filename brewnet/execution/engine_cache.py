"""What ``engine="auto"`` measured, kept on disk: the engine chosen per (net structure, weight
shapes, input shapes, CPU, thread count, library versions), and the ONNX files the ONNX Runtime
engine runs (keyed by the weights' content too), so a second process starts without measuring or
exporting (a choice timed once is timed once more, in a later process: engines.CONFIRMS), and a
choice never depends on one noisy neighbour. ``BREWNET_CACHE_DIR`` (else
``$XDG_CACHE_HOME/brewnet``, else ``~/.cache/brewnet``); JSON, written atomically.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("brewnet")
FORMAT = 1          # the choices file's layout; another value is refused (and rewritten)
CANDIDATES = 4      # the set auto weighs, and how: a choice made otherwise is measured again
                    # (2: ONNX Runtime on one thread for short calls; 4: OpenVINO)


def cache_dir() -> Path:
    explicit = os.environ.get("BREWNET_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "brewnet"


@functools.cache
def cpu_model() -> str:
    """The CPU's model name and the kernels torch picks for it (a VM may hide the name)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def versions() -> dict:
    return dict(_versions())


@functools.cache
def _versions() -> dict:
    from .. import __version__

    out = {"brewnet": __version__, "torch": torch.__version__}
    try:
        import onnxruntime

        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    try:                              # (its metadata: importing it starts its thread pool)
        out["openvino"] = importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


def structure(net) -> str:
    """A digest of what the net computes, without its weights' values."""
    from ..proto import caffe_pb2 as pb

    p = pb.NetParameter()
    p.CopyFrom(net.param)
    for lp in p.layer:
        del lp.blobs[:]
    return hashlib.sha256(p.SerializeToString(deterministic=True)).hexdigest()[:32]


def weights_digest(net) -> str:
    """A digest of the weights' values (the ONNX file holds them)."""
    h = hashlib.sha256()
    for layer in net.layer_list:
        for t in layer.blobs:
            a = t.detach().cpu().contiguous()
            h.update(str((tuple(a.shape), a.dtype)).encode())
            h.update(a.view(torch.uint8).numpy() if a.numel() else b"")
    return h.hexdigest()[:32]


def choice_key(net, input_shapes, threads: int, precision: str) -> dict:
    """The fields a choice depends on (all of them must match for a cached choice to be used)."""
    return {"net": structure(net),
            "weights": hashlib.sha256(str([tuple(t.shape) for l in net.layer_list
                                           for t in l.blobs]).encode()).hexdigest()[:32],
            "inputs": [list(s) for s in input_shapes], "cpu": cpu_model(), "threads": threads,
            "precision": precision, "versions": versions(), "candidates": CANDIDATES}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


class ChoiceCache:
    """``engines.json`` in the cache folder: {digest of the key: {"key", "engine", "ms",
    "measures"}} ("measures": how many measurements ``ms`` averages; 1 where absent)."""

    def __init__(self, folder: Path | None = None):
        self.path = (folder or cache_dir()) / "engines.json"

    def _read(self) -> dict:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.warning("engine cache %s cannot be read (%s): measuring again", self.path, e)
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("choices"), dict):
                raise ValueError(f"not a brewnet engine cache of format {FORMAT}")
            return data["choices"]
        except ValueError as e:
            log.warning("engine cache %s is corrupt (%s): it is rebuilt", self.path, str(e)[:200])
            return {}

    def get(self, key: dict) -> dict | None:
        entry = self._read().get(_digest(key))
        # the stored key must be the one asked for (a digest collision or a hand-edited entry)
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("engine"), str):
            return None
        return entry

    def put(self, key: dict, engine: str, ms: dict, measures: int = 1) -> None:
        choices = self._read()
        choices[_digest(key)] = {"key": key, "engine": engine, "ms": ms, "measures": measures}
        write_atomic(self.path, json.dumps({"format": FORMAT, "choices": choices}, indent=1).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder (never half a file);
    an unwritable cache folder costs the cache, never the forward."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("engine cache: cannot write %s (%s)", path, e)


def onnx_path(net, input_shapes, opset: int, outputs: list[str] | None = None) -> Path:
    """The file of ``net``'s ONNX form (``outputs``: a cut net's trunk, execution/cut.py)."""
    key = {"net": structure(net), "weights": weights_digest(net), "inputs": [list(s) for s in input_shapes],
           "opset": opset, "versions": versions()}
    if outputs is not None:
        key["outputs"] = list(outputs)
    name = re.sub(r"\W", "_", net.name or "net")
    return cache_dir() / "onnx" / f"{name}-{_digest(key)}.onnx"
