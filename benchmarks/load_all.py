"""Load every net of the corpus in brewnet and in OpenCV's dnn, run one forward, compare.

    python benchmarks/load_all.py [--nets a,b] [--timeout 300] [--mem-gb 10] [--out benchmarks/results/load_all]

The corpus: benchmarks/zoo/corpus.py (provenance: benchmarks/zoo/SOURCES.md). Each net runs in its
own process (a crash, a hang or a memory blow-up costs one row: ``--timeout`` seconds, ``--mem-gb``
of resident memory), at batch 1: the prototxt's input shape, or the entry's ``input_shape``.

brewnet: ``brewnet.Net(prototxt, TEST, engine="eager")`` (stage "build"), the inputs reshaped to
batch 1 (stage "shapes"), random weights drawn with a fixed seed (calibrated as
benchmarks/zoo.py's are, so that deep random nets neither overflow nor saturate; plain He-scaled
weights where that calibration pass cannot run), one ``forward()`` on a fixed random input
(stage "forward"). The weights are written with ``net.save()`` as a caffemodel; OpenCV
(``cv2.dnn.readNetFromCaffe`` on the same prototxt and caffemodel) gets the same input and forwards
its unconnected outputs (Winograd convolution off: the reference is the direct convolution).
Where brewnet did not build, OpenCV reads the prototxt alone (no weights to
run with): that says whether its importer takes the net.

Compared: each OpenCV output whose layer brewnet has, against the blob that layer writes in brewnet;
scale = max |OpenCV's output|; they agree when max |brewnet - OpenCV| <= 1e-4 * scale (and the
shapes match). A Silence output: the blobs it consumes instead. A DetectionOutput: its inputs (loc,
conf, priors), and its detections as a set (rows whose score ties with another's left out: with
random weights scores tie and OpenCV's NMS orders ties unlike Caffe's). SENet's Axpy nets whose
outputs differ (OpenCV computes a*Y + X, the fork a*X + Y): the first Axpy's inputs against
OpenCV's and its output against the fork's formula, counted apart. Nets BVLC Caffe itself refuses
(the corpus' ``caffe_refuses``) are counted apart from brewnet's failures. A net whose data layer
reads an image list gets a list of random images made for it (``feed_data_layers``).
Written: ``<out>.txt`` (the table, the counts, the failures grouped by reason) and
``<out>.json`` (the rows). A reason is the exception's first line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-4
SEED = 0


def corpus():
    sys.path.insert(0, str(ROOT / "benchmarks" / "zoo"))
    import corpus as c

    return c


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}"[:300]


def cv_reason(e: BaseException) -> str:
    """OpenCV's error in one line: the message after "error: (code:kind)", and the "> ..." lines
    of a failed check (what was expected, what the values were)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    head = next((x for x in lines if "error: (" in x), lines[0] if lines else type(e).__name__)
    m = re.search(r"error: \(-?\d+:([^)]*)\) (.*)", head)
    msg = re.sub(r"\s*\bin function '.*?'\s*$", "", m.group(2)).strip() if m else head
    if m and m.group(1) != "Unspecified error":
        msg = f"{m.group(1)}: {msg}"
    more = " ".join(re.sub(r"\s+", " ", x.lstrip("> ")) for x in lines if x.startswith(">"))
    if not msg:
        return f"cv2.error: {more}"[:300]
    return f"cv2.error: {msg}{' (' + more + ')' if more else ''}"[:300]


# ---------------------------------------------------------------- one net (child process)

def plain_weights(net, rng) -> None:
    """He-scaled weights where a blob is still all zero (deploy prototxts rarely have fillers);
    BatchNorm mean 0, variance 1; Scale multipliers U(0.5, 1.5); other vectors N(0, 0.1)."""
    params = net.params
    for layer in net.layer_list:
        blobs = params.get(layer.name)
        if not blobs:
            continue
        if layer.type == "BatchNorm" and len(blobs) >= 3:
            for blob, v in zip(blobs, (0.0, 1.0, 1.0)):
                blob.data[...] = v
            continue
        for k, blob in enumerate(blobs):
            w = blob.data
            if not w.size or w.any():
                continue
            if w.ndim >= 2:
                w[...] = rng.normal(0, np.sqrt(2.0 / max(1, w[0].size)), w.shape)
            elif layer.type == "Scale" and k == 0:
                w[...] = rng.uniform(0.5, 1.5, w.shape)
            else:
                w[...] = rng.normal(0, 0.1, w.shape)


