"""brewnet.testing.GradientChecker: Caffe's checker passes correct layers (built-in, plugin,
Python), catches a wrong backward by element, skips kinks as Caffe's, and keeps Caffe's
check_bottom and reseeding rules."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import brewnet
from brewnet.layers import Layer, create_layer, register_layer, unregister_layer
from brewnet.testing import GradientChecker, GradientCheckError

IP = ('name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 '
      'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } }')


class _Scaled(torch.autograd.Function):
    """y = 3x with a backward off by ``wrong``: at flat index ``at`` (or everywhere if None)."""

    @staticmethod
    def forward(ctx, x, wrong, at):
        ctx.wrong, ctx.at = wrong, at
        return 3 * x

    @staticmethod
    def backward(ctx, dy):
        dx = 3 * dy
        if ctx.at is None:
            dx = dx * ctx.wrong
        else:
            dx.view(-1)[ctx.at] *= ctx.wrong
        return dx, None, None


@pytest.fixture
def scaled():
    """A plugin ``Scaled`` layer whose backward is wrong as its param_str says."""
    from dataclasses import dataclass

    @register_layer("TestScaled")
    class Scaled(Layer):
        @dataclass
        class Params:
            wrong: float = 1.0
            at: int = -1

        def forward(self, bottoms):
            p = self.params
            return [_Scaled.apply(bottoms[0], p.wrong, None if p.at < 0 else p.at)]

    yield lambda s="": create_layer(
        f'name: "s" type: "TestScaled" bottom: "x" top: "y" python_param {{ param_str: "{s}" }}')
    unregister_layer("TestScaled")


X = torch.tensor([[0.5, -1.0, 2.0], [1.5, -0.25, 0.75]])


def test_a_correct_plugin_passes_every_mode(scaled):
    g = GradientChecker()
    assert g.check_gradient(scaled(), [X]).compared == 6
    assert g.check_gradient_exhaustive(scaled(), [X]).compared == 36
    r = g.check_gradient_eltwise(scaled(), [X])
    assert r.compared == 36 and r.worst <= 1


@pytest.mark.parametrize("wrong", [-1.0, 2.0])
def test_a_wrong_backward_fails_naming_each_element(scaled, wrong):
    with pytest.raises(GradientCheckError) as e:
        GradientChecker().check_gradient(scaled(f"wrong={wrong}"), [X])
    assert len(e.value.failures) == 6
    # objective ½·Σ(3x)²: the true derivative is 9x; the layer says 9x·wrong
    first = e.value.failures[0]
    assert first["blob"] == "bottom 0 ('x')" and first["index"] == (0, 0)
    assert first["numeric"] == pytest.approx(4.5, rel=1e-3)
    assert first["analytic"] == pytest.approx(4.5 * wrong, rel=1e-6)
    assert re.search(rf"bottom 0 \('x'\) index \(0, 0\) \(flat 0\): analytic {4.5 * wrong:g}, "
                     r"numeric 4\.(49|50)\d*", str(e.value))


def test_one_wrong_element_is_the_one_named(scaled):
    with pytest.raises(GradientCheckError) as e:
        GradientChecker().check_gradient_exhaustive(scaled("wrong=1.01 at=4"), [X])
    # 1% off at x[1, 1] (|analytic| 6 > 1: relative threshold 1e-3 x 6): only top element 4 sees it
    assert [(f["index"], f["objective"]) for f in e.value.failures] == [((1, 1), (0, 4))]
    assert "gradient check failed at 1 of 36 compared elements" in str(e.value)
    assert "analytic 6.06, numeric 6" in str(e.value)


def test_the_threshold_is_relative_to_the_larger_gradient(scaled):
    # 0.05% off: within threshold 1e-3 x max(|g|, 1), which an absolute 1e-3 would fail (|g| = 6)
    assert GradientChecker().check_gradient_exhaustive(scaled("wrong=1.0005 at=4"), [X]).worst < 1
    with pytest.raises(GradientCheckError):
        GradientChecker(threshold=1e-4).check_gradient_exhaustive(scaled("wrong=1.0005 at=4"), [X])


def test_relu_kink_skipping_as_caffe():
    x = torch.tensor([[0.0, 0.005, -0.004, 0.8], [-0.6, 1.2, 0.3, -2.0]])
    relu = create_layer('name: "r" type: "ReLU" bottom: "x" top: "y"')
    with pytest.raises(GradientCheckError) as e:
        GradientChecker(1e-2, 1e-3).check_gradient_eltwise(relu, [x])
    # within a step of 0 the central difference straddles the kink: 1, 1.25, 0.3 against 0, 1, 0
    assert sorted({f["flat"] for f in e.value.failures}) == [0, 1, 2]
    r = GradientChecker(1e-2, 1e-3, kink=0.0, kink_range=0.01).check_gradient_eltwise(relu, [x])
    assert (r.compared, r.skipped) == (5 * 8, 3 * 8)


def test_check_bottom_as_caffe():
    loss = create_layer('name: "l" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss"')
    bottoms = [torch.randn(4, 5), torch.tensor([0.0, 1, 2, 4])]
    with pytest.raises(ValueError, match="bottom 1 takes no gradient"):
        GradientChecker().check_gradient(loss, bottoms)
    assert GradientChecker().check_gradient_exhaustive(loss, bottoms, check_bottom=0).compared == 20
    ip = create_layer(IP)
    assert GradientChecker().check_gradient(ip, [torch.randn(2, 4)], check_bottom=-2).compared == 15
    assert GradientChecker().check_gradient(ip, [torch.randn(2, 4)]).compared == 15 + 8


def test_parameters_and_rng_are_left_as_they_were():
    torch.manual_seed(3)
    ip = create_layer(IP)
    tops = []
    GradientChecker().check_gradient(ip, [torch.randn(2, 4, dtype=torch.float64)], tops)
    w, x = ip.blobs[0].detach().clone(), torch.randn(2, 4, dtype=torch.float64)
    state = torch.get_rng_state()
    GradientChecker().check_gradient_single(ip, [x], tops, -1, 0, 1)
    assert ip.blobs[0].dtype == torch.float32 and torch.equal(ip.blobs[0], w)
    assert torch.equal(torch.get_rng_state(), state)
    assert [t.shape for t in tops] == [(2, 3)] and tops[0].dtype == torch.float64


def test_random_layers_are_reseeded_before_every_forward():
    drop = create_layer('name: "d" type: "Dropout" bottom: "x" top: "y"', phase=brewnet.TRAIN)
    r = GradientChecker().check_gradient_exhaustive(drop, [torch.randn(3, 4)])
    assert r.compared == 12 * 12


@pytest.mark.parametrize("dtype,step,threshold", [(torch.float32, 1e-2, 1e-3), (torch.float64, 1e-6, 1e-7)])
def test_built_in_layers_with_parameters(dtype, step, threshold):
    torch.manual_seed(4)
    g = GradientChecker(step, threshold)
    conv = create_layer('name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                        'num_output: 2 kernel_size: 2 weight_filler { type: "gaussian" std: 1 } '
                        'bias_filler { type: "gaussian" std: 1 } }')
    assert g.check_gradient_exhaustive(conv, [torch.randn(2, 2, 3, 3, dtype=dtype)]).compared == (16 + 2 + 36) * 16
    norm = create_layer('name: "n" type: "Normalize" bottom: "x" top: "y" norm_param { '
                        'across_spatial: false scale_filler { type: "constant" value: 2 } }')
    g.check_gradient_exhaustive(norm, [torch.randn(2, 3, 2, 2, dtype=dtype)])


class ParamScale(brewnet.Layer):
    """A pycaffe Python layer: y = w * x with one learnable w, backward written by hand."""

    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs[0].data[...] = 3

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[...] += (top[0].diff * bottom[0].data).sum()
        if propagate_down[0]:
            bottom[0].diff[...] = self.blobs[0].data * top[0].diff


def test_python_layers_params_and_bottoms():
    text = ('name: "p" type: "Python" bottom: "x" top: "y" python_param { module: "%s" '
            'layer: "ParamScale" }' % __name__)
    x = torch.from_numpy(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    r = GradientChecker().check_gradient_exhaustive(create_layer(text), [x])
    assert r.compared == (1 + 6) * 6
