"""Multi-view testing (brewnet.analysis.multiview, brewnet test --views/--top-k/--images): the 10
views equal 10 crops cut and forwarded by hand, top-k equals a sort reference, a deploy net fed
an image list follows pycaffe's Classifier.predict(oversample=True) on open_nsfw, and bad input
says what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

import brewnet as caffe
from brewnet.analysis.multiview import data_layer_scores, topk_hits
from brewnet.cli import main
from brewnet.data.db import open_writer
from brewnet.data.transform import chw_to_datum
from brewnet.proto.io import write_binaryproto
from helpers import SHARED, need

N, C, H, CROP, BATCH, CLASSES, SCALE = 12, 3, 10, 8, 4, 10, 0.5
LAYERS = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.02 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }""" % CLASSES


def make(tmp_path, crop=CROP, tops='top: "data" top: "label"'):
    """A Data-layer net over N random 3 x 10 x 10 images (mean file, scale, mirror on: the
    views must turn it off) and its random weights; returns (net, weights, images, labels, mean)."""
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (N, C, H, H), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, N)
    with open_writer(str(tmp_path / "db")) as w:
        for i in range(N):
            w.put(f"{i:08d}", chw_to_datum(images[i], int(labels[i])).SerializeToString())
    mean = rng.uniform(0, 255, (C, H, H)).astype(np.float32)
    write_binaryproto(tmp_path / "mean.binaryproto", mean[None])
    net = tmp_path / "net.prototxt"
    net.write_text(f"""name: "mv"
layer {{ name: "data" type: "Data" {tops}
  transform_param {{ crop_size: {crop} mirror: true scale: {SCALE} mean_file: "{tmp_path / 'mean.binaryproto'}" }}
  data_param {{ source: "{tmp_path / 'db'}" batch_size: {BATCH} backend: LMDB }} }}""" + LAYERS)
    caffe.set_random_seed(7)
    weights = tmp_path / "w.caffemodel"
    caffe.Net(str(net), caffe.TEST).save(str(weights))
    return net, weights, images, labels, mean


def by_hand(tmp_path, weights, x, starts, size):
    """The mean prob of the crops at ``starts`` and of their mirrors, cut with numpy and
    forwarded a batch (of the data layer's size: oneDNN's float32 kernels depend on the shape)
    at a time through a deploy twin of the net."""
    deploy = tmp_path / "deploy.prototxt"
    deploy.write_text(f'name: "mv" input: "data" '
                      f'input_shape {{ dim: {BATCH} dim: {C} dim: {size} dim: {size} }}' + LAYERS)
    net = caffe.Net(str(deploy), caffe.TEST, weights=str(weights))
    crops = [x[:, :, i:i + size, j:j + size] for i, j in starts]
    crops += [c[:, :, :, ::-1] for c in crops]
    return np.mean([np.concatenate([net.forward(data=np.ascontiguousarray(c[b:b + BATCH]))["prob"].copy()
                                    for b in range(0, len(x), BATCH)]).astype(np.float64)
                    for c in crops], 0)