def set_batch1(net, entry) -> None:
    for i, name in enumerate(net.inputs):
        shape = list(net.blobs[name].data.shape)
        if i == 0 and entry.get("input_shape"):
            shape = [1, *entry["input_shape"]]
        elif shape:
            shape[0] = 1
        net.blobs[name].reshape(*shape)
    net.reshape()


def inputs_for(net) -> dict:
    """One fixed random input per input blob: N(0, 1); ``im_info`` the image's height, width, 1;
    an input an Embed layer reads: random indices below its ``input_dim``."""
    rng = np.random.default_rng(SEED + 1)
    embed = {}
    for layer, bottoms in zip(net.layer_list, net.bottom_lists):
        if layer.type == "Embed" and bottoms:
            embed[bottoms[0]] = int(layer.param.embed_param.input_dim) or 1
    image = next((net.blobs[n].data.shape[2:] for n in net.inputs if net.blobs[n].data.ndim == 4), None)
    xs = {}
    for name in net.inputs:
        shape = net.blobs[name].data.shape
        if name == "im_info" and image is not None:
            x = np.array([[image[0], image[1], 1.0]], np.float32).reshape(shape)
        elif name in embed:
            x = rng.integers(0, embed[name], shape).astype(np.float32)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
        xs[name] = x
    return xs


LIST_DATA = {"ImageData": "image_data_param", "DenseImageData": "dense_image_data_param"}


def feed_data_layers(path: Path, entry: dict, folder: Path) -> Path:
    """``path`` itself, or, where the net reads images named in a list file (ImageData,
    SegNet's DenseImageData) whose source is the publisher's own dataset, a copy in ``folder``
    whose lists name two random images made there (the entry's ``input_shape`` (C, H, W); label
    images of values 0..10 beside them for DenseImageData) at batch 1."""
    from brewnet.proto import caffe_pb2 as pb
    from brewnet.proto.io import read_text, write_text

    net = read_text(path, pb.NetParameter())
    layers = [la for la in net.layer if la.type in LIST_DATA]
    if not layers:
        return path
    import cv2

    c, h, w = entry.get("input_shape") or (3, 32, 32)
    rng = np.random.default_rng(SEED + 2)
    pairs = []
    for i in range(2):
        img = rng.integers(0, 256, (h, w, 3) if c == 3 else (h, w), dtype=np.uint8)
        lab = rng.integers(0, 11, (h, w), dtype=np.uint8)
        cv2.imwrite(str(folder / f"image{i}.png"), img)
        cv2.imwrite(str(folder / f"label{i}.png"), lab)
        pairs.append((f"image{i}.png", f"label{i}.png", str(i)))
    for layer in layers:
        p = getattr(layer, LIST_DATA[layer.type])
        dense = layer.type == "DenseImageData"
        lst = folder / f"{layer.name}.txt"
        lst.write_text("".join(f"{a} {b if dense else n}\n" for a, b, n in pairs))
        p.source, p.root_folder, p.batch_size = str(lst), str(folder) + "/", 1
    out = folder / path.name
    write_text(out, net)
    return out


