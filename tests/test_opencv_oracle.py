"""brewnet's forward against OpenCV's dnn Caffe importer, an independent implementation.

Each row of ``opencv_cases.UNIT_CASES`` builds a small net (one layer, sometimes a short chain),
fills its params from a seeded generator, runs brewnet, writes the weights with ``Net.save`` and
runs the same prototxt and .caffemodel through ``cv2.dnn.readNetFromCaffe``. The model rows run
whole deploy nets from ../shared/caffe-models with random weights the same way.

OpenCV departs from Caffe in a few places; those configurations are not drawn (opencv_cases.py
says where and which Caffe fact decides). Nothing is loosened to let a row pass.

Tolerances (max |brewnet - OpenCV| <= tol * max(1, max |OpenCV|); both sides float32):
- ATOL_ELEMENTWISE (2e-6): copies, max, elementwise math; a few float32 ulps (exp/log/pow differ
  in the last bits between libm and torch).
- ATOL_REDUCE (2e-5): sums of up to ~1000 products (conv, deconv, inner product, LRN, MVN,
  softmax, normalize, BatchNorm+Scale); the summation order differs (GEMM vs oneDNN/Winograd).
- ATOL_MODEL (2e-4): whole nets of 20-150 layers; the rounding of every layer compounds.
"""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import brewnet as caffe
from brewnet.proto import caffe_pb2 as pb
from helpers import MODELS, need
from opencv_cases import UNIT_CASES, fold_cases, seed_of

cv2 = pytest.importorskip("cv2")

ATOL_MODEL = 2e-4


# -- running one net on both sides ------------------------------------------------------------
def net_text(case):
    head = 'name: "oracle"\n'
    for name, shape in case.inputs.items():
        dims = " ".join(f"dim: {d}" for d in shape)
        head += f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param {{ shape {{ {dims} }} }} }}\n'
    return head + case.layers


def make_input(kind, shape, rng):
    if kind == "large":
        return rng.standard_normal(shape).astype(np.float32) * np.float32(40)
    if kind == "unit":
        return rng.uniform(0.0, 1.0, shape).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    return np.abs(x) + np.float32(0.1) if kind == "positive" else x


def fill_params(net, rng, fill=None):
    """Standard normal for every param, then the row's own rule (e.g. positive variances)."""
    types = {l.name: l.type for l in net.layer_list}
    for name, blobs in net.params.items():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.data.shape).astype(np.float32)
        if fill is not None:
            fill(types[name], blobs, rng)


def producers(text):
    """blob name -> (layer name, top index) of its last producer (OpenCV retrieves by layer)."""
    p = text_format.Parse(text, pb.NetParameter())
    out = {}
    for lp in p.layer:
        for i, t in enumerate(lp.top):
            out[t] = (lp.name, i)
    return out


def opencv_forward(proto_path, model_path, inputs, outputs, where):
    """Run OpenCV; ``where`` is ``producers`` of the prototxt text."""
    cv = cv2.dnn.readNetFromCaffe(str(proto_path), str(model_path))
    cv.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    cv.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
    for name, x in inputs.items():
        cv.setInput(x, name)
    names = sorted({where[o][0] for o in outputs})
    by_layer = dict(zip(names, cv.forwardAndRetrieve(names)))
    return {o: np.asarray(by_layer[where[o][0]][where[o][1]]) for o in outputs}