def test_ten_views_equal_ten_crops_by_hand(tmp_path):
    net, weights, images, labels, mean = make(tmp_path)
    x = (images.astype(np.float32) - mean) * np.float32(SCALE)     # Caffe's transform, uncropped
    d = H - CROP
    starts = [(0, 0), (0, d), (d, 0), (d, d), (d // 2, d // 2)]       # corners, centre
    got = list(data_layer_scores(net, weights, 10, iterations=3))
    want = by_hand(tmp_path, weights, x, starts, CROP)
    np.testing.assert_allclose(np.concatenate([s for s, _ in got]), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.concatenate([lab for _, lab in got]), labels)
    # one view: the centre crop, not mirrored (the layer's own TEST crop)
    one = np.concatenate([s for s, _ in data_layer_scores(net, weights, 1, iterations=3)])
    ref = caffe.Net(str(tmp_path / "deploy.prototxt"), caffe.TEST, weights=str(weights))
    c = d // 2
    centre = np.ascontiguousarray(x[:, :, c:c + CROP, c:c + CROP])
    want = np.concatenate([ref.forward(data=centre[b:b + BATCH])["prob"].copy() for b in range(0, N, BATCH)])
    np.testing.assert_allclose(one, want, rtol=1e-6, atol=1e-7)


def test_pad_gives_views_of_a_net_that_does_not_crop(tmp_path):
    net, weights, images, labels, mean = make(tmp_path, crop=0)
    x = (images.astype(np.float32) - mean) * np.float32(SCALE)
    x = np.pad(x, ((0, 0), (0, 0), (2, 2), (2, 2)))                  # zeros after the transform
    starts = [(0, 0), (0, 4), (4, 0), (4, 4), (2, 2)]
    got = np.concatenate([s for s, _ in data_layer_scores(net, weights, 10, iterations=3, pad=2)])
    np.testing.assert_allclose(got, by_hand(tmp_path, weights, x, starts, H), rtol=1e-6, atol=1e-7)


def test_topk_equals_a_sort_reference():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 4, (500, 10)).astype(np.float64)        # many ties
    labels = rng.integers(0, 10, 500)
    got = topk_hits(scores, labels, [1, 5])
    for k in (1, 5):
        # ties go to the lower class index: sort by (-score, index)
        best = [sorted(range(10), key=lambda c: (-row[c], c))[:k] for row in scores]
        assert got[k] == sum(int(l in b) for l, b in zip(labels, best))
    assert topk_hits(scores, labels, [10])[10] == 500


def test_cli_top_k_equals_numpy_on_the_views(tmp_path, caplog):
    net, weights, images, labels, mean = make(tmp_path)
    scores = np.concatenate([s for s, _ in data_layer_scores(net, weights, 10, iterations=3)])
    order = np.argsort(-scores, 1, kind="stable")
    caplog.set_level("INFO", logger="brewnet")
    assert main(["test", "--model", str(net), "--weights", str(weights), "--iterations", "3",
                 "--views", "10", "--top-k", "1,5"]) == 0
    for k in (1, 5):
        want = np.mean([l in o[:k] for l, o in zip(labels, order)])
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"top-{k} = "))
        assert float(line.split("= ")[1]) == pytest.approx(want, abs=1e-6)
    assert "Batch 2, top-5 = " in caplog.text and "running mean" in caplog.text


def test_cli_errors(tmp_path, capsys):
    net, weights, *_ = make(tmp_path, crop=0)
    args = ["test", "--model", str(net), "--weights", str(weights), "--iterations", "1"]
    assert main(args + ["--views", "10"]) == 1
    err = capsys.readouterr().err
    assert "--views 10 needs crops smaller than the image" in err and "no transform_param.crop_size" in err
    assert "--pad" in err
    assert main(args + ["--top-k", "0"]) == 1
    assert "k must be at least 1" in capsys.readouterr().err
    assert main(args + ["--top-k", "11"]) == 1
    assert "only 10 classes" in capsys.readouterr().err
    assert main(args + ["--images", str(tmp_path / "list.txt")]) == 1
    assert "--images needs a deploy net" in capsys.readouterr().err
    sub = tmp_path / "nolabel"
    sub.mkdir()
    net2, weights2, *_ = make(sub, tops='top: "data"')
    args2 = ["test", "--model", str(net2), "--weights", str(weights2), "--iterations", "1"]
    for extra in (["--top-k", "1,5"], ["--views", "10", "--top-k", "5"]):
        assert main(args2 + extra) == 1
        assert "needs labels" in capsys.readouterr().err


