"""brewnet.video and ``brewnet video``: keyframes give the per-frame numbers exactly, copy on a
static video is per-frame, flow recovers a known shift, and bad input is named."""
from __future__ import annotations

import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch

from brewnet.net import Net, NetError
from brewnet.proto import caffe_pb2 as pb
from brewnet.video import VideoNet, change, pool_measure, read_frames, split_index, warp
from helpers import VENDORED

CLIP = VENDORED / "video" / "vtest_f100-109_192x144.avi"     # 10 frames of vtest.avi (SOURCES.txt)


def conv(name, bottom, n, k=3, stride=1, pad=1):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
            f'convolution_param {{ num_output: {n} kernel_size: {k} stride: {stride} pad: {pad} '
            f'weight_filler {{ type: "gaussian" std: 0.1 }} bias_filler {{ type: "constant" value: 0.1 }} }} }}\n')


def bn_scale(blob):
    return (f'layer {{ name: "{blob}_bn" type: "BatchNorm" bottom: "{blob}" top: "{blob}" }}\n'
            f'layer {{ name: "{blob}_sc" type: "Scale" bottom: "{blob}" top: "{blob}" '
            'scale_param { bias_term: true } }\n')


def relu(blob):
    return f'layer {{ name: "{blob}_relu" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


# A small dense net: conv-BN-Scale chains (folded in TEST) on both sides of the split "low".
NET = ('name: "tiny" layer { name: "data" type: "Input" top: "data" '
       'input_param { shape { dim: 1 dim: 3 dim: 72 dim: 96 } } }\n'
       + conv("low", "data", 8, stride=2) + bn_scale("low") + relu("low")
       + conv("mid", "low", 16, stride=2) + bn_scale("mid") + relu("mid")
       + conv("score", "mid", 5, k=1, pad=0)
       + 'layer { name: "prob" type: "Softmax" bottom: "score" top: "prob" }\n')


def tiny_net(seed=0):
    torch.manual_seed(seed)
    net = Net(NET, pb.TEST)
    with torch.no_grad():     # BatchNorm statistics that are not the identity
        for layer in net.layer_list:
            if layer.type == "BatchNorm":
                layer.blobs[0].uniform_(-0.5, 0.5)
                layer.blobs[1].uniform_(0.5, 2.0)
                layer.blobs[2].fill_(1.0)
    return net


def collect(vn, source, limit=None):
    return [(o.index, o.outputs["prob"].clone(), o.is_keyframe) for o in vn.run(source, limit)]


def per_frame(source):
    return collect(VideoNet(tiny_net(), None, keyframes="every:1", mean=(104, 117, 123)), source)


@pytest.mark.parametrize("keyframes,propagate", [("every:3", "copy"), ("every:4", "flow"),
                                                 ("adaptive:0.06", "copy"), ("adaptive:0.06", "flow")])
def test_keyframes_reproduce_the_per_frame_output_exactly(keyframes, propagate):
    base = per_frame(CLIP)
    got = collect(VideoNet(tiny_net(), "low", propagate, keyframes, max_gap=4,
                           mean=(104, 117, 123)), CLIP)
    assert [g[0] for g in got] == list(range(10)) and len(base) == 10
    keys = [i for i, _, k in got if k]
    assert keys[0] == 0 and 1 < len(keys) < 10, keys
    for (i, out, k), (_, ref, _) in zip(got, base):
        if k:
            assert torch.equal(out, ref), i
    if keyframes.startswith("every"):
        n = int(keyframes.split(":")[1])
        assert keys == list(range(0, 10, n))


