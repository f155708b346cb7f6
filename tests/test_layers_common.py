"""Common layers: shapes from Caffe's C++ tests, numpy references, Caffe's tie and gradient
rules, float64 gradient checks and clear errors for bad params/shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from brewnet.layers import LayerError
from brewnet.layers.shape import reshape_shape
from helpers import gradcheck_layer, make_layer


def build(type_, params="", shapes=((2, 3, 4, 5),), ntop=1):
    bottoms = " ".join(f'bottom: "b{i}"' for i in range(len(shapes)))
    tops = " ".join(f'top: "t{i}"' for i in range(ntop))
    return make_layer(f'name: "L" type: "{type_}" {bottoms} {tops} {params}', shapes)


def rand(*shape, seed=1701):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def as64(layer):
    layer.blobs = [b.detach().double().requires_grad_(True) for b in layer.blobs]
    return layer


# -- InnerProduct ------------------------------------------------------------------------------
@pytest.mark.parametrize("transpose,wshape", [(False, (10, 60)), (True, (60, 10))])
def test_inner_product_shapes(transpose, wshape):
    l, tops = build("InnerProduct", f"inner_product_param {{ num_output: 10 transpose: {str(transpose).lower()} }}")
    assert tops == [(2, 10)] and tuple(l.blobs[0].shape) == wshape and tuple(l.blobs[1].shape) == (10,)


def test_inner_product_forward_and_transpose_equivalence():
    filler = "weight_filler { type: 'uniform' } bias_filler { type: 'uniform' min: 1 max: 2 }"
    l, _ = build("InnerProduct", f"inner_product_param {{ num_output: 10 {filler} }}")
    x = torch.rand(2, 3, 4, 5, dtype=torch.float64)
    w, b = l.blobs[0].detach().double().numpy(), l.blobs[1].detach().double().numpy()
    y = as64(l).forward([x])[0]
    assert torch.all(y >= 1)  # Caffe's test: positive inputs, weights and bias >= 1
    np.testing.assert_allclose(y.detach().numpy(), x.numpy().reshape(2, 60) @ w.T + b, rtol=1e-12)
    lt, _ = build("InnerProduct", "inner_product_param { num_output: 10 transpose: true }")
    lt.blobs = [torch.tensor(w.T.copy()), torch.tensor(b)]
    np.testing.assert_allclose(lt.forward([x])[0].numpy(), y.detach().numpy(), rtol=1e-12)


def test_inner_product_axis2_and_errors():
    l, tops = build("InnerProduct", "inner_product_param { num_output: 7 axis: 2 bias_term: false }")
    assert tops == [(2, 3, 7)] and len(l.blobs) == 1 and tuple(l.blobs[0].shape) == (7, 20)
    with pytest.raises(LayerError, match=r"\(2, 3, 4, 6\)"):
        l.reshape([(2, 3, 4, 6)])
    with pytest.raises(LayerError, match="num_output"):
        build("InnerProduct", "inner_product_param { axis: 1 }")


@pytest.mark.parametrize("params", ["num_output: 4 weight_filler { type: 'gaussian' } bias_filler { type: 'gaussian' }",
                                    "num_output: 4 transpose: true weight_filler { type: 'gaussian' }",
                                    "num_output: 3 axis: 2 bias_term: false weight_filler { type: 'gaussian' }"])
def test_inner_product_gradcheck(params):
    l, _ = build("InnerProduct", f"inner_product_param {{ {params} }}", [(2, 3, 2, 2)])
    assert gradcheck_layer(l, [rand(2, 3, 2, 2)])


# -- Embed -------------------------------------------------------------------------------------
def test_embed_shape_forward_bias_and_no_index_grad():
    params = ("embed_param { num_output: 10 input_dim: 5 weight_filler { type: 'gaussian' } "
              "bias_filler { type: 'gaussian' } }")
    l, tops = build("Embed", params, [(4, 1, 1, 1)])
    assert tops == [(4, 1, 1, 1, 10)] and not l.allow_backward(0)
    idx = torch.tensor([3.0, 0.0, 4.0, 3.0]).reshape(4, 1, 1, 1)
    y = l.forward([idx])[0]
    w, b = l.blobs[0].detach(), l.blobs[1].detach()
    assert torch.equal(y.detach().reshape(4, 10), w[[3, 0, 4, 3]] + b)
    assert gradcheck_layer(l, [idx], grad_bottoms=[])


def test_embed_errors():
    l, _ = build("Embed", "embed_param { num_output: 2 input_dim: 5 }", [(3,)])
    with pytest.raises(LayerError, match=r"out of range \[0, 5\)"):
        l.forward([torch.tensor([0.0, 5.0, 1.0])])
    with pytest.raises(LayerError, match="input_dim"):
        build("Embed", "embed_param { num_output: 2 }", [(3,)])


# -- Softmax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [1, 2, -1])
def test_softmax_matches_reference_and_gradcheck(axis):
    l, _ = build("Softmax", f"softmax_param {{ axis: {axis} }}", [(2, 3, 4)])
    x = rand(2, 3, 4)
    e = np.exp(x.numpy() - x.numpy().max(axis, keepdims=True))
    np.testing.assert_allclose(l.forward([x])[0].numpy(), e / e.sum(axis, keepdims=True), rtol=1e-12)
    assert gradcheck_layer(l, [x])


# -- Concat / Slice / Split --------------------------------------------------------------------
def test_concat_shapes_from_caffe_tests():
    assert build("Concat", "", [(2, 3, 6, 5), (2, 5, 6, 5)])[1] == [(2, 8, 6, 5)]
    assert build("Concat", "concat_param { axis: 0 }", [(2, 3, 6, 5), (5, 3, 6, 5)])[1] == [(7, 3, 6, 5)]
    assert build("Concat", "concat_param { concat_dim: 0 }", [(2, 3), (1, 3)])[1] == [(3, 3)]
    assert build("Concat", "concat_param { axis: -1 }", [(2, 3), (2, 1)])[1] == [(2, 4)]


def test_concat_errors():
    with pytest.raises(LayerError, match="not both"):
        build("Concat", "concat_param { axis: 1 concat_dim: 1 }", [(2, 3), (2, 3)])
    with pytest.raises(LayerError, match=r"\(2, 3\), \(3, 3\)"):
        build("Concat", "", [(2, 3), (3, 3)])


def test_concat_forward_and_gradcheck():
    l, _ = build("Concat", "", [(2, 1, 3), (2, 2, 3)])
    a, b = rand(2, 1, 3), rand(2, 2, 3, seed=2)
    np.testing.assert_array_equal(l.forward([a, b])[0].numpy(), np.concatenate([a, b], 1))
    assert gradcheck_layer(l, [a, b])


def test_slice_points_even_split_and_gradcheck():
    l, tops = build("Slice", "slice_param { slice_point: 3 }", [(6, 12, 2, 3)], ntop=2)
    assert tops == [(6, 3, 2, 3), (6, 9, 2, 3)]
    l, tops = build("Slice", "slice_param { axis: 0 }", [(6, 4)], ntop=3)
    assert tops == [(2, 4)] * 3
    l, tops = build("Slice", "slice_param { slice_dim: 1 slice_point: 1 slice_point: 4 }", [(2, 6)], ntop=3)
    x = rand(2, 6)
    outs = l.forward([x])
    assert [tuple(o.shape) for o in outs] == tops == [(2, 1), (2, 3), (2, 2)]
    np.testing.assert_array_equal(outs[1].numpy(), x.numpy()[:, 1:4])
    assert gradcheck_layer(l, [x])


@pytest.mark.parametrize("params,ntop,match", [
    ("slice_param { axis: 0 }", 4, "evenly divide"),
    ("slice_param { slice_point: 2 }", 3, "slice_point"),
    ("slice_param { slice_point: 4 slice_point: 2 }", 3, "increase strictly"),
    ("slice_param { slice_point: 6 }", 2, "increase strictly"),
    ("slice_param { axis: 1 slice_dim: 1 }", 2, "not both")])
def test_slice_errors(params, ntop, match):
    with pytest.raises(LayerError, match=match):
        build("Slice", params, [(6, 6)], ntop=ntop)


def test_split_sums_diffs():
    l, tops = build("Split", "", [(2, 3)], ntop=3)
    assert tops == [(2, 3)] * 3
    x = rand(2, 3).requires_grad_(True)
    outs = l.forward([x])
    assert len({id(o) for o in outs}) == 3 and all(torch.equal(o, x) for o in outs)
    sum(o * (i + 1) for i, o in enumerate(outs)).sum().backward()
    assert torch.all(x.grad == 6)
    assert gradcheck_layer(l, [rand(2, 3)])


# -- Eltwise -----------------------------------------------------------------------------------
def test_eltwise_sum_coeffs_prod_max():
    xs = [rand(2, 3, 4, 5, seed=s) for s in (1, 2, 3)]
    n = [x.numpy() for x in xs]
    shapes = [(2, 3, 4, 5)] * 3
    y = build("Eltwise", "eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }", shapes)[0].forward(xs)[0]
    np.testing.assert_allclose(y.numpy(), n[0] - 0.5 * n[1] + 2 * n[2], rtol=1e-12)
    y = build("Eltwise", "eltwise_param { operation: PROD }", shapes)[0].forward(xs)[0]
    np.testing.assert_allclose(y.numpy(), n[0] * n[1] * n[2], rtol=1e-12)
    y = build("Eltwise", "eltwise_param { operation: MAX }", shapes)[0].forward(xs)[0]
    np.testing.assert_array_equal(y.numpy(), np.maximum(np.maximum(n[0], n[1]), n[2]))


@pytest.mark.parametrize("op", ["SUM", "PROD", "MAX"])
def test_eltwise_gradcheck(op):
    coeff = " coeff: 1 coeff: -0.5 coeff: 2" if op == "SUM" else ""
    l, _ = build("Eltwise", f"eltwise_param {{ operation: {op}{coeff} }}", [(2, 3, 4)] * 3)
    assert gradcheck_layer(l, [rand(2, 3, 4, seed=s) for s in (1, 2, 3)])


def test_eltwise_max_tie_rule_and_gradient():
    """Caffe: of bottoms 0 and 1 a tie goes to bottom 1 (a > b else b); later bottoms win only
    when strictly greater. The whole diff goes to the winner."""
    l, _ = build("Eltwise", "eltwise_param { operation: MAX }", [(3,)] * 3)
    a = torch.tensor([1.0, 2.0, 5.0], requires_grad=True)
    b = torch.tensor([1.0, 0.0, 5.0], requires_grad=True)
    c = torch.tensor([0.0, 2.0, 5.0], requires_grad=True)
    l.forward([a, b, c])[0].sum().backward()
    assert a.grad.tolist() == [0, 1, 0] and b.grad.tolist() == [1, 0, 1] and c.grad.tolist() == [0, 0, 0]


def test_eltwise_max_ignores_coeffs():
    """Caffe's LayerSetUp rejects coeffs only for PROD; MAX accepts and ignores them."""
    xs = [rand(2, 3, seed=s) for s in (1, 2)]
    l, _ = build("Eltwise", "eltwise_param { operation: MAX coeff: 2 coeff: -3 }", [(2, 3)] * 2)
    y = l.forward(xs)[0]
    np.testing.assert_array_equal(y.numpy(), np.maximum(xs[0].numpy(), xs[1].numpy()))