def one(name: str) -> dict:
    import brewnet

    c = corpus()
    entry = c.by_name(name)
    path = c.resolve(entry, ROOT)
    row = {"name": name, "category": entry["category"], "repo": entry.get("repo", ""),
           "path": entry["path"], "brewnet": None, "opencv": None, "compare": [], "agree": None}
    if entry.get("caffe_refuses"):
        row["caffe_refuses"] = entry["caffe_refuses"]
    folder = Path(tempfile.mkdtemp(prefix="load_all-"))
    try:
        path = feed_data_layers(path, entry, folder)
    except Exception as e:  # noqa: BLE001 - brewnet's own read below says why
        row["data"] = first_line(e)
    weights = folder / "w.caffemodel"
    stage = "build"
    net = None
    outs = {}
    xs = {}
    try:
        brewnet.set_random_seed(SEED)
        net = brewnet.Net(str(path), brewnet.TEST, engine="eager")
        stage = "shapes"
        set_batch1(net, entry)
        stage = "weights"
        rng = np.random.default_rng(SEED)
        plain_weights(net, rng)
        try:
            sys.path.insert(0, str(ROOT / "tests"))
            from test_every_net_every_call import realistic

            realistic(net, 0, 1, SEED)
        except Exception:  # noqa: BLE001 - calibration is best effort: plain weights stand
            plain_weights(net, np.random.default_rng(SEED))
        set_batch1(net, entry)
        net.save(str(weights))
        stage = "forward"
        xs = inputs_for(net)
        for n, x in xs.items():
            net.blobs[n].data[...] = x
        net.forward()
        row["brewnet"] = "ok"
        row["outputs"] = {n: list(net.blobs[n].data.shape) for n in net.outputs}
    except BaseException as e:  # noqa: BLE001 - the row says why
        row["brewnet"] = f"{stage}: {first_line(e)}"
    try:
        import cv2

        if not weights.exists():
            cv2.dnn.readNetFromCaffe(str(path))
            row["opencv"] = "not run: no weights (brewnet did not build); its importer took the prototxt"
        else:
            cvn = cv2.dnn.readNetFromCaffe(str(path), str(weights))
            # OpenCV's Winograd 3x3 convolution (on by default) is less exact than a direct
            # float32 convolution: colorization_v2's class8_ab drifted to 2.5e-4 of its scale
            # through 20 such layers with it, 3.7e-5 without.
            cvn.enableWinograd(False)
            if not xs:
                xs = inputs_for(net)
            for n, x in xs.items():
                cvn.setInput(x, n)
            names = list(cvn.getUnconnectedOutLayersNames())
            plan = comparison_plan(net, names)
            asked = list(dict.fromkeys(names + [cv for cv, _ in plan["extra"]]))
            got = cvn.forward(asked)
            outs = {n: np.asarray(o) for n, o in zip(asked, got)}
            row["opencv"] = "ok"
    except BaseException as e:  # noqa: BLE001
        row["opencv"] = cv_reason(e) if "cv2" in type(e).__module__ else first_line(e)
    if row["brewnet"] == "ok" and row["opencv"] == "ok":
        compare_outputs(row, net, outs, plan)
        if plan["axpy"]:
            check_axpy(row, net, outs, plan["axpy"])
    return row


def producer(net, blob: str, before: int) -> tuple[str, int] | None:
    """The layer (name, top index) that last wrote ``blob`` before layer ``before``."""
    for i in range(before - 1, -1, -1):
        tops = list(net.top_lists[i])
        if blob in tops:
            return net.layer_list[i].name, tops.index(blob)
    return None


def _inputs_of(net, index: int) -> list[tuple[str, str]]:
    """(OpenCV output name, brewnet blob) for each bottom of layer ``index``: the layer that wrote
    it (OpenCV names a layer's first output by the layer's name; net inputs are not outputs)."""
    out = []
    for b in net.bottom_lists[index]:
        p = producer(net, b, index)
        if p is not None and p[1] == 0 and net.layer_list[net.layer_index(p[0])].type != "Input":
            out.append((p[0], b))
    return out


