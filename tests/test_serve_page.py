"""``brewnet serve``'s demo page (``GET /``) in a real browser: headless Chromium loads it, a real
photo goes in through the page's own file input, and the top-5 the page renders is ``/predict``'s
JSON for the same bytes, with the server's time and owl's heatmap shown; a bad upload shows the
server's 400 message. ``BREWNET_SCREENSHOTS=docs/screenshots`` also writes the page before and
after (the pictures in docs/deploy.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import browser  # noqa: E402
from helpers import MODELS, SHARED, need, wait_until_serving  # noqa: E402
from test_serve import free_port  # noqa: E402

CHROMIUM = browser.find()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium for the page test "
                                                         "(Debian: apt-get install chromium)")
CIFAR = MODELS / "trained" / "everpeace_caffe_2014_v1format" / "examples" / "cifar10"
PHOTO = SHARED / "caffe-models" / "images" / "chelsea.png"
CIFAR_LABELS = "airplane automobile bird cat deer dog frog horse ship truck".split()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    weights = need(CIFAR / "cifar10_full_iter_70000.caffemodel")
    d = tmp_path_factory.mktemp("page")
    labels = d / "batches.meta.txt"            # CIFAR-10's class names, one a line
    labels.write_text("\n".join(CIFAR_LABELS) + "\n")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # the CIFAR-10 LMDB holds RGB planes in [0, 255]: no channel swap; its mean per channel
    proc = subprocess.Popen([sys.executable, "-m", "brewnet.cli", "serve",
                             "--model", str(CIFAR / "cifar10_full.prototxt"), "--weights", str(weights),
                             "--labels", str(labels), "--raw-scale", "255",
                             "--mean", "125,123,114", "--heatmap-blob", "conv3", "--port", str(port)],
                            env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(proc, url)
    yield url
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


SHOWN = """JSON.stringify({
  state: document.body.dataset.state,
  top: [...document.querySelectorAll('#top li')].map(li => ({
    index: Number(li.dataset.index), score: Number(li.dataset.score),
    label: li.querySelector('.label').textContent, shown: li.querySelector('.score').textContent})),
  timing: document.getElementById('timing').hidden ? null : document.getElementById('timing').textContent,
  serverMs: document.getElementById('timing').dataset.serverMs,
  error: document.getElementById('error').hidden ? null : document.getElementById('error').textContent,
  heatmap: document.getElementById('heatmap-box').hidden ? 0 : document.getElementById('heatmap').naturalWidth,
})"""


def shots() -> Path | None:
    d = os.environ.get("BREWNET_SCREENSHOTS")
    return Path(d) if d else None


def test_page_shows_predicts_top5_for_a_photo(server):
    import json

    photo = need(PHOTO)
    answer = httpx.post(server + "/predict", content=photo.read_bytes(),
                        headers={"Content-Type": "image/png"}, timeout=60).json()
    with browser.Chromium(CHROMIUM) as b:
        b.open(server + "/")
        assert b.evaluate("document.title") == "brewnet serve: CIFAR10_full_deploy"
        assert b.evaluate("document.body.dataset.heatmap") == "conv3"
        if shots():
            b.screenshot(shots() / "serve_page_before.png")
        b.pick_file("#file", str(photo))
        b.wait_for("['done', 'error'].includes(document.body.dataset.state)")
        b.wait_for("document.getElementById('preview').complete")
        shown = json.loads(b.evaluate(SHOWN))
        if shots():
            b.screenshot(shots() / "serve_page_after.png")
    assert shown["state"] == "done" and shown["error"] is None
    assert [(t["index"], t["label"]) for t in shown["top"]] == [(t["index"], t["label"]) for t in answer["top"]]
    assert len(shown["top"]) == 5 and {t["label"] for t in shown["top"]} <= set(CIFAR_LABELS)
    assert [t["score"] for t in shown["top"]] == pytest.approx([t["score"] for t in answer["top"]], rel=1e-5)
    assert shown["top"][0]["shown"] == f"{100 * answer['top'][0]['score']:.2f} %"
    assert float(shown["serverMs"]) > 0 and shown["timing"].startswith("Server: ")
    assert shown["heatmap"] >= 256                  # the PNG of POST /heatmap, loaded


def test_page_shows_the_servers_400_for_a_bad_upload(server, tmp_path):
    import json

    bad = tmp_path / "not_really.png"
    bad.write_bytes(b"this is no PNG")
    said = httpx.post(server + "/predict", content=bad.read_bytes(), headers={"Content-Type": "image/png"})
    assert said.status_code == 400
    with browser.Chromium(CHROMIUM) as b:
        b.open(server + "/")
        b.pick_file("#file", str(bad))
        b.wait_for("['done', 'error'].includes(document.body.dataset.state)")
        shown = json.loads(b.evaluate(SHOWN))
    assert shown["state"] == "error" and shown["top"] == []
    assert shown["error"] == said.json()["error"] == \
        "the body is not a readable JPEG or PNG image (truncated or corrupt?)"


def test_heatmap_endpoint(server):
    photo = need(PHOTO)
    r = httpx.post(server + "/heatmap", content=photo.read_bytes(), headers={"Content-Type": "image/png"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.headers["server-timing"].startswith("heatmap;dur=")
    import io

    from PIL import Image

    assert Image.open(io.BytesIO(r.content)).size == (256, 256)      # 32 x 32 shown at 8x
    r = httpx.post(server + "/heatmap", content=b"{}", headers={"Content-Type": "application/json"})
    assert r.status_code == 415 and "image/jpeg or image/png" in r.json()["error"]