def test_eltwise_prod_gradient_with_zeros():
    """Caffe's default stable_prod_grad: diff_i = product of the other bottoms (no 0/0)."""
    l, _ = build("Eltwise", "eltwise_param { operation: PROD }", [(2,)] * 3)
    xs = [torch.tensor(v, requires_grad=True) for v in ([0.0, 2.0], [3.0, 0.0], [5.0, 7.0])]
    l.forward(xs)[0].sum().backward()
    assert [x.grad.tolist() for x in xs] == [[15.0, 0.0], [0.0, 14.0], [0.0, 0.0]]


def test_eltwise_errors():
    with pytest.raises(LayerError, match="one coeff per bottom"):
        build("Eltwise", "eltwise_param { coeff: 1 }", [(2,), (2,)])
    with pytest.raises(LayerError, match="only allowed for operation SUM"):
        build("Eltwise", "eltwise_param { operation: PROD coeff: 1 coeff: 2 }", [(2,), (2,)])
    with pytest.raises(LayerError, match=r"\(2,\), \(3,\)"):
        build("Eltwise", "", [(2,), (3,)])
    with pytest.raises(LayerError, match="at least 2"):   # one bottom: SUM only (FlowNet's)
        build("Eltwise", "eltwise_param { operation: PROD }", [(2,)])