def comparison_plan(net, names: list[str]) -> dict:
    """What to compare beyond OpenCV's unconnected outputs: the blobs a Silence layer consumes
    (its own output is nothing), a DetectionOutput's inputs (loc, conf, priors: with random
    weights its scores tie, and OpenCV's NMS breaks ties in another order than Caffe's), and the
    first Axpy's inputs (SENet: OpenCV computes a*Y + X, the fork a*X + Y)."""
    index = {la.name: i for i, la in enumerate(net.layer_list)}
    plan = {"silence": {}, "detection": {}, "extra": [], "axpy": None, "names": list(names)}
    for n in names:
        i = index.get(n)
        if i is None:
            continue
        kind = net.layer_list[i].type
        if kind == "Silence":
            plan["silence"][n] = _inputs_of(net, i)
            plan["extra"] += plan["silence"][n]
        elif kind == "DetectionOutput":
            plan["detection"][n] = _inputs_of(net, i)
            plan["extra"] += plan["detection"][n]
    first = next((i for i, la in enumerate(net.layer_list) if la.type == "Axpy"), None)
    if first is not None:
        plan["axpy"] = (net.layer_list[first].name, _inputs_of(net, first))
        plan["extra"] += plan["axpy"][1]
    return plan


def compare_blob(name: str, b, o) -> dict:
    """brewnet's ``b`` against OpenCV's ``o``: max |b - o| within RTOL of max |o|."""
    b = np.asarray(b, np.float64)
    o = np.asarray(o, np.float64)
    if b.size != o.size:
        return {"output": name, "why": f"shape {list(b.shape)} vs OpenCV {list(o.shape)}", "agree": False}
    b = b.reshape(o.shape)
    scale = float(np.nanmax(np.abs(o))) if o.size else 0.0
    diff = float(np.nanmax(np.abs(b - o))) if o.size else 0.0
    finite = bool(np.isfinite(b).all() and np.isfinite(o).all())
    ok = finite and diff <= RTOL * scale if scale > 0 else finite and diff == 0.0
    return {"output": name, "max_diff": diff, "scale": scale, "rel": diff / scale if scale > 0 else None,
            "agree": ok, **({} if finite else {"why": "not finite"})}


def detection_set(name: str, b, o) -> dict:
    """Two DetectionOutput results (rows image, label, score, x1, y1, x2, y2) as sets: each row
    whose score ties with no other row's of its result (within RTOL of the scale) must have a row
    of the other result equal to it within that tolerance, in any order; tied rows are left out
    (NMS and top-k keep either of a tie), and so are rows at the other result's lowest score (the
    top-k cut, where a score within the tolerance falls either side)."""
    b = np.asarray(b, np.float64).reshape(-1, 7)
    o = np.asarray(o, np.float64).reshape(-1, 7)
    b, o = b[b[:, 1] >= 0], o[o[:, 1] >= 0]         # "no detection" rows are -1
    scale = max(float(np.abs(o).max()) if o.size else 0.0, float(np.abs(b).max()) if b.size else 0.0, 1e-30)
    tol = RTOL * scale

    def distinct(rows):
        s = rows[:, 2]
        return rows[(np.abs(s[:, None] - s[None, :]) <= tol).sum(1) == 1]

    def unmatched(rows, other):
        if not len(rows):
            return 0, 0.0
        if not len(other):
            return len(rows), 0.0
        d = np.abs(rows[:, None, :] - other[None, :, :]).max(2).min(1)
        cut = rows[:, 2] <= other[:, 2].min() + tol
        return int(((d > tol) & ~cut).sum()), float(d[~cut].max()) if (~cut).any() else 0.0

    bd, od = distinct(b), distinct(o)
    nb, db = unmatched(bd, o)
    no, do = unmatched(od, b)
    what = (f"detections as a set: {len(bd)} of {len(b)} rows (brewnet), {len(od)} of {len(o)} "
            f"(OpenCV) with distinct scores")
    diff = max(db, do)
    out = {"output": name, "max_diff": diff, "scale": scale, "rel": diff / scale,
           "agree": nb == 0 and no == 0, "set": what}
    if nb or no:
        out["why"] = what + f": {nb} of brewnet's and {no} of OpenCV's have no match in the other"
    return out