def test_adaptive_measure_and_max_gap(tmp_path):
    frame = next(read_frames(CLIP))
    for k in range(7):
        cv2.imwrite(str(tmp_path / f"{k:03d}.png"), frame)
    vn = VideoNet(tiny_net(), "low", "copy", "adaptive:0.01", max_gap=3, mean=(104, 117, 123))
    got = collect(vn, tmp_path)
    assert [k for _, _, k in got] == [True, False, False, True, False, False, True]
    assert vn.changes[0] is None and vn.changes[1:] == [0.0] * 6
    # On the real clip the measure is mean|L_t - L_k| / mean|L_k| of the split blob.
    net = tiny_net()
    vn = VideoNet(net, "low", "copy", "adaptive:1e9", max_gap=100, mean=(104, 117, 123))
    frames = list(read_frames(CLIP, 3))
    lows = []
    for x in frames:
        net.blobs["data"].tensor = vn.prepare(x)[0]
        with torch.no_grad():
            net.forward_tensors(0, split_index(net, "low"))
        lows.append(net.blobs["low"].tensor.clone())
    list(vn.run(frames))
    want = [float((lows[t] - lows[0]).abs().mean() / lows[0].abs().mean()) for t in (1, 2)]
    assert vn.changes[1:] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("measure,stride,threshold", [("data", 1, 0.07), ("low", 1, 0.09),
                                                    ("data", 8, 0.03)])
def test_measure_blob(tmp_path, measure, stride, threshold):
    """--measure (-stride): the change of an earlier blob (the transformed input here) decides
    keyframes; keyframes still give the per-frame outputs exactly, and a static clip makes no
    keyframe after the first but at the max gap."""
    frame = next(read_frames(CLIP))
    for k in range(5):
        cv2.imwrite(str(tmp_path / f"{k:03d}.png"), frame)
    vn = VideoNet(tiny_net(), "mid", "copy", "adaptive:0", max_gap=10, mean=(104, 117, 123),
                  measure=measure, measure_stride=stride)
    assert [k for *_, k in collect(vn, tmp_path)] == [True] + [False] * 4
    assert vn.changes == [None] + [0.0] * 4
    base = per_frame(CLIP)
    vn = VideoNet(tiny_net(), "mid", "flow", f"adaptive:{threshold}", max_gap=4,
                  mean=(104, 117, 123), measure=measure, measure_stride=stride)
    got = collect(vn, CLIP)
    keys = [i for i, _, k in got if k]
    assert keys[0] == 0 and 1 < len(keys) < 10, keys
    for (i, out, k), (_, ref, _) in zip(got, base):
        if k:
            assert torch.equal(out, ref), i
    frames = list(read_frames(CLIP, 2))
    if measure == "data":                         # the measure is the transformed frame itself
        x0, x1 = (vn.prepare(f)[0] for f in frames)
        list(vn.run(frames))
        x0, x1 = (pool_measure(x, stride) for x in (x0, x1))
        assert vn.changes[1] == pytest.approx(change(x1, x0), rel=1e-6)


def test_pool_measure_averages_cells_and_keeps_partial_ones():
    t = torch.arange(25, dtype=torch.float32).reshape(1, 1, 5, 5)
    p = pool_measure(t, 4)
    assert p.shape == (1, 1, 2, 2)
    assert p[0, 0, 0, 0] == t[0, 0, :4, :4].mean() and p[0, 0, 1, 1] == t[0, 0, 4, 4]
    assert p[0, 0, 0, 1] == t[0, 0, :4, 4].mean()
    assert pool_measure(t, 1) is t


def test_measure_errors():
    with pytest.raises(NetError, match=r"--measure: no blob 'nope' in net 'tiny'; its blobs are: "
                                       r"data, low, mid, score, prob"):
        VideoNet(tiny_net(), "low", keyframes="adaptive:0.1", measure="nope")
    with pytest.raises(NetError, match=r"--measure 'mid' is made by layer 'mid_relu', after the "
                                       r"split 'low'"):
        VideoNet(tiny_net(), "low", keyframes="adaptive:0.1", measure="mid")


