"""The FastAPI app of ``brewnet serve``: ``POST /predict``, ``GET /healthz``, ``GET /metrics``,
and ``GET /``: a demo page (``static/``: plain HTML, JS and CSS, nothing fetched from elsewhere)
where a person drops an image and sees the top-k of ``/predict``, the server's time for it (each
``/predict`` answer's ``Server-Timing`` header) and, with ``--heatmap-blob``, ``POST /heatmap``'s
picture: owl's heatmap of that blob over the image as the net sees it (a PNG).

``/predict`` takes the raw bytes of a JPEG or PNG (``Content-Type: image/jpeg|png``), prepared
as pycaffe's Classifier prepares an image (resize to ``image_dims``, centre crop, transpose,
channel swap, raw scale, mean, input scale), or one net input (C, H, W) already prepared: a JSON
array (``application/json``), a ``.npy`` file (``application/x-npy``; no pickles), or raw
little-endian float32 values in C, H, W order (``application/octet-stream``). The answer: the
top-k classes with their scores. Each limit answers with a message: 413 body or pixels too
large, 415 content type, 400 empty or undecodable body, 422 wrong JSON or array shape, 503
queue full or past the time limit (``X-Timeout-Ms`` may lower it for one request).
"""
from __future__ import annotations

import asyncio
import html
import io as _io
import json
import logging
import os
import threading
import time
import warnings
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from ...pycaffe import io as cio
from .batcher import Batcher, Overloaded
from .metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("brewnet")
IMAGE_TYPES = {"image/jpeg", "image/png"}
ARRAY_TYPES = {"application/json", "application/x-npy", "application/octet-stream"}
ACCEPT_ORDER = ["image/jpeg", "image/png", "application/json", "application/x-npy", "application/octet-stream"]