def compare_outputs(row: dict, net, outs: dict, plan: dict) -> None:
    agree, notes = [], []
    groups = list(plan["silence"].values()) + list(plan["detection"].values())
    axpy_only = {cv for cv, _ in (plan["axpy"][1] if plan["axpy"] else [])}
    axpy_only -= set(plan["silence"]) | set(plan["detection"]) | {cv for g in groups for cv, _ in g}
    for n, o in outs.items():
        if n in axpy_only and n not in net.outputs and n not in (plan.get("names") or ()):
            continue                                 # asked for the Axpy check only
        if n in plan["silence"]:
            notes.append(f"{n} (Silence): its input{'s' if len(plan['silence'][n]) > 1 else ''} "
                         + ", ".join(b for _, b in plan["silence"][n]))
            continue
        if n in plan["detection"]:
            tops = net.top_names[n]
            c = detection_set(n, net.blobs[tops[0]].data, o)
            notes.append(f"{n} (DetectionOutput): its inputs " + ", ".join(b for _, b in plan["detection"][n])
                         + f"; {c['set']}")
            row["compare"].append(c)
            agree.append(c["agree"])
            continue
        blob = next((b for group in groups for cv, b in group if cv == n), None)
        if blob is None:
            tops = net.top_names.get(n) or ([n] if n in net.blobs else [])
            if not tops:
                row["compare"].append({"output": n, "why": "no such layer in brewnet"})
                continue
            blob = tops[0]
        c = compare_blob(n if blob == n else f"{n} ({blob})", net.blobs[blob].data, o)
        row["compare"].append(c)
        agree.append(c["agree"])
    row["agree"] = all(agree) if agree else None
    if notes:
        row["compared"] = "; ".join(notes)
    if not agree:
        row["compare_why"] = "no output in common: " + ", ".join(outs)


def check_axpy(row: dict, net, outs: dict, axpy) -> None:
    """SENet's Axpy: OpenCV 4.x computes a*Y + X where the fork computes a*X + Y
    (hujie-frank/SENet axpy_layer.cpp; tests/test_layers_forks.py). Where the outputs differ,
    the first Axpy's inputs are compared with OpenCV's and its output with the fork's formula
    on brewnet's inputs (a forward up to that layer)."""
    name, inputs = axpy
    if row["agree"] is not False:
        return
    net.forward(end=name)
    bottoms = net.bottom_names[name]
    a, x, y = (np.asarray(net.blobs[b].data, np.float64) for b in bottoms)
    want = a.reshape(a.shape[:2] + (1,) * (x.ndim - 2)) * x + y
    got = np.asarray(net.blobs[net.top_names[name][0]].data, np.float64)
    scale = float(np.abs(want).max()) or 1.0
    formula = float(np.abs(got - want).max())
    ins = [compare_blob(f"{cv} ({b})", net.blobs[b].data, outs[cv]) for cv, b in inputs if cv in outs]
    ok = formula <= RTOL * scale and len(ins) == 3 and all(c["agree"] for c in ins)
    row["fork_formula"] = {"layer": name, "inputs": ins, "formula_rel": formula / scale, "agree": ok}
    row["agree_fork"] = ok


# ---------------------------------------------------------------- the run (parent)

def rss_gb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


def run_child(name: str, timeout: float, mem_gb: float) -> dict:
    cmd = [sys.executable, __file__, "--one", name]
    env = dict(os.environ, PYTHONWARNINGS="ignore", GLOG_minloglevel="2", OPENCV_LOG_LEVEL="ERROR")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env, text=True)
        t0 = time.monotonic()
        why = None
        while p.poll() is None:
            time.sleep(0.25)
            if time.monotonic() - t0 > timeout:
                why = f"timed out ({timeout:.0f} s)"
            elif mem_gb and rss_gb(p.pid) > mem_gb:
                why = f"over {mem_gb:g} GB of memory"
            if why:
                p.kill()
                p.wait()
                break
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        line = next((x for x in out.read().splitlines() if x.startswith("ROW ")), None)
        tail = [x for x in err.read().strip().splitlines() if x.strip()]
    if line and not why:
        row = json.loads(line[4:])
    else:
        why = why or f"process died (exit {p.returncode}): {tail[-1][:200] if tail else 'no output'}"
        c = corpus()
        e = c.by_name(name)
        row = {"name": name, "category": e["category"], "repo": e.get("repo", ""), "path": e["path"],
               "brewnet": why, "opencv": "not run (process)", "compare": [], "agree": None}
        if e.get("caffe_refuses"):
            row["caffe_refuses"] = e["caffe_refuses"]
    row["seconds"] = round(seconds, 1)
    return row