# -- Flatten / Reshape -------------------------------------------------------------------------
@pytest.mark.parametrize("params,want", [("", (2, 90)), ("flatten_param { axis: 2 }", (2, 3, 30)),
                                         ("flatten_param { end_axis: -2 }", (2, 18, 5)),
                                         ("flatten_param { axis: 0 end_axis: -2 }", (36, 5))])
def test_flatten_shapes(params, want):
    l, tops = build("Flatten", params, [(2, 3, 6, 5)])
    assert tops == [want]
    x = rand(2, 3, 6, 5)
    assert torch.equal(l.forward([x])[0].flatten(), x.flatten())


@pytest.mark.parametrize("dims,axis,num_axes,want", [
    ([0, -1, 1, 1], 0, -1, (2, 90, 1, 1)), ([0, 0, 0, 0], 0, -1, (2, 3, 6, 5)),
    ([0, 3, 10, -1], 0, -1, (2, 3, 10, 3)), ([3, 10, -1], 1, -1, (2, 3, 10, 3)),
    ([1, 1, 1], 0, 0, (1, 1, 1, 2, 3, 6, 5)), ([1, 1, 1], 2, 0, (2, 3, 1, 1, 1, 6, 5)),
    ([1, 1, 1], -1, 0, (2, 3, 6, 5, 1, 1, 1)), ([-1], 1, 2, (2, 18, 5)), ([6, 2, 3, 5], 0, -1, (6, 2, 3, 5))])