def compare(ours, theirs, tol, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    if ours.ndim == 1 and theirs.shape == (len(ours), 1):
        theirs = theirs[:, 0]   # an OpenCV Mat has at least two axes; Caffe's top here has one
    assert ours.shape == theirs.shape, f"{what}: brewnet shape {ours.shape}, OpenCV {theirs.shape}"
    assert np.isfinite(ours).all() and np.isfinite(theirs).all(), f"{what}: non-finite values"
    scale = max(1.0, float(np.abs(theirs).max(initial=0)))
    err = float(np.abs(ours.astype(np.float64) - theirs).max(initial=0))
    assert err <= tol * scale, f"{what}: max |brewnet - OpenCV| = {err:.3g} > {tol:.1g} * {scale:.3g}"


def compare_detections(ours, theirs, tol, what):
    """Caffe's DetectionOutput writes each image's rows by label ascending (a std::map), each
    label's rows by score; OpenCV sorts each image's rows by score alone and pads the blob to
    keep_top_k rows with zeros. Same detections, different layout: check brewnet keeps Caffe's
    order, then compare with OpenCV's rows put into that order."""
    ours = np.asarray(ours).reshape(-1, 7)
    theirs = np.asarray(theirs).reshape(-1, 7)
    n = len(ours)
    assert len(theirs) >= n, f"{what}: brewnet has {n} rows, OpenCV {len(theirs)}"
    assert not theirs[n:].any(), f"{what}: OpenCV found detections beyond brewnet's {n}"
    order = np.lexsort((-ours[:, 2], ours[:, 1], ours[:, 0]))
    np.testing.assert_array_equal(order, np.arange(n), err_msg=f"{what}: not in Caffe's order")
    theirs = theirs[:n][np.lexsort((-theirs[:n, 2], theirs[:n, 1], theirs[:n, 0]))]
    compare(ours, theirs, tol, what)


def run_case(case, tmp_path):
    text = net_text(case)
    rng = np.random.default_rng(seed_of(case.id))
    net = caffe.Net(text, caffe.TEST)
    fill_params(net, rng, case.fill)
    kind = case.data if isinstance(case.data, dict) else dict.fromkeys(case.inputs, case.data)
    inputs = {n: make_input(kind.get(n, "normal"), s, rng) for n, s in case.inputs.items()}
    net.forward(**inputs)
    ours = {o: net.blobs[o].data.copy() for o in case.outputs}
    proto, model = tmp_path / "net.prototxt", tmp_path / "net.caffemodel"
    proto.write_text(text)
    net.save(str(model))
    theirs = opencv_forward(proto, model, inputs, case.outputs, producers(text))
    for o in case.outputs:
        check = compare_detections if o in case.detections else compare
        check(ours[o], theirs[o], case.tol, f"{case.id} top '{o}'")


@pytest.mark.parametrize("case", UNIT_CASES, ids=repr)
def test_layer_matches_opencv(case, tmp_path):
    run_case(case, tmp_path)


@pytest.mark.parametrize("case", fold_cases()[:4], ids=repr)
def test_folded_chain_follows_param_edits(case, tmp_path):
    """brewnet folds Convolution -> BatchNorm -> Scale at inference and caches the fold; edits
    to the params after a forward (pycaffe style, in place) must reach the next forward."""
    text = net_text(case)
    rng = np.random.default_rng(seed_of(case.id + "edit"))
    net = caffe.Net(text, caffe.TEST)
    fill_params(net, rng, case.fill)
    x = rng.standard_normal(case.inputs["x"]).astype(np.float32)
    net.forward(x=x)
    fill_params(net, rng, case.fill)
    net.params["bn"][1].data[...] *= 3
    net.params["sc"][0].data[0] = 5.0
    net.forward(x=x)
    proto, model = tmp_path / "net.prototxt", tmp_path / "net.caffemodel"
    proto.write_text(text)
    net.save(str(model))
    (out,) = case.outputs
    theirs = opencv_forward(proto, model, {"x": x}, [out], producers(text))
    compare(net.blobs[out].data, theirs[out], case.tol, case.id)


def test_generators_cover_the_brief():
    """The table keeps its breadth when generators are edited."""
    types = set()
    for c in UNIT_CASES:
        types |= {l.type for l in text_format.Parse(net_text(c), pb.NetParameter()).layer}
    want = {"Convolution", "Deconvolution", "Pooling", "LRN", "InnerProduct", "Softmax", "ReLU", "PReLU",
            "ELU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Power", "Exp", "Log", "Eltwise", "Concat", "Slice",
            "Crop", "Flatten", "Reshape", "Permute", "Normalize", "PriorBox", "BatchNorm", "Scale", "MVN",
            "Dropout", "DetectionOutput"}
    assert want <= types, want - types
    assert len(UNIT_CASES) >= 150
    ids = [c.id for c in UNIT_CASES]
    assert len(ids) == len(set(ids))


# -- whole models -------------------------------------------------------------------------------
def model_fill(types, net, rng, gains=None):
    """Random weights that keep activations O(1) through deep nets: He-scaled conv/IP weights,
    small biases, BatchNorm with positive variances and factor 1, Scale gammas near 1."""
    def normal(std, s):
        return rng.standard_normal(s, dtype=np.float32) * np.float32(std)

    for name, blobs in net.params.items():
        t = types[name]
        gain = [g for part, g in (gains or {}).items() if part in name]
        for i, b in enumerate(blobs):
            s = b.data.shape
            if t == "BatchNorm":
                v = [normal(0.1, s), rng.uniform(0.5, 1.5, s), np.ones(s)][i]
            elif t == "Scale":
                v = rng.uniform(0.5, 1.5, s) if i == 0 else normal(0.1, s)
            elif t in ("Normalize", "PReLU"):
                v = rng.uniform(0.1, 1.0, s)
            elif i == 0:
                fan = s[0] * np.prod(s[2:]) if t == "Deconvolution" else np.prod(s[1:])
                v = normal(np.sqrt(2.0 / max(fan, 1)), s)
            else:
                v = normal(0.1, s)
            b.data[...] = v * np.float32(gain[0] if gain else 1.0)


# (id, prototxt under MODELS, input shape, extra blobs to compare besides the outputs, weight
# gains by layer-name part). The extra blob is the last one before a final Softmax: random nets
# can saturate it. SSD's conf heads are damped so that no two scores tie at 1.0 (the order of
# tied boxes is unspecified in the fork's std::sort, and so is which of them keep_top_k keeps).
MODEL_CASES = [
    ("lenet", "bvlc/examples/mnist/lenet.prototxt", (2, 1, 28, 28), ["ip2"], {}),
    ("cifar10_full", "bvlc/examples/cifar10/cifar10_full.prototxt", (2, 3, 32, 32), ["ip1"], {}),
    ("squeezenet_v1.0", "squeezenet/SqueezeNet_v1.0/deploy.prototxt", (2, 3, 227, 227), ["pool10"], {}),
    ("squeezenet_v1.1", "squeezenet/SqueezeNet_v1.1/deploy.prototxt", (1, 3, 227, 227), ["pool10"], {}),
    ("caffenet", "bvlc/models/bvlc_reference_caffenet/deploy.prototxt", (1, 3, 227, 227), ["fc8"], {}),
    ("googlenet", "bvlc/models/bvlc_googlenet/deploy.prototxt", (1, 3, 224, 224), ["loss3/classifier"], {}),
    ("resnet50", "resnet/prototxt/ResNet-50-deploy.prototxt", (1, 3, 224, 224), ["fc1000"], {}),
    ("mobilenet_v1", "mobilenet/mobilenet_deploy.prototxt", (1, 3, 224, 224), ["fc7"], {}),
    ("mobilenet_v2", "mobilenet/mobilenet_v2_deploy.prototxt", (1, 3, 224, 224), ["fc7"], {}),
    ("densenet121", "densenet/DenseNet_121.prototxt", (1, 3, 224, 224), [], {}),
    ("inception_v3", "soeaver/cls/inception/deploy_inception-v3.prototxt", (1, 3, 299, 299), ["classifier"], {}),
    ("mobilenet_ssd", "mobilenet-ssd/deploy.prototxt", (1, 3, 300, 300),
     ["mbox_loc", "mbox_conf_flatten", "mbox_priorbox"], {"mbox_conf": 0.15}),
    ("mobilenet_ssd_voc", "mobilenet-ssd/voc/MobileNetSSD_deploy.prototxt", (2, 3, 300, 300),
     ["mbox_conf_flatten"], {}),
    ("ssd_vgg300", "ssd/models/VGGNet/VOC0712/SSD_300x300/deploy.prototxt", (1, 3, 300, 300),
     ["mbox_loc", "mbox_conf_flatten"], {"mbox_conf": 0.15}),
    ("xception", "soeaver/cls/inception/deploy_xception.prototxt", (1, 3, 299, 299), [], {}),
    ("inception_v2", "soeaver/cls/inception/deploy_inception-v2.prototxt", (1, 3, 231, 231), [], {}),
]
# Left out for time: VGG16/19 and FCN (0.5 GB of weights to write and read back), ResNet-101/152,
# DenseNet-161/169/201, Inception-v4 (deeper versions of nets above; they pass too).


@pytest.mark.filterwarnings("ignore:.*save_output_param")    # SSD300's deploy asks for files
@pytest.mark.parametrize("id, path, shape, extra, gains", MODEL_CASES, ids=[m[0] for m in MODEL_CASES])
def test_model_matches_opencv(id, path, shape, extra, gains, tmp_path):
    proto = need(MODELS / path)
    net = caffe.Net(str(proto), caffe.TEST)
    types = {l.name: l.type for l in net.layer_list}
    rng = np.random.default_rng(seed_of(id))
    model_fill(types, net, rng, gains)
    (name,) = net.inputs
    x = rng.standard_normal(shape).astype(np.float32)
    out = net.forward(blobs=extra, **{name: x})
    model = tmp_path / "model.caffemodel"
    net.save(str(model))
    blobs = list(net.outputs) + list(extra)
    where = producers(proto.read_text())
    theirs = opencv_forward(proto, model, {name: x}, blobs, where)
    for b in blobs:
        if types[where[b][0]] == "DetectionOutput":
            scores = out[b][0, 0, :, 2]
            assert len(scores) > 1, f"{id}: the random net should detect something"
            assert len(np.unique(scores)) == len(scores), f"{id}: tied scores make the order arbitrary"
            compare_detections(out[b], theirs[b], ATOL_MODEL, f"{id} '{b}'")
        else:
            compare(out[b], theirs[b].reshape(out[b].shape), ATOL_MODEL, f"{id} '{b}'")
