"""Vision layers (Convolution, Deconvolution, Pooling, SPP, LRN, Im2col): shapes and literal
numbers from Caffe's C++ tests, Caffe-specific behaviour, clear errors, float64 gradchecks.
The real-Caffe golden cases run through the Net in test_golden_layers.py."""
from __future__ import annotations

import pytest
import torch

from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from helpers import gradcheck_layer, make_layer


def layer(body: str, shapes, phase=pb.TEST, bottoms=("data",), tops=("top",)):
    text = " ".join(['name: "l"'] + [f'bottom: "{b}"' for b in bottoms]
                    + [f'top: "{t}"' for t in tops] + [body])
    return make_layer(text, shapes, phase)


def conv(params: str, shapes, kind="Convolution", **kw):
    return layer(f'type: "{kind}" convolution_param {{ {params} }}', shapes, **kw)


def pool(params: str, shapes, **kw):
    return layer(f'type: "Pooling" pooling_param {{ {params} }}', shapes, **kw)


def rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- Convolution / Deconvolution ------------------------------------------------------------------
def test_conv_shapes_and_blobs():
    c, tops = conv("num_output: 4 kernel_size: 3 stride: 2", [(2, 3, 6, 4)])
    assert tops == [(2, 4, 2, 1)]
    assert [tuple(b.shape) for b in c.blobs] == [(4, 3, 3, 3), (4,)]
    assert all(b.dtype == torch.float32 and b.requires_grad for b in c.blobs)
    assert c.blobs[0].abs().sum() == 0                      # default filler: constant 0
    c, tops = conv("num_output: 3 kernel_size: 3 stride: 2 group: 3", [(2, 3, 6, 4)])
    assert tops == [(2, 3, 2, 1)] and tuple(c.blobs[0].shape) == (3, 1, 3, 3)
    c, _ = conv('num_output: 2 kernel_size: 1 bias_term: false '
                'weight_filler { type: "constant" value: 0.5 }', [(1, 3, 2, 2)])
    assert len(c.blobs) == 1 and (c.blobs[0] == 0.5).all()
    c, tops = conv("num_output: 4 kernel_size: 3 stride: 2", [(2, 3, 6, 4)], kind="Deconvolution")
    assert tops == [(2, 4, 13, 9)] and tuple(c.blobs[0].shape) == (3, 4, 3, 3)
    c, tops = conv("num_output: 6 kernel_size: 3 stride: 2 group: 3", [(2, 3, 6, 4)],
                   kind="Deconvolution")
    assert tops == [(2, 6, 13, 9)] and tuple(c.blobs[0].shape) == (3, 2, 3, 3)


def test_conv_sobel_equals_separable():
    """Caffe's TestSobelConvolution: 3x3 Sobel (stride 2) == [1 2 1]^T (stride_h 2) then
    [-1 0 1] (stride_w 2)."""
    x = rand(2, 3, 6, 4)
    full, _ = conv("num_output: 1 kernel_size: 3 stride: 2 bias_term: false", [x.shape])
    sobel = torch.tensor([[-1.0, 0, 1], [-2, 0, 2], [-1, 0, 1]], dtype=torch.float64)
    full.blobs = [sobel.expand(1, 3, 3, 3)]
    col, s1 = conv("num_output: 1 bias_term: false kernel_h: 3 kernel_w: 1 stride_h: 2 "
                   "stride_w: 1", [x.shape])
    col.blobs = [torch.tensor([1.0, 2, 1], dtype=torch.float64).view(1, 1, 3, 1).expand(1, 3, 3, 1)]
    row, _ = conv("num_output: 1 bias_term: false kernel_h: 1 kernel_w: 3 stride_h: 1 "
                  "stride_w: 2", s1)
    row.blobs = [torch.tensor([-1.0, 0, 1], dtype=torch.float64).view(1, 1, 1, 3)]
    torch.testing.assert_close(full.forward([x])[0], row.forward(col.forward([x]))[0])


def test_deconv_all_ones_pattern():
    """Caffe's TestSimpleDeconvolution: ones in, weights 1, bias 0.1 -> 3.1, +3 on an overlap in
    one axis, +9 on both."""
    d, tops = conv('num_output: 4 kernel_size: 3 stride: 2 weight_filler { type: "constant" '
                   'value: 1 } bias_filler { type: "constant" value: 0.1 }', [(2, 3, 6, 4)],
                   kind="Deconvolution")
    y = d.forward([torch.ones(2, 3, 6, 4)])[0]
    assert tuple(y.shape) == tops[0] == (2, 4, 13, 9)
    for h in range(13):
        for w in range(9):
            oh, ow = h % 2 == 0 and 0 < h < 12, w % 2 == 0 and 0 < w < 8
            expect = 3.1 + (9 if oh and ow else 3 if oh or ow else 0)
            torch.testing.assert_close(y[:, :, h, w], torch.full((2, 4), expect))


