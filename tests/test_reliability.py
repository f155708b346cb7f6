"""Issue 8: no silent corruption, no crash at exit, every bad input a clear error.

Every input here is made in tmp_path (tiny LMDBs, caffemodels, HDF5 files), so the tests run
without ../shared.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import brewnet
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum
from brewnet.net import Net
from brewnet.proto import caffe_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def write_lmdb(path, datums, keys=None):
    with open_writer(str(path)) as w:
        for i, d in enumerate(datums):
            w.put(keys[i] if keys else f"{i:08d}", d.SerializeToString())
    return path


def data_net(tmp_path, source, batch=2, extra="", prefetch=None):
    pf = f" prefetch: {prefetch}" if prefetch is not None else ""
    text = f"""name: "t"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB{pf} }} }}
{extra}"""
    p = tmp_path / "net.prototxt"
    p.write_text(text)
    return p


# ---------------------------------------------------------------- 1. silent data corruption

def test_float_datum_after_byte_datum_keeps_its_floats(tmp_path):
    first = chw_to_datum(np.full((1, 2, 2), 7, np.uint8), 0)
    second = chw_to_datum(np.full((1, 2, 2), 1000.0, np.float32), 1)
    assert second.float_data and not second.data
    db = write_lmdb(tmp_path / "db", [first, second])
    net = Net(str(data_net(tmp_path, db)), brewnet.TEST)
    out = net.forward()
    assert out["data"][0].ravel().tolist() == [7.0] * 4
    assert out["data"][1].ravel().tolist() == [1000.0] * 4    # not 232 (1000 mod 256)
