"""SegNet's DenseImageData against the fork's rules (alexgkendall/caffe-segnet 344c113:
src/caffe/layers/dense_image_data_layer.cpp, util/io.cpp ReadImageToCVMat, data_transformer.cpp
Transform with preserve_pixel_vals): PNG images and label images written here, read back with
OpenCV as the fork reads them; the fork's field number 138 in binary files; the corpus' two
SegNet nets that read an image list build and run on a tiny list made here."""
from __future__ import annotations

import re
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import brewnet
from brewnet.layers import LayerError
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto import upgrade_net
from helpers import make_layer
from test_proto_forks import _layer_with

ROOT = Path(__file__).resolve().parents[1]
NETS = ROOT / "benchmarks" / "zoo" / "nets"


def _pairs(folder, sizes, seed=0):
    """Random BGR images and label images (values 0..10) of ``sizes`` as PNGs in ``folder``."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (h, w) in enumerate(sizes):
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        lab = rng.integers(0, 11, (h, w), dtype=np.uint8)
        cv2.imwrite(str(folder / f"img{i}.png"), img)
        cv2.imwrite(str(folder / f"lab{i}.png"), lab)
        out.append((img, lab))
    return out


def _layer(folder, params, transform="", phase=pb.TEST, text=None):
    lst = folder / "list.txt"
    if text is not None:
        lst.write_text(text)
    return make_layer(f'name: "data" type: "DenseImageData" top: "data" top: "label" '
                      f'dense_image_data_param {{ source: "{lst}" root_folder: "{folder}/" {params} }} '
                      f'transform_param {{ {transform} }}', [], phase)


def test_reads_pairs_as_tokens_and_wraps(tmp_path):
    pairs = _pairs(tmp_path, [(12, 16)] * 3)
    # operator>> pairs tokens across lines: "img0 lab0 img1" / "lab1" / "img2 lab2"
    layer, tops = _layer(tmp_path, "batch_size: 2", text="img0.png lab0.png img1.png\nlab1.png\n\nimg2.png  lab2.png\n")
    assert tops == [(2, 3, 12, 16), (2, 1, 12, 16)]
    seen = []
    for _ in range(3):          # 6 items: 0 1 2 0 1 2 (wraps to the first pair)
        data, label = (t.numpy() for t in layer.forward([]))
        assert data.dtype == np.float32 and label.dtype == np.float32
        seen += list(zip(data, label))
    for k, (d, lab) in enumerate(seen):
        img, want = pairs[k % 3]
        np.testing.assert_array_equal(d, img.transpose(2, 0, 1))
        np.testing.assert_array_equal(lab[0], want)     # pixel values kept


def test_resize_bilinear_image_nearest_label_and_gray(tmp_path):
    (img, lab), = _pairs(tmp_path, [(20, 30)])
    layer, tops = _layer(tmp_path, "batch_size: 1 new_height: 9 new_width: 13", text="img0.png lab0.png\n")
    assert tops == [(1, 3, 9, 13), (1, 1, 9, 13)]
    data, label = (t.numpy()[0] for t in layer.forward([]))
    np.testing.assert_array_equal(data, cv2.resize(img, (13, 9), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1))
    np.testing.assert_array_equal(label[0], cv2.resize(lab, (13, 9), interpolation=cv2.INTER_NEAREST))
    assert set(np.unique(label)) <= set(np.unique(lab))     # nearest: no label value is invented
    layer, tops = _layer(tmp_path, "batch_size: 1 is_color: false")
    assert tops == [(1, 1, 20, 30), (1, 1, 20, 30)]
    gray = cv2.imread(str(tmp_path / "img0.png"), cv2.IMREAD_GRAYSCALE)
    np.testing.assert_array_equal(layer.forward([])[0].numpy()[0, 0], gray)


def test_mean_and_scale_apply_to_the_data_only(tmp_path):
    (img, lab), = _pairs(tmp_path, [(6, 7)])
    layer, _ = _layer(tmp_path, "batch_size: 1", "scale: 0.5 mean_value: 104 mean_value: 117 mean_value: 123",
                      text="img0.png lab0.png\n")
    data, label = (t.numpy()[0] for t in layer.forward([]))
    mean = np.array([104, 117, 123], np.float32).reshape(3, 1, 1)
    np.testing.assert_array_equal(data, (img.transpose(2, 0, 1).astype(np.float32) - mean) * np.float32(0.5))
    np.testing.assert_array_equal(label[0], lab)


@pytest.mark.parametrize("phase", [pb.TRAIN, pb.TEST])
def test_mirror_and_crop_move_image_and_label_together(tmp_path, phase):
    (img, lab), = _pairs(tmp_path, [(10, 12)])
    torch.manual_seed(5)
    layer, tops = _layer(tmp_path, "batch_size: 4 mirror: true crop_height: 5 crop_width: 7", phase=phase,
                         text="img0.png lab0.png\n")
    assert tops == [(4, 3, 5, 7), (4, 1, 5, 7)]
    found = set()
    for _ in range(6):
        data, label = (t.numpy() for t in layer.forward([]))
        for d, lb in zip(data, label):
            # the item is one window of the (flipped or not) pair, the same one in both
            hits = [(f, a, b) for f in (0, 1) for a in range(6) for b in range(6)
                    if np.array_equal(d, (img[:, ::-1] if f else img)[a:a + 5, b:b + 7].transpose(2, 0, 1))]
            assert len(hits) == 1
            f, a, b = hits[0]
            np.testing.assert_array_equal(lb[0], (lab[:, ::-1] if f else lab)[a:a + 5, b:b + 7])
            found.add(hits[0])
    # random in either phase, as the fork draws them (caffe_rng_rand) whatever the phase
    assert {f for f, _, _ in found} == {0, 1} and len(found) > 6


def test_batch_one_reshapes_per_image_larger_batches_do_not(tmp_path):
    _pairs(tmp_path, [(8, 10), (6, 9)])
    layer, tops = _layer(tmp_path, "batch_size: 1", text="img0.png lab0.png img1.png lab1.png\n")
    assert tops == [(1, 3, 8, 10), (1, 1, 8, 10)]
    assert [tuple(t.shape) for t in layer.forward([])] == [(1, 3, 8, 10), (1, 1, 8, 10)]
    assert [tuple(t.shape) for t in layer.forward([])] == [(1, 3, 6, 9), (1, 1, 6, 9)]
    layer, _ = _layer(tmp_path, "batch_size: 2")
    with pytest.raises(LayerError, match=r"list.txt line 1: image img1.png gives \(3, 6, 9\), "
                                         r"the batch's blob is \(3, 8, 10\)"):
        layer.forward([])
    layer, tops = _layer(tmp_path, "batch_size: 1 new_height: 4 new_width: 5")     # resize: fixed
    assert [tuple(t.shape) for t in layer.forward([]) + layer.forward([])] == [(1, 3, 4, 5), (1, 1, 4, 5)] * 2


def test_shuffle_and_rand_skip(tmp_path):
    pairs = _pairs(tmp_path, [(4, 4)] * 5)
    text = "".join(f"img{i}.png lab{i}.png\n" for i in range(5))
    torch.manual_seed(0)
    layer, _ = _layer(tmp_path, "batch_size: 5 shuffle: true", text=text)
    index = {p[1].tobytes(): i for i, p in enumerate(pairs)}
    orders = []
    for _ in range(4):
        data, label = (t.numpy() for t in layer.forward([]))
        order = [index[lb[0].astype(np.uint8).tobytes()] for lb in label]
        for d, i in zip(data, order):       # the image stays with its label image
            np.testing.assert_array_equal(d, pairs[i][0].transpose(2, 0, 1))
        orders.append(tuple(order))
    assert all(sorted(o) == list(range(5)) for o in orders) and len(set(orders)) > 1
    layer, _ = _layer(tmp_path, "batch_size: 1 rand_skip: 5")
    assert layer.forward([])[1].numpy().shape == (1, 1, 4, 4)


def test_errors_name_layer_and_line(tmp_path):
    _pairs(tmp_path, [(8, 10)])
    cv2.imwrite(str(tmp_path / "small.png"), np.zeros((4, 10), np.uint8))
    with pytest.raises(LayerError, match=r"Layer 'data' \(type DenseImageData\): .*list.txt line 2: input and label "
                                         r"image heights and widths must match: .*8x10, .*4x10"):
        _layer(tmp_path, "batch_size: 1", text="\nimg0.png small.png\n")
    with pytest.raises(LayerError, match=r"list.txt line 3: image 'img0.png' has no label image"):
        _layer(tmp_path, "batch_size: 1", text="img0.png lab0.png\n\nimg0.png\n")
    with pytest.raises(LayerError, match="transform_param mirror and crop_size would move the image and not its label"):
        _layer(tmp_path, "batch_size: 1", "mirror: true", text="img0.png lab0.png\n")
    with pytest.raises(LayerError, match="crop_height and crop_width must be set together"):
        _layer(tmp_path, "batch_size: 1 crop_height: 4")
    with pytest.raises(LayerError, match=r"crop_height x crop_width 9x4 is larger than the 8x10 image"):
        _layer(tmp_path, "batch_size: 1 crop_height: 9 crop_width: 4")[0].forward([])
    with pytest.raises(LayerError, match="list.txt line 1: could not open or find file .*nope.png"):
        _layer(tmp_path, "batch_size: 1", text="img0.png nope.png\n")


def test_the_forks_field_number_in_binary_files():
    # caffe-segnet's LayerParameter has dense_image_data_param at 138, brewnet's tile_param.
    p = pb.DenseImageDataParameter(source="/data/train.txt", batch_size=4, shuffle=True, mirror=True,
                                   crop_height=224, crop_width=320, root_folder="/data/")
    net = pb.NetParameter()
    net.layer.append(_layer_with("data", "DenseImageData", 138, p.SerializeToString()))
    layer = upgrade_net(net).layer[0]
    assert layer.dense_image_data_param == p and not layer.HasField("tile_param")


def _net_on_a_tiny_list(name, folder, h, w):
    pairs = _pairs(folder, [(h, w)])
    (folder / "list.txt").write_text("img0.png lab0.png\n")
    text = (NETS / f"{name}.prototxt").read_text()
    text, n = re.subn(r'source: "[^"]*"', f'source: "{folder}/list.txt" root_folder: "{folder}/"', text)
    assert n == 1
    text = re.sub(r"(dense_image_data_param \{[^}]*batch_size:) \d+", r"\1 1", text)
    return brewnet.Net(text, brewnet.TEST, engine="eager"), pairs[0]


@pytest.mark.parametrize("name, h, w, classes", [("segnet_basic", 40, 64, 11), ("bayesian_segnet", 360, 480, 11)])
def test_corpus_segnet_nets_build_and_run(tmp_path, name, h, w, classes):
    net, (img, lab) = _net_on_a_tiny_list(name, tmp_path, h, w)
    out = net.forward()
    assert net.blobs["data"].shape == (1, 3, h, w) and net.blobs["label"].shape == (1, 1, h, w)
    np.testing.assert_array_equal(net.blobs["label"].data[0, 0], lab)
    np.testing.assert_array_equal(net.blobs["data"].data[0], img.transpose(2, 0, 1))
    prob = out["prob"].copy()
    assert prob.shape == (1, classes, h, w)
    np.testing.assert_allclose(prob.sum(1), 1, rtol=1e-5)
    if name == "bayesian_segnet":   # sample_weights_test: the dropout masks are drawn at TEST too
        assert net.layer_list[net.layer_index("encdrop3")].param.dropout_param.sample_weights_test
        assert not np.array_equal(net.forward()["prob"], prob)