def test_conv_several_bottoms_share_weights():
    c, tops = conv('num_output: 2 kernel_size: 2 weight_filler { type: "gaussian" }',
                   [(1, 3, 4, 4)] * 2, bottoms=("a", "b"), tops=("x", "y"))
    a, b = torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4)
    ya, yb = c.forward([a, b])
    assert tops == [(1, 2, 3, 3)] * 2
    torch.testing.assert_close(yb, c.forward([b, a])[0])
    with pytest.raises(LayerError, match=r"same shape.*\(1, 3, 4, 4\).*\(1, 3, 5, 4\)"):
        c.reshape([(1, 3, 4, 4), (1, 3, 5, 4)])


def test_conv_axis_and_nd():
    # axis 2: axes before it are batch axes
    c, tops = conv('num_output: 4 kernel_size: 3 pad: 1 axis: 2 weight_filler { type: "xavier" }',
                   [(2, 3, 5, 6, 7)])
    assert tops == [(2, 3, 4, 6, 7)]
    x = torch.randn(2, 3, 5, 6, 7)
    y = c.forward([x])[0]
    ref = torch.nn.functional.conv2d(x.view(6, 5, 6, 7), c.blobs[0], c.blobs[1], padding=1)
    torch.testing.assert_close(y, ref.view(2, 3, 4, 6, 7))
    # 3-D with per-dim values, and 0-D (a grouped inner product)
    c, tops = conv("num_output: 2 kernel_size: 3 kernel_size: 1 kernel_size: 2 stride: 2 "
                   "stride: 1 stride: 1 pad: 1 pad: 0 pad: 0 dilation: 1", [(1, 2, 5, 4, 3)])
    assert tops == [(1, 2, 3, 4, 2)] and tuple(c.blobs[0].shape) == (2, 2, 3, 1, 2)
    c, tops = conv('num_output: 4 group: 2 weight_filler { type: "gaussian" }', [(5, 6)])
    assert tops == [(5, 4)] and tuple(c.blobs[0].shape) == (4, 3)
    x = torch.randn(5, 6)
    ref = torch.cat([x[:, :3] @ c.blobs[0][:2].T, x[:, 3:] @ c.blobs[0][2:].T], 1)
    torch.testing.assert_close(c.forward([x])[0], ref)


def test_conv_dtype_and_errors():
    c, _ = conv("num_output: 2 kernel_size: 3", [(1, 2, 5, 5)])
    c.blobs = [b.double() for b in c.blobs]
    assert c.forward([rand(1, 2, 5, 5)])[0].dtype == torch.float64
    bad = [("num_output: 2 kernel_h: 3 kernel_w: 3", (1, 2, 5, 5, 5), "2D convolution"),
           ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 2, 5, 5), "not both"),
           ("num_output: 2 kernel_size: 3 kernel_size: 3", (1, 2, 5, 5, 5), "once per spatial"),
           ("num_output: 3 kernel_size: 3 group: 2", (1, 2, 5, 5), "multiples of group"),
           ("num_output: 2", (1, 2, 5, 5), "kernel_size must be specified"),
           ("num_output: 2 kernel_size: 7", (1, 2, 4, 4), r"output size \(-2, -2\)")]
    for params, shape, msg in bad:
        with pytest.raises(LayerError, match=msg):
            conv(params, [shape])
    c, _ = conv("num_output: 2 kernel_size: 3", [(1, 2, 5, 5)])
    with pytest.raises(LayerError, match=r"\(1, 3, 5, 5\).*2 channels"):
        c.reshape([(1, 3, 5, 5)])


def test_gradcheck_conv_deconv():
    specs = [("Convolution", "num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2 dilation: 1",
              (2, 4, 6, 5)),
             ("Convolution", "num_output: 3 kernel_h: 3 kernel_w: 2 dilation: 2 pad_h: 1 pad_w: 0",
              (1, 2, 7, 6)),
             ("Deconvolution", "num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2",
              (2, 2, 3, 3))]
    for kind, params, shape in specs:
        c, _ = conv(params + ' weight_filler { type: "gaussian" } bias_filler { type: "gaussian" }',
                    [shape], kind=kind)
        assert gradcheck_layer(c, [rand(*shape)])


