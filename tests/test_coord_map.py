"""pycaffe's coord_map (after python/caffe/test/test_coord_map.py): maps through conv, pool,
deconv and crop; padding; anisotropic and N-D kernels; the crop() helper and its errors."""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from brewnet import layers as L
from brewnet import params as P
from brewnet.pycaffe.coord_map import coord_map_from_to, crop


def spec(ks=3, stride=1, pad=0, pool=2, dstride=2, dpad=0):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 100, 100]))
    n.aux = L.Input(shape=dict(dim=[2, 1, 20, 20]))
    n.conv = L.Convolution(n.data, num_output=10, kernel_size=ks, stride=stride, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=pool, stride=pool, pad=0)
    dks = [s * 2 for s in dstride] if isinstance(dstride, list) else dstride * 2
    n.deconv = L.Deconvolution(n.pool, num_output=10, kernel_size=dks, stride=dstride, pad=dpad)
    return n


def test_conv_pool_deconv():
    n = spec()
    assert coord_map_from_to(n.deconv, n.data) == (1, 1, 0)          # 2x pool, 2x deconv
    n = spec(pool=4, dstride=4)
    assert coord_map_from_to(n.deconv, n.data) == (1, 1, -1)         # 4x: shifted by one


def test_pass_through_and_1x1():
    n = spec()
    ref = coord_map_from_to(n.deconv, n.data)
    n.relu = L.ReLU(n.deconv)
    n.conv1x1 = L.Convolution(n.relu, num_output=10, kernel_size=1, stride=1, pad=0)
    for top in (n.relu, n.conv1x1):
        assert coord_map_from_to(top, n.data) == ref


@pytest.mark.parametrize("pad", [1, 7])
def test_padding(pad):
    _, a, b = coord_map_from_to(*_pair(spec()))
    _, a1, b1 = coord_map_from_to(*_pair(spec(pad=pad)))
    assert (a1, b1) == (a, b - pad)                                   # conv pad adds an offset
    _, a2, b2 = coord_map_from_to(*_pair(spec(dpad=pad)))
    assert (a2, b2) == (a, b + pad)                                   # deconv pad takes it away
    _, a3, b3 = coord_map_from_to(*_pair(spec(pad=pad, dpad=pad)))
    assert (a3, b3) == (a, b)


def _pair(n):
    return n.deconv, n.data


def test_multi_bottom_conv():
    n = spec()
    n.conv_data, n.conv_aux = L.Convolution(n.data, n.aux, ntop=2, num_output=10, kernel_size=5,
                                            stride=2, pad=0)
    assert coord_map_from_to(n.conv_data, n.data) == coord_map_from_to(n.conv_aux, n.aux)


def test_rectangular_is_its_isotropic_parts():
    m33 = coord_map_from_to(*_pair(spec(ks=3, stride=1, pad=0)))
    m55 = coord_map_from_to(*_pair(spec(ks=5, stride=2, pad=10)))
    m35 = coord_map_from_to(*_pair(spec(ks=[3, 5], stride=[1, 2], pad=[0, 10])))
    assert m33[0] == m55[0] == m35[0]
    assert (m33[1], m33[2]) == (m35[1][0], m35[2][0])
    assert (m55[1], m55[2]) == (m35[1][1], m35[2][1])


def test_nd_conv():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 100, 100, 100]))
    n.conv = L.Convolution(n.data, num_output=10, kernel_size=[3, 3, 3], stride=[1, 1, 1], pad=[0, 1, 2])
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2, pad=0)
    n.deconv = L.Deconvolution(n.pool, num_output=10, kernel_size=4, stride=2, pad=0)
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    assert ax == 1 and len(a) == len(b) == 3 and np.all(a == 1)
    assert b[0] - 1 == b[1] and b[1] - 1 == b[2]


def test_crop_of_crop_moves_the_offset():
    n = spec()
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    n.crop = L.Crop(n.deconv, n.data, axis=2, offset=4)
    assert coord_map_from_to(n.crop, n.data) == (ax, a, b + 4)


def test_crop_helper_builds_a_net_with_aligned_shapes():
    # As FCN writes it (Deconvolution's params live in convolution_param, as in pycaffe).
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 100, 100]))
    n.conv = L.Convolution(n.data, num_output=10, kernel_size=3, stride=1, pad=5)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2, pad=0)
    n.deconv = L.Deconvolution(n.pool, convolution_param=dict(num_output=10, kernel_size=4, stride=2))
    n.crop = crop(n.deconv, n.data)          # conv pad 5: the deconv output is 10 px larger
    net = caffe.Net(n.to_proto(), caffe.TEST)
    lp = [l for l in net.param.layer if l.type == "Crop"][0]
    assert lp.crop_param.axis == 2 and list(lp.crop_param.offset) == [5]
    assert net.blobs["crop"].shape[2:] == net.blobs["data"].shape[2:]


def test_errors():
    n = spec()
    n.ip = L.InnerProduct(n.deconv, num_output=10)
    with pytest.raises(RuntimeError, match="connected by spatial layers"):
        coord_map_from_to(n.ip, n.data)
    with pytest.raises(AssertionError, match="scale mismatch"):
        crop(*_pair(spec(pool=3, dstride=2)))
    with pytest.raises(AssertionError, match="negative offset"):
        crop(*_pair(spec(dpad=10)))