def test_copy_on_a_static_video_equals_per_frame(tmp_path):
    frame = next(read_frames(CLIP))
    for k in range(6):
        cv2.imwrite(str(tmp_path / f"f{k}.png"), frame)
    base = per_frame(tmp_path)
    for prop in ("copy", "flow"):
        got = collect(VideoNet(tiny_net(), "low", prop, "every:6", mean=(104, 117, 123)), tmp_path)
        assert sum(k for *_, k in got) == 1
        for (_, out, _), (_, ref, _) in zip(got, base):
            # flow: DIS on two equal frames is ~0 but not exactly 0, and sampling at a
            # displacement of ~1e-3 pixel moves a value by that much of its neighbour's difference
            assert torch.equal(out, ref) if prop == "copy" else torch.allclose(out, ref, atol=1e-3)


def test_warp_convention_integer_and_half_cell_shifts():
    f = torch.arange(4 * 6, dtype=torch.float32).reshape(1, 1, 4, 6)
    flow = np.zeros((16, 24, 2), np.float32)      # frame 16 x 24, map 4 x 6: 4 pixels a cell
    flow[..., 0] = 8.0                            # cur(p) = key(p + 2 cells to the right)
    w = warp(f, flow)
    assert torch.equal(w[..., :4], f[..., 2:])
    assert torch.equal(w[..., 4:], f[..., 5:].expand(1, 1, 4, 2))   # border value outside
    flow[..., 0], flow[..., 1] = 0.0, 2.0         # half a cell down: the mean of two rows
    w = warp(f, flow)
    assert torch.allclose(w[:, :, :3], (f[:, :, :3] + f[:, :, 1:]) / 2)


def test_flow_recovers_a_synthetic_shift():
    """A textured frame and the same frame shifted right by k pixels: the keyframe's outputs
    warped by DIS flow match the per-frame outputs of the shifted frame, within interpolation
    error, far closer than copying them."""
    rng = np.random.default_rng(0)
    big = cv2.GaussianBlur(rng.integers(0, 256, (96, 140, 3), dtype=np.uint8), (0, 0), 2.0)
    big = cv2.normalize(big, None, 0, 255, cv2.NORM_MINMAX)
    k = 8                                        # two cells of the stride-4 output
    key, cur = big[12:84, 20:116], big[12:84, 20 - k:116 - k]     # cur(x) = key(x - k)
    base = per_frame([key, cur])
    for prop in ("copy", "flow"):
        got = collect(VideoNet(tiny_net(), "low", prop, "every:2", mean=(104, 117, 123)), [key, cur])
        assert [g[2] for g in got] == [True, False]
        err = (got[1][1] - base[1][1])[..., 2:-2, 4:-2].abs().mean().item()   # interior
        if prop == "copy":
            copy_err = err
        else:
            flow_err = err
    assert flow_err < 0.2 * copy_err, (flow_err, copy_err)
    assert flow_err < 0.01


def skip_net():
    text = ('name: "skip" layer { name: "data" type: "Input" top: "data" '
            'input_param { shape { dim: 1 dim: 3 dim: 16 dim: 16 } } }\n'
            + conv("c1", "data", 4) + conv("c2", "c1", 4)
            + 'layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }\n'
            + conv("c3", "sum", 2))
    return Net(text, pb.TEST)


def test_split_errors():
    net = skip_net()
    with pytest.raises(NetError, match=r"no blob 'nope'.*its blobs are: data, c1, c2, sum, c3"):
        split_index(net, "nope")
    with pytest.raises(NetError, match=r"layer 'sum' \(after the split\) reads 'c1', made by layer 'c1'"):
        split_index(net, "c2")
    assert split_index(net, "sum") == 3 and split_index(net, "c1") == 1
    with pytest.raises(NetError, match="made by the last layer"):
        split_index(net, "c3")
    assert split_index(tiny_net(), "low") == 4       # after the in-place BatchNorm, Scale, ReLU