def clean(text):
    """``text`` without this machine's paths (the repository root, temporary folders)."""
    if not isinstance(text, str):
        return text
    text = text.replace(str(ROOT) + os.sep, "")
    return re.sub(re.escape(tempfile.gettempdir()) + r"/[^\s:'\"]*", "<tmp>", text)


def reason_key(reason: str) -> str:
    """A failure reason without the names of one net (layer names, files, numbers), to group by."""
    key = re.sub(r"[Ll]ayer '[^']*'", "Layer '…'", reason)
    key = re.sub(r'[Ll]ayer "[^"]*"', 'layer "…"', key)
    key = re.sub(r"(layer|blob|Blob|input|top|bottom|name)[ =]'[^']*'", r"\1 '…'", key)
    key = re.sub(r"\S+\.prototxt(:\d+)*", "<prototxt>", key)
    key = re.sub(r"(?<![A-Za-z_])\d+", "N", key)
    return key


def diff_text(row) -> str:
    if row.get("caffe_refuses") and row["brewnet"] != "ok":
        return "Caffe refuses too"
    if row["agree"] is None:
        return "-"
    rels = [c["rel"] for c in row["compare"] if c.get("rel") is not None]
    worst = max(rels) if rels else None
    if row.get("agree_fork"):
        return "fork formula; OpenCV differs (known)"
    tag = "agree" if row["agree"] else "DIFFER"
    text = f"{tag} {worst:.1e}" if worst is not None else tag
    if any("set" in c for c in row["compare"]):
        text += " (DetectionOutput: inputs, detections as a set)"
    elif row.get("compared"):
        text += " (Silence's input)"
    return text