def test_reshape_rules_from_caffe_tests(dims, axis, num_axes, want):
    assert reshape_shape((2, 3, 6, 5), dims, axis, num_axes) == want


def test_reshape_layer_forward_and_gradcheck():
    l, tops = build("Reshape", "reshape_param { shape { dim: -1 } axis: 1 }", [(2, 3, 4)])
    assert tops == [(2, 12)]
    assert build("Reshape", "reshape_param { shape { dim: 0 dim: -1 } axis: 1 }", [(2, 3, 4)])[1] == [(2, 3, 4)]
    x = rand(2, 3, 4)
    assert torch.equal(l.forward([x])[0], x.reshape(2, 12))
    assert gradcheck_layer(l, [x])


@pytest.mark.parametrize("dims,axis,num_axes,match", [
    ([-1, -1], 0, -1, "more than one -1"), ([0, 0, 0, 0, 0], 0, -1, "no axis 4"),
    ([7, -1], 0, -1, "not divisible"), ([2, 3], 0, -1, "changes the count"),
    ([1], 5, 0, "axis 5 out of range"), ([1], 3, 2, "exceed")])
def test_reshape_errors(dims, axis, num_axes, match):
    with pytest.raises(ValueError, match=match):
        reshape_shape((2, 3, 6, 5), dims, axis, num_axes)


# -- Crop / Tile -------------------------------------------------------------------------------
@pytest.mark.parametrize("params,want", [("crop_param { axis: 0 }", (2, 3, 4, 2)), ("", (2, 4, 4, 2)),
                                         ("crop_param { axis: -1 }", (2, 4, 5, 2))])
def test_crop_shapes(params, want):
    assert build("Crop", params, [(2, 4, 5, 4), (2, 3, 4, 2)])[1] == [want]


def test_crop_offsets_forward_and_gradcheck():
    x = rand(2, 4, 5, 4)
    ref = torch.zeros(2, 3, 4, 2, dtype=torch.float64)
    l, _ = build("Crop", "crop_param { axis: 0 offset: 0 offset: 1 offset: 1 offset: 2 }", [x.shape, ref.shape])
    np.testing.assert_array_equal(l.forward([x, ref])[0].numpy(), x.numpy()[0:2, 1:4, 1:5, 2:4])
    l, _ = build("Crop", "crop_param { offset: 1 offset: 2 }", [x.shape, ref.shape])
    np.testing.assert_array_equal(l.forward([x, ref])[0].numpy(), x.numpy()[:, :, 1:5, 2:4])
    l, _ = build("Crop", "crop_param { axis: 1 offset: 1 }", [x.shape, ref.shape])
    np.testing.assert_array_equal(l.forward([x, ref])[0].numpy(), x.numpy()[:, 1:4, 1:5, 1:3])
    assert not l.allow_backward(1)
    assert gradcheck_layer(l, [x, ref])