def _or(kinds: list[str]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
# Smaller uploads decode on the event loop: a thread hand-off costs more than their decoding.
INLINE_DECODE = 64 << 10
STATIC = Path(__file__).parent / "static"


class Reject(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Limits:
    max_body: int = 20 << 20          # bytes
    max_pixels: int = 40_000_000      # width x height of an uploaded image
    timeout_s: float = 10.0           # per request, queueing included
    max_queue: int = 256


class Model:
    """The traced module with its input transform and labels."""

    def __init__(self, module, input_name, input_shape, transformer, image_dims, labels, top_k, name,
                 heatmap_net=None, heatmap_blob: str | None = None):
        self.module, self.input_name, self.input_shape = module, input_name, tuple(input_shape)
        self.transformer = transformer
        self.image_dims, self.labels, self.top_k, self.name = image_dims, labels, top_k, name
        # --heatmap-blob: the brewnet Net whose blob is drawn (one forward at a time)
        self.heatmap_net, self.heatmap_blob = heatmap_net, heatmap_blob
        self._heatmap_lock = threading.Lock()

    def prepare_image(self, body: bytes, max_pixels: int) -> np.ndarray:
        return self.transformer.preprocess(self.input_name, self.crop_image(body, max_pixels)).astype(np.float32)

    def crop_image(self, body: bytes, max_pixels: int) -> np.ndarray:
        """The upload decoded ([0, 1], H x W x C), resized to ``image_dims`` and centre-cropped to
        the input: what the net sees before the transform."""
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # PIL's decompression-bomb warning
                w, h = Image.open(_io.BytesIO(body)).size   # the header only
        except Exception:  # noqa: BLE001
            raise Reject(400, "the body is not a readable JPEG or PNG image (truncated or corrupt?)") from None
        if w * h > max_pixels:
            raise Reject(413, f"the image has {w}x{h} = {w * h} pixels; the limit is {max_pixels}")
        if body[:2] == b"\xff\xd8" and b"\xff\xd9" not in body[-64:]:
            raise Reject(400, "the JPEG is truncated (no end-of-image marker)")
        try:
            im = cio.decode_image(body, color=self.input_shape[0] != 1)
        except OSError:
            raise Reject(400, "the image could not be decoded (truncated or corrupt)") from None
        im = cio.resize_image(im, self.image_dims)
        ch, cw = self.input_shape[1:]
        top, left = (self.image_dims[0] - ch) // 2, (self.image_dims[1] - cw) // 2
        return im[top:top + ch, left:left + cw]

    def heatmap_png(self, body: bytes, max_pixels: int) -> bytes:
        """owl's heatmap of ``heatmap_blob`` for the upload, over the image as the net sees it
        (half and half, the jet colour map), as a PNG at least 256 pixels on its short side."""
        import torch
        from matplotlib import colormaps
        from PIL import Image

        from ...analysis.heatmap import heatmap

        im = self.crop_image(body, max_pixels)
        x = self.transformer.preprocess(self.input_name, im).astype(np.float32)
        net = self.heatmap_net
        with self._heatmap_lock, torch.no_grad():
            net.blobs[self.input_name].reshape(1, *x.shape)
            net.blobs[self.input_name].data[...] = x
            net.forward_tensors()
            features = net.blobs[self.heatmap_blob].tensor.float().cpu().numpy()[0]
        hm = heatmap(features, im.shape[:2])
        hm = (hm - hm.min()) / (np.ptp(hm) or 1.0)
        rgb = np.repeat(im, 3, axis=2) if im.shape[2] == 1 else im[:, :, :3]
        shown = 0.5 * np.clip(rgb, 0, 1) + 0.5 * colormaps["jet"](hm)[:, :, :3]
        pic = Image.fromarray((shown * 255).round().astype(np.uint8))
        scale = max(1, -(-256 // min(pic.size)))
        if scale > 1:
            pic = pic.resize((pic.size[0] * scale, pic.size[1] * scale), Image.NEAREST)
        buf = _io.BytesIO()
        pic.save(buf, "PNG")
        return buf.getvalue()

    def prepare_array(self, body: bytes, ctype: str) -> np.ndarray:
        """A prepared input: JSON, .npy or raw float32 (C, H, W), checked against the net's."""
        if ctype == "application/octet-stream":
            n = int(np.prod(self.input_shape))
            if len(body) != 4 * n:
                raise Reject(422, f"the body has {len(body)} bytes; this net takes {n} float32 "
                                  f"values ({4 * n} bytes) of shape {list(self.input_shape)} (C, H, W)")
            return np.frombuffer(body, "<f4").reshape(self.input_shape)
        what = "JSON array" if ctype == "application/json" else ".npy array"
        try:
            if ctype == "application/json":
                x = np.asarray(json.loads(body), dtype=np.float32)
            else:
                x = np.load(_io.BytesIO(body), allow_pickle=False)
        except (ValueError, TypeError, EOFError, OSError):
            if ctype == "application/json":
                raise Reject(422, "the JSON body must be a nested array of numbers") from None
            raise Reject(400, "the body is not a readable .npy array (truncated, or holds objects?)") from None
        if x.dtype.kind not in "fiub":
            raise Reject(422, f"the {what} holds {x.dtype}; send numbers")
        if x.shape != self.input_shape:
            raise Reject(422, f"the {what} has shape {list(x.shape)}; this net takes one "
                              f"input of shape {list(self.input_shape)} (C, H, W)")
        return x.astype(np.float32, copy=False)

    def answer(self, scores: np.ndarray) -> dict:
        order = np.argsort(-scores, kind="stable")[:self.top_k]
        return {"model": self.name, "top": [
            {"index": int(i), "label": self.labels[i] if i < len(self.labels) else str(int(i)),
             "score": float(scores[i])} for i in order]}


async def _body(request: Request, limit: int) -> bytes:
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > limit:
        raise Reject(413, f"the body is {n} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Reject(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(model: Model, limits: Limits, max_batch: int, max_delay_s: float,
               fixed_batch: int | None = None, inline: bool = False) -> FastAPI:
    """``inline``: run the forwards on the event loop (small nets; see ``batcher``)."""
    metrics = Metrics(max_batch)
    batcher = Batcher(model.module, max_batch, max_delay_s, limits.max_queue, metrics, fixed_batch,
                      inline)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        log.info("Serving '%s': batches of up to %d, %.1f ms delay, forwards %s", model.name,
                 max_batch, max_delay_s * 1e3, "on the event loop" if inline else "on a worker thread")
        yield
        await batcher.stop()     # uvicorn has finished the requests in flight by now
        log.info("Stopped serving '%s'", model.name)

    app = FastAPI(title="brewnet serve", lifespan=lifespan)
    app.state.metrics = metrics

    async def image_body(request: Request, accepted: set) -> tuple[str, bytes]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in accepted:
            raise Reject(415, f"content type '{ctype or '(none)'}' is not accepted; send "
                              + _or(sorted(accepted, key=ACCEPT_ORDER.index)))
        body = await _body(request, limits.max_body)
        if not body:
            raise Reject(400, "the body is empty")
        return ctype, body

    async def predict_one(request: Request, ticket) -> dict:
        ctype, body = await image_body(request, IMAGE_TYPES | ARRAY_TYPES)
        if ctype in ARRAY_TYPES:
            x = model.prepare_array(body, ctype)
        else:
            x = (model.prepare_image(body, limits.max_pixels) if len(body) < INLINE_DECODE else
                 await asyncio.to_thread(model.prepare_image, body, limits.max_pixels))
        return model.answer(await batcher.submit(x, ticket))

    async def predict(request: Request):
        t0 = time.perf_counter()
        timeout = limits.timeout_s
        hint = request.headers.get("x-timeout-ms", "")
        if hint.isdigit():
            timeout = min(timeout, int(hint) / 1e3)
        ticket = batcher.admit()
        try:
            async with asyncio.timeout(timeout):      # no task per request, unlike wait_for
                resp = JSONResponse(await predict_one(request, ticket))
        except Reject as e:
            resp = JSONResponse({"error": str(e)}, e.code)
        except Overloaded as e:
            resp = JSONResponse({"error": f"overloaded: {e}"}, 503, headers={"Retry-After": "1"})
        except TimeoutError:
            resp = JSONResponse({"error": f"the request took longer than its limit of {timeout:g} s"}, 503)
        finally:
            batcher.release(ticket)
        seconds = time.perf_counter() - t0
        metrics.request(resp.status_code, seconds)
        resp.headers["Server-Timing"] = f"predict;dur={seconds * 1e3:.2f}"   # the demo page shows it
        return resp

    # A plain Starlette route: /predict reads its own body, so FastAPI's per-request dependency
    # solving (0.37 ms of a LeNet request under cProfile, on the shared 2 cores) buys nothing.
    app.add_route("/predict", predict, methods=["POST"])

    async def heatmap(request: Request):
        if model.heatmap_blob is None:
            return JSONResponse({"error": "no heatmap: start brewnet serve with --heatmap-blob BLOB"}, 404)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(limits.timeout_s):
                _, body = await image_body(request, IMAGE_TYPES)
                png = await asyncio.to_thread(model.heatmap_png, body, limits.max_pixels)
            resp = Response(png, media_type="image/png")
        except Reject as e:
            resp = JSONResponse({"error": str(e)}, e.code)
        except TimeoutError:
            resp = JSONResponse({"error": f"the request took longer than its limit of {limits.timeout_s:g} s"},
                                503)
        resp.headers["Server-Timing"] = f"heatmap;dur={(time.perf_counter() - t0) * 1e3:.2f}"
        return resp

    app.add_route("/heatmap", heatmap, methods=["POST"])

    page = (STATIC / "index.html").read_text(encoding="utf-8")
    page = page.replace("__MODEL__", html.escape(model.name)).replace(
        "__HEATMAP__", html.escape(model.heatmap_blob or ""))
    assets = {name: (STATIC / name).read_bytes() for name in ("demo.js", "demo.css")}
    kinds = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in assets:
            return PlainTextResponse("not found", 404)
        return Response(assets[name], media_type=kinds[os.path.splitext(name)[1]])

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "model": model.name, "input": list(model.input_shape),
                "pid": os.getpid()}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(), media_type=CONTENT_TYPE)

    return app