# -- Pooling -------------------------------------------------------------------------------------
def test_pooling_shapes():
    assert pool("kernel_size: 3 stride: 2", [(2, 3, 6, 5)])[1] == [(2, 3, 3, 2)]
    assert pool("pool: AVE kernel_size: 3 stride: 2 pad: 1", [(2, 3, 6, 5)])[1] == [(2, 3, 4, 3)]
    assert pool("pool: AVE global_pooling: true", [(2, 3, 6, 5)])[1] == [(2, 3, 1, 1)]
    assert pool("kernel_size: 3 stride: 2 round_mode: FLOOR", [(1, 1, 8, 8)])[1] == [(1, 1, 3, 3)]
    p, tops = pool("kernel_size: 2 stride: 2 pad: 1", [(1, 1, 5, 5)], tops=("top", "mask"))
    assert tops == [(1, 1, 3, 3)] * 2


def test_pooling_mask_top_and_gradient_to_first_max():
    p, _ = pool("kernel_h: 3 kernel_w: 2", [(1, 1, 6, 6)], tops=("top", "mask"))
    x = torch.tensor([[1.0, 5, 5, 0, 0, 0]] * 6).view(1, 1, 6, 6).requires_grad_(True)
    y, m = p.forward([x])
    assert not m.requires_grad and m.dtype == x.dtype
    # ties: the first max in row-major order, i.e. the window's top row
    assert m[0, 0, 0].tolist() == [1, 1, 2, 3, 4] and m[0, 0, 1].tolist() == [7, 7, 8, 9, 10]
    y.sum().backward()
    assert x.grad[0, 0, :4].tolist() == [[0, 2, 1, 1, 1, 0]] * 4 and x.grad[0, 0, 4:].sum() == 0


def test_pooling_global_follows_input_size():
    p, _ = pool("pool: MAX global_pooling: true", [(2, 3, 4, 5)])
    assert p.reshape([(2, 3, 7, 2)]) == [(2, 3, 1, 1)]
    x = rand(2, 3, 7, 2)
    torch.testing.assert_close(p.forward([x])[0], x.amax((2, 3), keepdim=True))


def test_pooling_stochastic_phases():
    x = torch.rand(2, 3, 6, 6, dtype=torch.float64)
    p_test, _ = pool("pool: STOCHASTIC kernel_size: 2 stride: 2", [x.shape], phase=pb.TEST)
    y = p_test.forward([x])[0]
    win = x.view(2, 3, 3, 2, 3, 2)
    torch.testing.assert_close(y, (win ** 2).sum((3, 5)) / win.sum((3, 5)))
    p_train, _ = pool("pool: STOCHASTIC kernel_size: 2 stride: 2", [x.shape], phase=pb.TRAIN)
    y = p_train.forward([x])[0]
    assert ((y[..., None, :, None] == win).any(5).any(3)).all()   # each value is from its window


def test_pooling_errors():
    bad = [("kernel_size: 3 pad: 3", "pad \\(3, 3\\) must be smaller than kernel"),
           ("pool: STOCHASTIC kernel_size: 3 pad: 1", "only for AVE and MAX"),
           ("global_pooling: true kernel_size: 2", "cannot be specified"),
           ("global_pooling: true stride: 2", "only pad = 0 and stride = 1"),
           ("kernel_size: 2 kernel_h: 2 kernel_w: 2", "not both"),
           ("kernel_h: 2", "kernel_size OR kernel_h and kernel_w"),
           ("kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1", "pad is pad OR")]
    for params, msg in bad:
        with pytest.raises(LayerError, match=msg):
            pool(params, [(1, 1, 5, 5)])
    with pytest.raises(LayerError, match="only MAX pooling"):
        pool("pool: AVE kernel_size: 2", [(1, 1, 5, 5)], tops=("top", "mask"))
    with pytest.raises(LayerError, match=r"4 axes.*\(1, 5, 5\)"):
        pool("kernel_size: 2", [(1, 5, 5)])


def test_gradcheck_pooling_layers():
    x = torch.randperm(2 * 2 * 7 * 6, generator=torch.Generator().manual_seed(0)).double()
    x = (x / x.numel()).view(2, 2, 7, 6)
    for params in ["pool: MAX kernel_size: 3 stride: 2 pad: 1",
                   "pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 2 pad_w: 1",
                   "pool: AVE kernel_size: 3 stride: 2",
                   "pool: AVE kernel_size: 3 stride: 2 pad: 2",
                   "pool: AVE global_pooling: true",
                   "pool: STOCHASTIC kernel_size: 3 stride: 2"]:
        p, _ = pool(params, [x.shape])
        assert gradcheck_layer(p, [x]), params