def test_bad_sources(tmp_path):
    bad = tmp_path / "not_a_video.avi"
    bad.write_bytes(b"this is not a video" * 10)
    with pytest.raises(ValueError, match=r"not_a_video\.avi: OpenCV cannot open this video"):
        next(read_frames(bad))
    with pytest.raises(FileNotFoundError, match=r"missing\.avi: no such video file"):
        next(read_frames(tmp_path / "missing.avi"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no frames here")
    with pytest.raises(ValueError, match=r"empty: the frames folder holds no image"):
        next(read_frames(tmp_path / "empty"))
    with pytest.raises(ValueError, match="expected every:N"):
        VideoNet(tiny_net(), "low", keyframes="every:0")


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "brewnet.cli", "video", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def test_cli_writes_outputs_keyframes_and_annotated_video(tmp_path):
    model = tmp_path / "tiny.prototxt"
    model.write_text(NET)
    tiny_net().save(tmp_path / "tiny.caffemodel")
    r = _cli("--model", model, "--weights", tmp_path / "tiny.caffemodel", "--input", CLIP,
             "--split", "low", "--out", tmp_path / "out.npy", "--keyframes", "every:4",
             "--propagate", "flow", "--mean", "104,117,123", "--annotate", tmp_path / "look.avi")
    assert r.returncode == 0, r.stderr
    prob, keys = np.load(tmp_path / "out.npy"), np.load(tmp_path / "out_keyframes.npy")
    assert prob.shape == (10, 5, 18, 24) and keys.tolist() == [k % 4 == 0 for k in range(10)]
    base = per_frame(CLIP)
    # The command runs in its own process on the thread count it chooses (brewnet.threads);
    # this one may run on another, and a convolution sums in another order there (~1e-7).
    for i in (0, 4, 8):
        np.testing.assert_allclose(prob[i], base[i][1][0].numpy(), rtol=1e-6, atol=1e-9)
    assert sum(1 for _ in read_frames(tmp_path / "look.avi")) == 10
    assert "10 frames (3 keyframes)" in r.stderr
    r = _cli("--model", model, "--weights", tmp_path / "tiny.caffemodel", "--input", CLIP,
             "--split", "low", "--out", tmp_path / "o.h5", "--keyframes", "adaptive:0.05",
             "--annotate", tmp_path / "pngs", "--frames", "5", "--size", "64x48")
    assert r.returncode == 0, r.stderr
    import h5py

    with h5py.File(tmp_path / "o.h5") as f:
        assert f["prob"].shape == (5, 5, 12, 16) and f["keyframe"].shape == (5,)
    assert len(list((tmp_path / "pngs").glob("frame_*.png"))) == 5


@pytest.mark.parametrize("change,message", [
    (("--input", "{tmp}/nothing.avi"), "nothing.avi: no such video file"),
    (("--split", "nope"), "no blob 'nope' in net 'tiny'; its blobs are: data, low, mid, score, prob"),
    (("--input", "{tmp}"), ": the frames folder holds no image"),
    (("--keyframes", "sometimes"), "--keyframes 'sometimes'"),
    (("--measure", "nope", "--keyframes", "adaptive:0.1"),
     "--measure: no blob 'nope' in net 'tiny'; its blobs are: data, low"),
    (("--measure-stride", "0"), "--measure-stride 0: expected an integer >= 1"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, change, message):
    from brewnet.cli import main

    model = tmp_path / "tiny.prototxt"
    model.write_text(NET)
    tiny_net().save(tmp_path / "w.caffemodel")
    args = {"--model": model, "--weights": tmp_path / "w.caffemodel", "--input": CLIP,
            "--split": "low", "--out": tmp_path / "o.npy"}
    args.update({k: v.format(tmp=tmp_path / "frames") for k, v in zip(change[::2], change[1::2])})
    (tmp_path / "frames").mkdir()
    assert main(["video", *[str(x) for kv in args.items() for x in kv]]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err