def classifier_scores(model, weights, paths, views, mean, dims):
    """(brewnet test --images' scores, Classifier.predict's) for the image files ``paths``."""
    from argparse import Namespace

    from brewnet.tools.test import image_list_scores

    clf = caffe.Classifier(str(model), str(weights), image_dims=dims, mean=np.array(mean, float),
                           raw_scale=255, channel_swap=(2, 1, 0))
    args = Namespace(model=str(model), images=str(paths), root_folder="", batch=2, output="",
                     mean=",".join(map(str, mean)), raw_scale=255.0, input_scale=None,
                     channel_swap="2,1,0", image_dims=",".join(map(str, dims)))
    lines = [l.rsplit(" ", 1)[0] for l in paths.read_text().splitlines()]
    got = list(image_list_scores(caffe.Net(str(model), caffe.TEST, weights=str(weights)), args, views))
    assert [len(s) for s, _ in got] == [2] * (len(lines) // 2) + [1] * (len(lines) % 2)
    return got, clf.predict([caffe.io.load_image(p) for p in lines], oversample=views == 10)


def test_image_list_follows_classifier(tmp_path, capsys):
    import cv2

    rng = np.random.default_rng(4)
    lst = tmp_path / "list.txt"
    with open(lst, "w") as f:
        for k in range(3):
            cv2.imwrite(str(tmp_path / f"{k}.png"), rng.integers(0, 256, (13 + k, 11, 3), dtype=np.uint8))
            f.write(f"{tmp_path / f'{k}.png'} {k}\n")
    deploy = tmp_path / "deploy.prototxt"
    deploy.write_text(f'name: "mv" input: "data" input_shape {{ dim: 1 dim: {C} dim: {CROP} dim: {CROP} }}' + LAYERS)
    caffe.set_random_seed(2)
    weights = tmp_path / "d.caffemodel"
    caffe.Net(str(deploy), caffe.TEST).save(str(weights))
    for views in (10, 1):
        got, want = classifier_scores(deploy, weights, lst, views, [90, 100, 110], (H, H))
        np.testing.assert_allclose(np.concatenate([s for s, _ in got]), want, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.concatenate([lab for _, lab in got]), [0, 1, 2])
    args = ["test", "--model", str(deploy), "--weights", str(weights), "--images", str(lst),
            "--mean", "90,100,110", "--raw-scale", "255", "--channel-swap", "2,1,0"]
    assert main(args + ["--image-dims", f"{H},{H}", "--views", "10", "--top-k", "1,2"]) == 0
    assert main(args + ["--views", "10"]) == 1
    assert "--views 10 needs --image-dims larger than the net's 8x8 input" in capsys.readouterr().err
    lst.write_text(f"{tmp_path / 'missing.png'} 0\n")
    assert main(args) == 1
    assert f"{lst} line 1: " in capsys.readouterr().err


def test_open_nsfw_image_list_follows_classifier_oversample(tmp_path):
    """brewnet test --images --views 10 on open_nsfw gives pycaffe's Classifier.predict(oversample=True)."""
    d = need(SHARED / "caffe-models/trained/open_nsfw")
    images = sorted(need(SHARED / "caffe-models/images").glob("*.png"))
    lst = tmp_path / "list.txt"
    lst.write_text("".join(f"{p} {k % 2}\n" for k, p in enumerate(images)))
    got, want = classifier_scores(d / "deploy.prototxt", d / "resnet_50_1by2_nsfw.caffemodel", lst, 10,
                                  [104, 117, 123], (256, 256))
    np.testing.assert_allclose(np.concatenate([s for s, _ in got]), want, rtol=1e-5, atol=1e-6)


def test_image_data_layer_views(tmp_path):
    """ImageData (resized to 10 x 10, mean_value, crop 8): the views come from the resized image."""
    import cv2

    rng = np.random.default_rng(6)
    lst = tmp_path / "list.txt"
    with open(lst, "w") as f:
        for k in range(BATCH):
            cv2.imwrite(str(tmp_path / f"{k}.png"), rng.integers(0, 256, (14, 12, 3), dtype=np.uint8))
            f.write(f"{k}.png {k}\n")
    net = tmp_path / "net.prototxt"
    net.write_text(f"""name: "mv"
layer {{ name: "data" type: "ImageData" top: "data" top: "label"
  transform_param {{ crop_size: {CROP} mean_value: 100 mean_value: 110 mean_value: 120 scale: {SCALE} }}
  image_data_param {{ source: "{lst}" root_folder: "{tmp_path}/" batch_size: {BATCH}
                      new_height: {H} new_width: {H} }} }}""" + LAYERS)
    caffe.set_random_seed(8)
    weights = tmp_path / "w.caffemodel"
    caffe.Net(str(net), caffe.TEST).save(str(weights))
    imgs = np.stack([cv2.resize(cv2.imread(str(tmp_path / f"{k}.png")), (H, H), interpolation=cv2.INTER_LINEAR)
                     for k in range(BATCH)]).transpose(0, 3, 1, 2).astype(np.float32)
    x = (imgs - np.array([100, 110, 120], np.float32)[:, None, None]) * np.float32(SCALE)
    d = H - CROP
    (scores, labels), = data_layer_scores(net, weights, 10, iterations=1)
    want = by_hand(tmp_path, weights, x, [(0, 0), (0, d), (d, 0), (d, d), (d // 2, d // 2)], CROP)
    np.testing.assert_allclose(scores, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(labels, np.arange(BATCH))
