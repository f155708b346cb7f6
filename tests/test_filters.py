"""brewnet filters (owl's FilterVisualizer, fixed): each channel's 9 strongest patches from 9
different images equal a brute-force search, cut at the unit's receptive field (the whole input
for an InnerProduct blob); the heaps never hold more than 9."""
from __future__ import annotations

import numpy as np

import brewnet as caffe
from brewnet.analysis.filters import TOP, scan
from brewnet.analysis.heatmap import undo_transform
from brewnet.cli import main
from test_extract import N_IMAGES, model  # noqa: F401


def brute_force(net_file, weights, blob):
    net = caffe.Net(str(net_file), caffe.TEST, weights=str(weights))
    imgs, acts = [], []
    while len(imgs) < N_IMAGES:
        net.forward()
        imgs += [undo_transform(x, net.layer_list[0].param.transform_param) for x in net.blobs["data"].data]
        acts += list(net.blobs[blob].data.copy())
    return imgs, np.stack(acts)


def test_top9_equals_brute_force_with_patches_at_the_field(model):
    net_file, weights = model
    imgs, acts = brute_force(net_file, weights, "conv")
    top = scan(caffe.Net(str(net_file), caffe.TEST, weights=str(weights)), "conv", N_IMAGES)
    assert top.seen == N_IMAGES and all(len(h) <= TOP for h in top.heaps)
    for c in range(acts.shape[1]):
        flat = acts[:, c].reshape(N_IMAGES, -1)
        order = sorted(range(N_IMAGES), key=lambda n: (-flat[n].max(), n))[:TOP]
        best = top.best(c)
        assert [b[1] for b in best] == order                 # 9 different images, strongest first
        np.testing.assert_allclose([b[0] for b in best], flat[order].max(1), rtol=1e-6)
        for value, n, patch in best:
            i, j = divmod(int(flat[n].argmax()), acts.shape[3])
            # conv 3x3, stride 1, no pad on the input: unit (i, j) sees rows i..i+2, cols j..j+2
            np.testing.assert_array_equal(patch, imgs[n][i:i + 3, j:j + 3])


def test_inner_product_units_see_the_whole_image(model):
    net_file, weights = model
    imgs, acts = brute_force(net_file, weights, "ip")
    top = scan(caffe.Net(str(net_file), caffe.TEST, weights=str(weights)), "ip", N_IMAGES)
    for c in range(acts.shape[1]):
        value, n, patch = top.best(c)[0]
        assert n == int(acts[:, c].argmax())
        np.testing.assert_array_equal(patch, imgs[n])


def test_cli_grids_and_errors(model, tmp_path, capsys):
    net_file, weights = model
    out = tmp_path / "filters"
    assert main(["filters", "--model", str(net_file), "--weights", str(weights), "--blob", "conv",
                 "--images", str(N_IMAGES), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["conv_0000.png", "conv_0001.png", "conv_0002.png",
                                                    "conv_overview.png"]
    deploy = tmp_path / "deploy.prototxt"
    deploy.write_text('layer { name: "in" type: "Input" top: "data" '
                      'input_param { shape { dim: 1 dim: 1 dim: 8 dim: 8 } } }\n'
                      'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
                      'convolution_param { num_output: 3 kernel_size: 3 } }')
    assert main(["filters", "--model", str(deploy), "--weights", str(weights), "--blob", "conv",
                 "--out", str(out)]) == 1
    assert "needs a data layer" in capsys.readouterr().err
