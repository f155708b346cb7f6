"""Data faults a user meets on disk: a truncated LMDB is a clear error naming the file (it was
a SIGBUS: LMDB maps the file, and a page past its end kills the process), and a float record
holding NaN/inf names its key and the database."""
from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest

from brewnet import Net
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum
from brewnet.layers import LayerError


def _lmdb(path, n=64, side=24, float_at=None, bad=math.nan):
    rng = np.random.default_rng(0)
    with open_writer(str(path)) as w:
        for i in range(n):
            img = rng.integers(0, 256, (3, side, side), dtype=np.uint8)
            if float_at is not None:
                img = img.astype(np.float32)
                if i == float_at:
                    img[1, 2, 3] = bad
            w.put(f"{i:08d}", chw_to_datum(img, i % 10).SerializeToString())
    return str(path)


def _data_net(source, batch=8):
    return f"""name: "d"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }} }}"""


def _in_child(fn) -> tuple[int, str]:
    """Run ``fn`` in a forked child (on the old code the read dies by signal, which must fail
    the test, not pytest): (exit status or -signal, the error message it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        os.close(r)
        code, text = 0, b""
        try:
            fn()
        except BaseException as e:                 # noqa: BLE001  (reported to the parent)
            code, text = 1, f"{type(e).__name__}: {e}".encode()
        os.write(w, text)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung")
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)), text


def test_truncated_lmdb_is_an_error_naming_the_file(tmp_path):
    db = _lmdb(tmp_path / "cut_lmdb")
    data = os.path.join(db, "data.mdb")
    os.truncate(data, os.path.getsize(data) // 2)

    def read():
        net = Net(_data_net(db))
        for _ in range(10):
            net.forward()

    code, text = _in_child(read)
    assert code == 1, f"killed by signal {-code}" if code < 0 else text
    assert text.startswith("LayerError: Layer 'data' (type Data)")
    assert "cut_lmdb/data.mdb: the LMDB is truncated" in text


def test_truncated_single_file_lmdb(tmp_path):
    from brewnet.data.db import DBError, open_db

    db = _lmdb(tmp_path / "whole")
    cut = tmp_path / "single.mdb"
    cut.write_bytes(open(os.path.join(db, "data.mdb"), "rb").read()[:40000])
    with pytest.raises(DBError, match=r"single\.mdb: the LMDB is truncated"):
        open_db(cut)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_float_record_names_key_and_database(tmp_path, bad):
    db = _lmdb(tmp_path / "floats_lmdb", n=24, float_at=13, bad=bad)
    net = Net(_data_net(db))
    net.forward()
    with pytest.raises(LayerError) as e:
        net.forward()
    msg = str(e.value)
    assert "Layer 'data' (type Data)" in msg and "floats_lmdb" in msg
    assert "record '00000013'" in msg and "non-finite" in msg and "float_data[" in msg
