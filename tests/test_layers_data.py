"""In-memory data layers: Input shapes, DummyData shapes and Caffe's refill rule, MemoryData
batching and wrap-around."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brewnet.layers import LayerError
from helpers import make_layer


def build(type_, params, ntop=1):
    tops = " ".join(f'top: "t{i}"' for i in range(ntop))
    return make_layer(f'name: "d" type: "{type_}" {tops} {params}', [])


# -- Input -------------------------------------------------------------------------------------
def test_input_shapes_once_or_per_top():
    _, tops = build("Input", "input_param { shape { dim: 2 dim: 3 } }", ntop=2)
    assert tops == [(2, 3), (2, 3)]
    l, tops = build("Input", "input_param { shape { dim: 2 dim: 3 } shape { dim: 4 } }", ntop=2)
    assert tops == [(2, 3), (4,)]
    assert [tuple(t.shape) for t in l.forward([])] == tops
    assert all(torch.all(t == 0) for t in l.forward([]))


def test_input_shape_count_error():
    with pytest.raises(LayerError, match="once per top"):
        build("Input", "input_param { shape { dim: 1 } shape { dim: 2 } }", ntop=3)


# -- DummyData ---------------------------------------------------------------------------------
def test_dummy_data_legacy_dims():
    """Caffe's test_dummy_data_layer: num/channels/height/width once or once per top."""
    p = "dummy_data_param { num: 5 num: 8 channels: 3 height: 2 width: 4 width: 1 }"
    l, tops = build("DummyData", p, ntop=2)
    assert tops == [(5, 3, 2, 4), (8, 3, 2, 1)]
    outs = l.forward([])
    assert [tuple(t.shape) for t in outs] == tops and all(torch.all(t == 0) for t in outs)


def test_dummy_data_constant_filled_once_others_refilled():
    p = ("dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 10 dim: 10 } "
         "data_filler { type: 'constant' value: 7 } data_filler { type: 'gaussian' std: 1 } }")
    l, tops = build("DummyData", p, ntop=2)
    assert tops == [(2, 3), (10, 10)]
    a1, b1 = l.forward([])
    a2, b2 = l.forward([])
    assert torch.all(a1 == 7) and a1 is a2          # filled once at setup, never again
    assert not torch.equal(b1, b2) and b1.std() > 0.5  # gaussian: refilled every forward


def test_dummy_data_one_filler_for_all_tops():
    p = "dummy_data_param { shape { dim: 3 } data_filler { type: 'uniform' min: 1 max: 2 } }"
    l, tops = build("DummyData", p, ntop=2)
    assert tops == [(3,), (3,)]
    for t in l.forward([]):
        assert torch.all((t >= 1) & (t <= 2))


@pytest.mark.parametrize("params,ntop,match", [
    ("dummy_data_param { shape { dim: 1 } data_filler { } data_filler { } }", 3, "data fillers"),
    ("dummy_data_param { shape { dim: 1 } num: 1 channels: 1 height: 1 width: 1 }", 1, "both shape and legacy"),
    ("dummy_data_param { num: 1 channels: 1 height: 1 }", 1, "'width' once"),
    ("dummy_data_param { shape { dim: 1 } shape { dim: 2 } }", 3, "'shape' once"),
    ("dummy_data_param { }", 1, "'shape' once")])
def test_dummy_data_errors(params, ntop, match):
    with pytest.raises(LayerError, match=match):
        build("DummyData", params, ntop)


def test_source_layers_follow_to():
    l, _ = build("DummyData", "dummy_data_param { shape { dim: 2 } data_filler { type: 'constant' value: 1 } }")
    l.to(dtype=torch.float64)
    assert l.forward([])[0].dtype == torch.float64


# -- MemoryData --------------------------------------------------------------------------------
MEM = "memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 }"


def test_memory_data_batches_wrap_around():
    l, tops = build("MemoryData", MEM, ntop=2)
    assert tops == [(2, 1, 2, 3), (2,)]
    data = np.arange(4 * 6, dtype=np.float32).reshape(4, 1, 2, 3)
    labels = np.array([10, 11, 12, 13], dtype=np.float32)
    l.set_input_arrays(data, labels)
    got = [l.forward([]) for _ in range(3)]
    np.testing.assert_array_equal(got[0][0].numpy(), data[0:2])
    np.testing.assert_array_equal(got[1][1].numpy(), [12, 13])
    np.testing.assert_array_equal(got[2][0].numpy(), data[0:2])  # wrapped around
    assert tuple(got[2][1].shape) == (2,)
    # float32 C-contiguous arrays are used in place, as Caffe uses the caller's memory
    data[0, 0, 0, 0] = -1
    assert l.forward([])[0][0, 0, 0, 0] != -1 and l.forward([])[0][0, 0, 0, 0] == -1


def test_memory_data_accepts_4d_labels_and_converts_dtype():
    l, _ = build("MemoryData", MEM, ntop=2)
    l.set_input_arrays(np.zeros((2, 1, 2, 3)), np.ones((2, 1, 1, 1), dtype=np.int64))
    d, lab = l.forward([])
    assert d.dtype == torch.float32 and lab.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("n,item,lab_n,match", [(3, (1, 2, 3), 3, "multiple of batch_size 2"),
                                                (4, (1, 3, 2), 4, r"\(N, 1, 2, 3\)"),
                                                (4, (1, 2, 3), 2, "same first dimension")])
def test_memory_data_bad_arrays(n, item, lab_n, match):
    l, _ = build("MemoryData", MEM, ntop=2)
    with pytest.raises(LayerError, match=match):
        l.set_input_arrays(np.zeros((n,) + item, np.float32), np.zeros(lab_n, np.float32))


def test_memory_data_needs_arrays_and_params():
    l, _ = build("MemoryData", MEM, ntop=2)
    with pytest.raises(LayerError, match="set_input_arrays"):
        l.forward([])
    with pytest.raises(LayerError, match="must all be"):
        build("MemoryData", "memory_data_param { batch_size: 2 channels: 1 }", ntop=2)