def test_crop_errors():
    with pytest.raises(LayerError, match="offset 2"):
        build("Crop", "crop_param { offset: 2 }", [(2, 4, 5, 4), (2, 3, 4, 2)])
    with pytest.raises(LayerError, match="3 offsets for 2"):
        build("Crop", "crop_param { offset: 0 offset: 0 offset: 0 }", [(2, 4, 5, 4), (2, 3, 4, 2)])
    with pytest.raises(LayerError, match="same number of axes"):
        build("Crop", "", [(2, 4, 5, 4), (2, 3, 4)])


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_tile_reference_and_gradcheck(axis):
    x = rand(2, 3, 4)
    l, tops = build("Tile", f"tile_param {{ axis: {axis} tiles: 3 }}", [x.shape])
    a = axis % 3
    reps = [1, 1, 1]
    reps[a] = 3
    # numpy reference: repeat the block of axes >= axis, i.e. tile the reshaped (outer, inner)
    want = np.tile(x.numpy().reshape(int(np.prod(x.shape[:a])), -1), (1, 3)).reshape(
        [d * r for d, r in zip(x.shape, reps)])
    assert tops == [want.shape]
    np.testing.assert_array_equal(l.forward([x])[0].numpy(), want)
    assert gradcheck_layer(l, [x])


def test_tile_bad_tiles():
    with pytest.raises(LayerError, match="tiles must be positive"):
        build("Tile", "tile_param { tiles: 0 }")


# -- Reduction ---------------------------------------------------------------------------------
NP_REDUCE = {"SUM": lambda r: r.sum(1), "ASUM": lambda r: np.abs(r).sum(1),
             "SUMSQ": lambda r: (r * r).sum(1), "MEAN": lambda r: r.mean(1)}


@pytest.mark.parametrize("op", list(NP_REDUCE))
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_reduction_reference_and_gradcheck(op, axis):
    x = rand(2, 3, 4, 5)
    l, tops = build("Reduction", f"reduction_param {{ operation: {op} axis: {axis} coeff: 2.3 }}")
    assert tops == [(2, 3, 4, 5)[:axis]]
    rows = x.numpy().reshape(int(np.prod((2, 3, 4, 5)[:axis])), -1)
    want = 2.3 * NP_REDUCE[op](rows)
    np.testing.assert_allclose(l.forward([x])[0].numpy().reshape(-1), want, rtol=1e-6)
    assert gradcheck_layer(l, [x.abs() + 0.1 if op == "ASUM" else x])


# -- Filter / BatchReindex / Silence / Parameter -----------------------------------------------
def test_filter_selects_rows_and_grads():
    data, sel = rand(4, 3, 2), torch.tensor([0.0, 1.0, 0.0, 2.0])
    l, tops = build("Filter", "", [data.shape, sel.shape])
    assert tops == [(4, 3, 2)]  # Caffe's first Reshape: all N rows
    assert not l.allow_backward(1) and l.allow_backward(0)
    y = l.forward([data, sel])[0]
    np.testing.assert_array_equal(y.numpy(), data.numpy()[[1, 3]])
    d = data.clone().requires_grad_(True)
    l.forward([d, sel])[0].sum().backward()
    assert d.grad[:, 0, 0].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert gradcheck_layer(l, [data, sel])


def test_filter_two_bottoms_and_errors():
    l, _ = build("Filter", "", [(3, 2), (3, 4), (3, 1)], ntop=2)
    a, b = l.forward([rand(3, 2), rand(3, 4), torch.tensor([[1.0], [0.0], [1.0]])])
    assert a.shape == (2, 2) and b.shape == (2, 4)
    with pytest.raises(LayerError, match="one top per filtered bottom"):
        build("Filter", "", [(3, 2), (3, 1)], ntop=2)
    with pytest.raises(LayerError, match="selector shape"):
        build("Filter", "", [(3, 2), (3, 2)])
    with pytest.raises(LayerError, match="first dimension 3"):
        build("Filter", "", [(4, 2), (3,)])