# -- SPP -----------------------------------------------------------------------------------------
def spp(params: str, shapes, **kw):
    return layer(f'type: "SPP" spp_param {{ {params} }}', shapes, **kw)


def test_spp_shapes():
    assert spp("pyramid_height: 3", [(2, 3, 9, 8)])[1] == [(2, 63)]
    assert spp("pyramid_height: 5", [(4, 3, 1024, 765)])[1] == [(4, 1023)]
    assert spp("pyramid_height: 1", [(2, 3, 9, 8)])[1] == [(2, 3, 1, 1)]
    with pytest.raises(LayerError, match=r"pad \(1, 1\) must be smaller than kernel \(1, 1\).*"
                                         r"level 2 of a 3x3"):
        spp("pyramid_height: 3", [(1, 1, 3, 3)])


def test_spp_levels_concatenate_pooled_bins():
    x = rand(2, 3, 9, 8)
    s, _ = spp("pyramid_height: 3 pool: AVE", [x.shape])
    y = s.forward([x])[0]
    assert tuple(y.shape) == (2, 63)
    torch.testing.assert_close(y[:, :3], x.mean((2, 3)))             # level 0: whole image
    # level 1: kernel (5, 4), pad (1, 0): bin (0, 0) = rows -1..3 (4 real), divisor 5 * 4
    torch.testing.assert_close(y[:, 3:15].view(2, 3, 2, 2)[:, :, 0, 0],
                               x[:, :, :4, :4].sum((2, 3)) / 20)
    s, _ = spp("pyramid_height: 2 pool: MAX", [x.shape])
    assert gradcheck_layer(s, [_distinct(x.shape)])


def _distinct(shape):
    x = torch.randperm(int(torch.tensor(shape).prod()), generator=torch.Generator().manual_seed(1))
    return (x.double() / x.numel()).view(shape)


# -- LRN -----------------------------------------------------------------------------------------
def lrn(params: str, shapes):
    return layer(f'type: "LRN" lrn_param {{ {params} }}', shapes)


def test_lrn_regions_and_defaults():
    x = rand(2, 7, 3, 3)
    l, tops = lrn("", [x.shape])                     # local_size 5, alpha 1, beta 0.75, k 1
    assert tops == [(2, 7, 3, 3)]
    sq = torch.nn.functional.pad(x ** 2, (0, 0, 0, 0, 2, 2))
    scale = 1 + sum(sq[:, i:i + 7] for i in range(5)) / 5
    torch.testing.assert_close(l.forward([x])[0], x * scale ** -0.75)
    w, _ = lrn("local_size: 3 alpha: 0.3 k: 5 norm_region: WITHIN_CHANNEL", [x.shape])
    w_k1, _ = lrn("local_size: 3 alpha: 0.3 k: 1 norm_region: WITHIN_CHANNEL", [x.shape])
    torch.testing.assert_close(w.forward([x])[0], w_k1.forward([x])[0])   # k is ignored
    for params in ["local_size: 3 alpha: 0.5 k: 2", "local_size: 3 norm_region: WITHIN_CHANNEL"]:
        l, _ = lrn(params, [x.shape])
        assert gradcheck_layer(l, [x]), params


def test_lrn_errors():
    with pytest.raises(LayerError, match="odd values for local_size"):
        lrn("local_size: 4", [(1, 3, 2, 2)])
    with pytest.raises(LayerError, match=r"4 axes.*\(3, 2, 2\)"):
        lrn("", [(3, 2, 2)])


# -- Im2col --------------------------------------------------------------------------------------
def test_im2col_shapes_and_order():
    i, tops = conv("kernel_size: 3 stride: 2 dilation: 3", [(2, 3, 10, 11)], kind="Im2col")
    assert tops == [(2, 27, 2, 3)] and i.blobs == []
    x = rand(2, 3, 10, 11)
    y = i.forward([x])[0]
    # channel (c * 3 + ki) * 3 + kj at output (oh, ow) = x[c, oh*2 + ki*3, ow*2 + kj*3]
    assert y[1, (2 * 3 + 1) * 3 + 2, 1, 2] == x[1, 2, 2 + 3, 4 + 6]
    i, tops = conv("kernel_size: 3 stride: 2 pad: 1 axis: 2", [(2, 3, 2, 6, 5)], kind="Im2col")
    assert tops == [(2, 3, 18, 3, 3)]
    assert gradcheck_layer(i, [rand(2, 3, 2, 6, 5)])
    with pytest.raises(LayerError, match="at least one spatial axis"):
        conv("kernel_size: 3", [(2, 3)], kind="Im2col")
