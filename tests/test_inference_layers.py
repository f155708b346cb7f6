"""The layers' inference forms (no gradient wanted: one pass, in place where the buffer is
fresh) against their gradient forms on the same inputs, and the gradient forms still chosen
whenever an input or a parameter requires grad."""
import itertools

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import brewnet.layers.pooling as Pool
from brewnet.layers.common import eltwise_max, eltwise_sum
from brewnet.layers.neuron import _prelu_rows_ok, prelu
from helpers import GOLDEN_LAYERS, gradcheck_layer, have, make_layer

FLT_MAX = float(np.finfo(np.float32).max)
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45, 3.0, -2.0]


class Ops(TorchDispatchMode):
    """The aten ops a call dispatches (their overload packet names)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def ops(f, *args):
    with Ops() as o:
        f(*args)
    return o.names


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def same_bits(a, b) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_bits_but_nan(a, b) -> bool:
    """NaN at the same places, the same bits elsewhere (a NaN's bit pattern aside)."""
    nan = torch.isnan(b)
    return torch.equal(torch.isnan(a), nan) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def with_specials(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    flat = x.view(-1)
    for i, v in enumerate(SPECIAL):
        flat[i::len(SPECIAL) + 3] = v
    return x


def prelu_where(x, slope):
    """The gradient form (Caffe's backward branch at 0)."""
    if slope.dim() == 1:
        slope = slope.view((1, -1) + (1,) * (x.dim() - 2))
    return torch.where(x > 0, x, x * slope)


# -- PReLU ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 5), (2, 5, 7), (3, 5, 6, 7), (2, 5, 2, 3, 4), (1, 10, 60, 64)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prelu_inference_form_is_the_where_form_bit_for_bit(shape, shared, nhwc, dtype):
    # Same formula (x > 0 ? x : slope * x): equal bits, signed zeros, NaN and infinities included.
    # (1, 10, 60, 64) in NHWC with a slope per channel: the NHWC rows form (neuron._prelu_rows_ok)
    x = with_specials(shape, dtype)
    if nhwc and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    slope = torch.randn(() if shared else shape[1], dtype=dtype)
    if not shared:
        slope[:3] = torch.tensor([0.0, -0.5, float("nan")])
    with torch.no_grad():
        y = prelu(x, slope)
    assert same_bits(y, prelu_where(x, slope)) and y.stride() == prelu_where(x, slope).stride()
    assert _prelu_rows_ok(x, slope) == (nhwc and not shared and shape == (1, 10, 60, 64))


def test_prelu_values_are_caffes_with_its_signed_zeros():
    # Caffe: max(x, 0) + a * min(x, 0) (std::max / std::min keep the first operand on ties).
    x = torch.tensor(SPECIAL[:7]).view(1, -1)
    for a in (0.25, -0.25, 0.0):
        with torch.no_grad():
            y = prelu(x, torch.tensor(a))
        with np.errstate(invalid="ignore"):       # 0 * -inf: NaN in Caffe too
            caffe = [np.float32(0 if v < 0 else v) + np.float32(a) * np.float32(0 if v > 0 else v)
                     for v in np.float32(SPECIAL[:7])]
        np.testing.assert_array_equal(y.view(-1).numpy(), np.float32(caffe))   # == on zeros, NaN
        # the one sign that differs from Caffe (both forms): +0 with a negative slope gives -0
        assert torch.signbit(y[0, 0]).item() == (a < 0)
        assert torch.signbit(y[0, 1]).item() == (a >= 0)                         # -0, as Caffe


def test_prelu_layer_picks_its_form_by_grad():
    layer, _ = make_layer('name: "p" type: "PReLU" bottom: "x" top: "y"', [(2, 3, 4, 4)])
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        fused = ops(layer.forward, [x])
    assert "_prelu_kernel" in fused or "prelu" in fused
    assert "where" not in fused
    # the slope blob requires grad: with grad enabled the where form is used even for a plain x
    assert layer.blobs[0].requires_grad and "where" in ops(layer.forward, [x])
    assert "where" in ops(layer.forward, [x.clone().requires_grad_()])
    layer.blobs[0].requires_grad_(False)
    assert "where" not in ops(layer.forward, [x])       # nothing needs a gradient
    layer.blobs[0].requires_grad_(True)


def test_prelu_gradient_form_takes_caffes_branch_at_zero():
    layer, _ = make_layer('name: "p" type: "PReLU" bottom: "x" top: "y" '
                          'prelu_param { filler { type: "constant" value: 0.3 } }', [(1, 2, 1, 3)])
    x = torch.tensor([[[[0.0, -0.0, 2.0]], [[0.0, -1.0, 1.0]]]], requires_grad=True)
    layer.forward([x])[0].sum().backward()
    slope = np.float32(0.3)
    np.testing.assert_array_equal(x.grad.view(-1).numpy(),
                                  np.float32([slope, slope, 1, slope, slope, 1]))
    np.testing.assert_array_equal(layer.blobs[0].grad.numpy(), np.float32([0, -1]))
    x = torch.randn(2, 3, 4, 5) + 0.05 * torch.sign(torch.randn(2, 3, 4, 5))
    assert gradcheck_layer(layer_for((2, 3, 4, 5)), [x])


def layer_for(shape):
    return make_layer('name: "p" type: "PReLU" bottom: "x" top: "y"', [shape])[0]


# -- MAX pooling ------------------------------------------------------------------------------
POOLS = [((3, 3), (2, 2), (0, 0)), ((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1)),
         ((3, 3), (1, 1), (2, 2))]       # the last: pad > kernel // 2, the explicitly padded path


@pytest.mark.parametrize("kernel,stride,pad", POOLS)
@pytest.mark.parametrize("nhwc", [False, True])
def test_max_pool_windows_of_minus_inf_give_minus_flt_max_in_both_forms(kernel, stride, pad, nhwc):
    x = with_specials((2, 3, 9, 8))
    x[0, 0] = float("-inf")                  # every window of this plane holds -inf only
    x[1, 2, :4, :4] = float("-inf")
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        y, _ = Pool.max_pool2d(x, kernel, stride, pad)
    assert not torch.isneginf(y).any() and (y[0, 0] == -FLT_MAX).all()
    xg = x.clone().requires_grad_()
    yg, _ = Pool.max_pool2d(xg, kernel, stride, pad)
    assert same_bits(y, yg)
    yg.sum().backward()
    assert (xg.grad[0, 0] == 0).all()        # Caffe: mask -1, no gradient from such a window
    # the mask path agrees on the values
    with torch.no_grad():
        ym, m = Pool.max_pool2d(x, kernel, stride, pad, return_mask=True)
    assert same_bits(y, ym) and (m[0, 0] == -1).all()


@pytest.mark.parametrize("shape,kernel,stride", [
    ((1, 16, 72, 64), (2, 2), (2, 2)),     # (the maxima over torch's grain: pooling.py's rule)
    ((2, 16, 57, 57), (3, 3), (2, 2)),
    ((4, 12, 48, 48), (3, 2), (1, 2)),
    ((1, 10, 96, 120), (2, 2), (2, 2))])   # MTCNN P-Net's kind
def test_max_pool_as_a_chain_of_maxima_gives_torchs_values(shape, kernel, stride, monkeypatch):
    """Inference MAX pooling in NHWC takes the chain of maxima where its size rule says so: the
    values of torch's kernel (NaN at the same places; a zero maximum may differ in sign only,
    pooling._window_max), -FLT_MAX for a window of -inf only, NHWC out, the input untouched, and
    the same values as the gradient form."""
    x = with_specials(shape)
    x[0, 0, :4, :4] = float("-inf")
    x = x.contiguous(memory_format=torch.channels_last)
    keep = x.clone()
    chained = []
    real = Pool._window_max
    monkeypatch.setattr(Pool, "_window_max", lambda *a: chained.append(1) or real(*a))
    with torch.no_grad():
        y, _ = Pool.max_pool2d(x, kernel, stride, (0, 0))
    assert chained, "the size rule did not take the chain"
    want = torch.nn.functional.max_pool2d(x, kernel, stride, ceil_mode=True).clamp_min(-FLT_MAX)
    np.testing.assert_array_equal(y.numpy(), want.numpy())       # (NaN == NaN, -0 == +0)
    assert y.stride() == want.stride() and same_bits(x, keep)
    assert (y[0, 0, 0, 0] == -FLT_MAX).item()
    yg, _ = Pool.max_pool2d(x.clone().requires_grad_(), kernel, stride, (0, 0))
    np.testing.assert_array_equal(y.numpy(), yg.detach().numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_max_pool_in_half_precision(dtype):
    # -FLT_MAX does not fit: the bound is -inf there, so nothing is clamped (and nothing fails)
    x = torch.full((1, 1, 4, 4), float("-inf"), dtype=dtype)
    x[0, 0, 0, 0] = 1.0
    with torch.no_grad():
        y, _ = Pool.max_pool2d(x, (2, 2), (2, 2), (0, 0))
    assert y.dtype == dtype and y.view(-1).tolist() == [1.0] + [float("-inf")] * 3


def test_max_pool_clamps_its_own_output_in_place_with_or_without_grad():
    # (with a gradient, inside the pooling Function: its backward masks the floor, test_functional.py)
    x = torch.randn(1, 2, 6, 6)
    keep = x.clone()
    with torch.no_grad():
        assert "clamp_min_" in ops(Pool.max_pool2d, x, (2, 2), (2, 2), (0, 0))
        y = Pool.max_pool2d(x, (2, 2), (2, 2), (0, 0))[0]
    xg = x.clone().requires_grad_()
    yg = Pool.max_pool2d(xg, (2, 2), (2, 2), (0, 0))[0]
    assert same_bits(y, yg) and yg.requires_grad and same_bits(x, keep) and same_bits(xg.detach(), keep)


# -- Eltwise --------------------------------------------------------------------------------
def eltwise(text, shapes):
    bottoms = " ".join(f'bottom: "b{i}"' for i in range(len(shapes)))
    return make_layer(f'name: "e" type: "Eltwise" {bottoms} top: "t" eltwise_param {{ {text} }}',
                      shapes)[0]


@pytest.mark.parametrize("text,n", [("operation: SUM coeff: 0.5 coeff: -1.5", 2),
                                    ("operation: SUM coeff: 1 coeff: -1", 2),
                                    ("operation: SUM coeff: 1 coeff: 0.3 coeff: -2", 3),
                                    ("operation: SUM", 3),
                                    ("operation: PROD", 3),
                                    ("operation: MAX", 3)])
def test_eltwise_same_bits_with_and_without_grad_and_bottoms_untouched(text, n):
    shape = (2, 3, 5, 7)
    xs = [with_specials(shape, seed=i) for i in range(n)]
    keep = [x.clone() for x in xs]
    layer = eltwise(text, [shape] * n)
    with torch.no_grad():
        y = layer.forward(xs)[0]
    yg = layer.forward([x.clone().requires_grad_() for x in xs])[0]
    # MAX: other ops than torch.where (see eltwise_max), so a NaN's bit pattern may differ
    assert (same_bits_but_nan if "MAX" in text else same_bits)(y, yg)
    assert all(same_bits(x, k) for x, k in zip(xs, keep))   # pycaffe: a top never aliases a bottom
    assert y.data_ptr() not in {x.data_ptr() for x in xs}


def test_eltwise_sum_is_caffes_axpy_chain():
    # Caffe: top = 0; top += c_i * x_i with OpenBLAS's saxpy, a fused multiply-add per term.
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1001, generator=g) for _ in range(3)]
    cs = [0.5, -1.5, 0.3]
    cs32 = [float(np.float32(c)) for c in cs]
    y = eltwise_sum(xs, cs32)
    want = (xs[0] * cs32[0]).double()
    for c, x in zip(cs32[1:], xs[1:]):       # c * x is exact in float64: one rounding per term
        want = (want + x.double() * c).float().double()
    assert same_bits(y, want.float())


def test_eltwise_sum_coeff_golden_bit_for_bit():
    path = GOLDEN_LAYERS / "eltwise_sum_coeff.npz"
    if not have(path):
        pytest.skip("no golden data")
    z = np.load(path)
    y = eltwise_sum([torch.from_numpy(z["bottom/a"]), torch.from_numpy(z["bottom/b"])],
                    [float(np.float32(0.5)), float(np.float32(-1.5))])
    np.testing.assert_array_equal(y.numpy(), z["top/top"])


@pytest.mark.parametrize("text,n", [("operation: SUM coeff: 0.5 coeff: -1.5 coeff: 2", 3),
                                    ("operation: SUM coeff: 1 coeff: -0.25", 2),
                                    ("operation: PROD", 3)])
def test_eltwise_gradients_float64(text, n):
    shape = (2, 3, 4)
    layer = eltwise(text, [shape] * n)
    assert gradcheck_layer(layer, [torch.randn(shape) for _ in range(n)])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_eltwise_max_inference_form_on_every_special_combination(n):
    vals = [float("nan"), 0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf")]
    combos = list(itertools.product(vals, repeat=n))
    for dtype in (torch.float32, torch.float64):
        for rep in (1, 9):                       # the scalar path, and the vector body and tail
            xs = [torch.tensor([c[i] for c in combos] * rep, dtype=dtype) for i in range(n)]
            with torch.no_grad():
                y = eltwise_max(xs)
            want = torch.where(xs[0] > xs[1], xs[0], xs[1])
            for x in xs[2:]:
                want = torch.where(x > want, x, want)
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(y), nan)
            assert torch.equal(y[~nan], want[~nan])              # == : a +-0 tie may differ by sign
            nz = ~nan & (want != 0)
            assert torch.equal(bits(y)[nz], bits(want)[nz])


def test_eltwise_max_picks_its_form_by_grad():
    xs = [torch.randn(2, 3) for _ in range(3)]
    with torch.no_grad():
        names = ops(eltwise_max, xs)
    assert "where" not in names and "clamp_min_" in names
    assert "where" in ops(eltwise_max, [xs[0], xs[1].requires_grad_(), xs[2]])


def test_eltwise_prod_in_place_only_without_grad():
    shape = (2, 3)
    layer = eltwise("operation: PROD", [shape] * 3)
    xs = [torch.randn(shape) for _ in range(3)]
    with torch.no_grad():
        assert "mul_" in ops(layer.forward, xs)
    assert "mul_" not in ops(layer.forward, [x.requires_grad_() for x in xs])


# -- LRN ------------------------------------------------------------------------------------
@pytest.mark.parametrize("region,size", [("ACROSS_CHANNELS", 1), ("ACROSS_CHANNELS", 3),
                                         ("ACROSS_CHANNELS", 5), ("ACROSS_CHANNELS", 9),
                                         ("WITHIN_CHANNEL", 3)])
@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lrn_same_bits_with_and_without_grad(region, size, nhwc, dtype):
    # ACROSS: the channel window sums as shifted slices without a gradient, the pooling kernel's
    # order and division (so the same bits), pooling with one; 37 channels and 6 x 7 planes: the
    # kernels' vector bodies and tails in both layouts
    shape = (2, 37, 6, 7)
    layer, _ = make_layer(f'name: "l" type: "LRN" bottom: "x" top: "y" lrn_param {{ local_size: '
                          f'{size} alpha: 0.01 beta: 0.75 k: 2 norm_region: {region} }}', [shape])
    x = torch.randn(shape, dtype=dtype) * 10
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    keep = x.clone()
    with torch.no_grad():
        names = ops(layer.forward, [x])
        y = layer.forward([x])[0]
    assert "pow_" in names
    assert ("avg_pool2d" in names) == (region == "WITHIN_CHANNEL")
    xg = x.clone().requires_grad_()
    names = ops(layer.forward, [xg])
    yg = layer.forward([xg])[0]
    if region == "WITHIN_CHANNEL":     # (ACROSS trains through one Function: test_functional.py)
        assert "pow_" not in names and "pow" in names and "avg_pool2d" in names
    assert same_bits(y, yg) and y.stride() == yg.stride() and same_bits(x, keep) and yg.requires_grad


# -- the layers left as they were: one op each already ----------------------------------------
@pytest.mark.parametrize("text,shapes,op", [
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', [(2, 3, 4, 4)], "leaky_relu"),
    ('type: "Concat"', [(2, 3, 4, 4), (2, 2, 4, 4)], "cat"),
    ('type: "Softmax"', [(2, 3, 4, 4)], "_softmax"),
    ('type: "Bias"', [(2, 3, 4, 4)], "add"),
])
def test_one_op_layers(text, shapes, op):
    layer, _ = make_layer(f'name: "l" {text} ' + " ".join(f'bottom: "b{i}"' for i in range(len(shapes)))
                          + ' top: "t"', shapes)
    with torch.no_grad():
        names = ops(layer.forward, [torch.randn(s) for s in shapes])
    assert op in names


def test_depthwise_convolution_is_one_kernel_without_grad():
    layer, _ = make_layer('name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                          'num_output: 4 group: 4 kernel_size: 3 pad: 1 weight_filler { type: '
                          '"gaussian" std: 0.1 } }', [(2, 4, 6, 6)])
    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        names = ops(layer.forward, [x])
    assert [n for n in names if "conv" in n] == ["convolution"] and "copy_" not in names


# -- the golden cases of the layers with inference forms, without a gradient ------------------
INFERENCE_TYPES = {"PReLU", "Eltwise", "LRN", "Pooling"}


def golden_cases():
    import json

    index = GOLDEN_LAYERS / "index.json"
    if not have(index):
        return []
    return [c for c in json.loads(index.read_text())["cases"] if c["type"] in INFERENCE_TYPES]


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["file"][:-4])
def test_golden_cases_without_grad(case):
    # The golden test runs these nets with force_backward, i.e. the gradient forms.
    import json

    from brewnet import Net
    from brewnet.proto import caffe_pb2 as pb
    from test_golden_layers import tolerances

    z = np.load(GOLDEN_LAYERS / case["file"], allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    net = Net(str(z["prototxt"]), pb.TRAIN if meta["phase"] == "TRAIN" else pb.TEST)
    layer = net.layer_by_name["test"]
    with torch.no_grad():
        for i in range(meta["num_params"]):
            layer.blobs[i].copy_(torch.from_numpy(z[f"param/{i}"]))
    bottoms = [torch.from_numpy(z[f"bottom/{b}"]) for b in meta["bottoms"]]
    with torch.no_grad():
        tops = layer.forward(bottoms)
    grad_tops = layer.forward([b.clone().requires_grad_() for b in bottoms])
    for name, y, yg in zip(meta["tops"], tops, grad_tops):
        assert (same_bits_but_nan if case["type"] == "Eltwise" else same_bits)(y, yg)
        limits = dict(rtol=0, atol=0) if name == "mask" else tolerances(case["type"], "top")
        np.testing.assert_allclose(y.numpy(), z[f"top/{name}"], **limits)