def test_batch_reindex_gather_scatter_and_errors():
    x, ix = rand(5, 3), torch.tensor([4.0, 0.0, 4.0, 2.0])
    l, tops = build("BatchReindex", "", [x.shape, ix.shape])
    assert tops == [(4, 3)] and not l.allow_backward(1)
    np.testing.assert_array_equal(l.forward([x, ix])[0].numpy(), x.numpy()[[4, 0, 4, 2]])
    xr = x.clone().requires_grad_(True)
    l.forward([xr, ix])[0].sum().backward()
    assert xr.grad[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 2.0]
    assert gradcheck_layer(l, [x, ix])
    with pytest.raises(LayerError, match="out of range"):
        l.forward([x, torch.tensor([5.0, 0.0, 0.0, 0.0])])
    with pytest.raises(LayerError, match="1-D"):
        build("BatchReindex", "", [(5, 3), (4, 1)])


def test_silence_and_parameter():
    l, tops = build("Silence", "", [(2, 3), (4,)], ntop=0)
    assert tops == [] and l.forward([rand(2, 3), rand(4)]) == []
    p, tops = make_layer('name: "p" type: "Parameter" top: "t" parameter_param { shape { dim: 2 dim: 3 } }', [])
    assert tops == [(2, 3)] and tuple(p.blobs[0].shape) == (2, 3) and torch.all(p.blobs[0] == 0)
    y = p.forward([])[0]
    (y * 3).sum().backward()
    assert torch.all(p.blobs[0].grad == 3)
    p.blobs = [rand(2, 3)]
    assert gradcheck_layer(p, [])


# -- ArgMax ------------------------------------------------------------------------------------
def test_argmax_ties_put_higher_index_first():
    l, tops = build("ArgMax", "argmax_param { top_k: 3 out_max_val: true }", [(1, 5)])
    assert tops == [(1, 2, 3)]
    y = l.forward([torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])])[0]
    assert y[0, 0].tolist() == [4.0, 2.0, 1.0] and y[0, 1].tolist() == [3.0, 3.0, 3.0]


def test_argmax_against_numpy():
    x = rand(4, 3, 5, 6)
    flat = x.numpy().reshape(4, -1)
    order = np.argsort(-flat, axis=1, kind="stable")[:, :2]
    l, tops = build("ArgMax", "argmax_param { top_k: 2 }", [x.shape])
    assert tops == [(4, 1, 2, 1)]
    np.testing.assert_array_equal(l.forward([x])[0].numpy().reshape(4, 2), order)
    l, tops = build("ArgMax", "argmax_param { axis: 2 top_k: 3 }", [x.shape])
    assert tops == [(4, 3, 3, 6)]
    want = np.moveaxis(np.argsort(-x.numpy(), axis=2, kind="stable")[:, :, :3], 2, 2)
    np.testing.assert_array_equal(l.forward([x])[0].numpy(), want)
    l, _ = build("ArgMax", "argmax_param { axis: -1 out_max_val: true }", [x.shape])
    np.testing.assert_array_equal(l.forward([x])[0].numpy(), x.numpy().max(-1, keepdims=True))
    assert not l.allow_backward(0)


def test_argmax_errors():
    with pytest.raises(LayerError, match="top_k 6 exceeds"):
        build("ArgMax", "argmax_param { top_k: 6 }", [(2, 5)])
    with pytest.raises(LayerError, match="top_k 4 exceeds axis 1"):
        build("ArgMax", "argmax_param { top_k: 4 axis: 1 }", [(2, 3, 9)])


def test_flatten_gradcheck():
    layer, tops = make_layer('name: "f" type: "Flatten" bottom: "x" top: "y" flatten_param { axis: 1 end_axis: 2 }',
                             [(2, 3, 4, 5)])
    assert tops == [(2, 12, 5)]
    assert gradcheck_layer(layer, [torch.randn(2, 3, 4, 5, dtype=torch.float64)])


def test_silence_backward_gives_zero_diff():
    # Caffe's Silence writes zeros into its bottoms' diffs: in a net a silenced blob gets none.
    from brewnet import Net

    net = Net("""force_backward: true
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "s" type: "Silence" bottom: "x" }""", 0)
    net.blobs["x"].data[...] = 1
    net.forward()
    net.blobs["x"].diff[...] = 7
    net.backward()
    assert not net.blobs["x"].diff.any()