def report(rows: list[dict]) -> str:
    lines = []
    w = max([len(r["name"]) for r in rows] + [4])
    lines.append(f"{'net':{w}}  {'category':17} {'repository':38} {'brewnet':44} {'opencv':44} max diff / scale")
    for r in rows:
        lines.append(f"{r['name']:{w}}  {r['category'][:17]:17} {r['repo'][:38]:38} "
                     f"{r['brewnet'][:44]:44} {r['opencv'][:44]:44} {diff_text(r)}")
    b = sum(r["brewnet"] == "ok" for r in rows)
    o = sum(r["opencv"] == "ok" for r in rows)
    both = sum(r["brewnet"] == "ok" and r["opencv"] == "ok" for r in rows)
    agree = sum(bool(r["agree"]) for r in rows)
    fork = sum(bool(r.get("agree_fork")) for r in rows)
    refused = [r for r in rows if r.get("caffe_refuses") and r["brewnet"] != "ok"]
    repos = len({r["repo"] for r in rows if r["repo"]})
    lines += ["", f"nets: {len(rows)} (from {repos} repositories)", f"brewnet runs: {b}",
              f"OpenCV runs: {o}", f"both run: {both}", f"agree (within {RTOL:g} of each output's scale): {agree}",
              f"agree with the fork's formula, OpenCV differs (known: SENet's Axpy): {fork}",
              f"Caffe refuses too (invalid files, not counted as brewnet failures): {len(refused)}",
              "compared: OpenCV's unconnected outputs against the blobs their layers write in brewnet; "
              "a Silence output: the blobs it consumes; a DetectionOutput: its inputs (loc, conf, "
              "priors) within the tolerance and its detections as a set, rows whose score ties with "
              "another's left out; SENet's Axpy nets where the outputs differ: the first Axpy's "
              "inputs against OpenCV's and its output against the fork's a*X + Y"]

    def grouped(title, items):
        groups = defaultdict(list)
        for name, why in items:
            groups[reason_key(why)].append((name, why))
        lines.extend(["", f"{title}: {len(items)}"])
        for key, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"  [{len(members)}] {key}")
            for name, why in members:
                lines.append(f"      {name}: {why}")

    grouped("brewnet fails", [(r["name"], r["brewnet"]) for r in rows
                              if r["brewnet"] != "ok" and not r.get("caffe_refuses")])
    lines.extend(["", f"Caffe refuses too: {len(refused)}"])
    lines.extend(f"      {r['name']}: {r['caffe_refuses']} (brewnet: {r['brewnet']})" for r in refused)
    grouped("OpenCV fails", [(r["name"], r["opencv"]) for r in rows if r["opencv"] != "ok"])
    forks = [r for r in rows if r.get("agree_fork")]
    lines.extend(["", f"agree with the fork's formula, OpenCV differs (known): {len(forks)}"])
    for r in forks:
        f = r["fork_formula"]
        ins = ", ".join(f"{c['output']} {c['rel']:.1e}" for c in f["inputs"])
        lines.append(f"      {r['name']}: {r['compare'][0]['output']} differs from OpenCV; layer {f['layer']}: "
                     f"inputs agree with OpenCV's ({ins}), output = a*X + Y within {f['formula_rel']:.1e}")
    differ = []
    for r in rows:
        if r["agree"] is False and not r.get("agree_fork"):
            bad = [c for c in r["compare"] if not c.get("agree")]
            text = "; ".join(f"{c['output']}: " + (c["why"] if "why" in c else
                                                    f"max diff {c['max_diff']:.3g} / scale {c['scale']:.3g}")
                             for c in bad)
            differ.append((r["name"], text or r.get("compare_why", "")))
    lines.extend(["", f"both run, outputs differ: {len(differ)}"])
    lines.extend(f"      {n}: {why}" for n, why in differ)
    none = [r for r in rows if r["brewnet"] == "ok" and r["opencv"] == "ok" and r["agree"] is None]
    lines.extend(["", f"both run, nothing compared: {len(none)}"])
    lines.extend(f"      {r['name']}: {r.get('compare_why', '')}" for r in none)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nets", default="", help="names, separated by ',' (default: every available net)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a net at most")
    p.add_argument("--mem-gb", type=float, default=10.0, help="resident memory a net at most (0: no limit)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_all"),
                   help="writes <out>.txt and <out>.json")
    p.add_argument("--update", action="store_true",
                   help="run only --nets and merge their rows into <out>.json's (the other rows kept)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        np.seterr(all="ignore")
        print("ROW " + json.dumps(one(a.one)), flush=True)
        return
    c = corpus()
    want = [s for s in a.nets.split(",") if s]
    entries = [e for e in c.NETS if not want or e["name"] in want]
    missing = [e["name"] for e in entries if not c.available(e, ROOT)]
    rows = []
    for e in entries:
        if e["name"] in missing:
            continue
        r = run_child(e["name"], a.timeout, a.mem_gb)
        rows.append(r)
        print(f"{r['name']}: brewnet {r['brewnet']} | opencv {r['opencv']} | {diff_text(r)} ({r['seconds']} s)",
              flush=True)
    out = Path(a.out)
    if a.update and out.with_suffix(".json").is_file():
        old = json.loads(out.with_suffix(".json").read_text())
        fresh = {r["name"]: r for r in rows}
        order = [e["name"] for e in c.NETS]
        kept = [r for r in old["rows"] if r["name"] not in fresh and r["name"] in order]
        rows = sorted(kept + rows, key=lambda r: order.index(r["name"]))
        missing = sorted(set(old.get("missing", [])) - set(fresh) | set(missing), key=order.index)
    for r in rows:
        for k in ("brewnet", "opencv", "compare_why", "data"):
            if k in r:
                r[k] = clean(r[k])
    text = report(rows)
    if missing:
        text += f"\nnot available here (shared data absent): {', '.join(missing)}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"rtol": RTOL, "seed": SEED, "rows": rows,
                                                    "missing": missing}, indent=1))
    print("\n" + text[text.index("\nnets: "):])


if __name__ == "__main__":
    main()
