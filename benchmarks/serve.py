"""Load test of ``brewnet serve``: starts the server on loopback, drives it with a Python load
generator (asyncio + httpx, one connection per worker) at concurrency 1, 8 and 32 for a bounded
number of requests, mixes in bad requests (1 in 10: wrong content type or a truncated image),
stops the server, and prints requests/s, p50/p99 latency, mean batch size and error counts.

    python benchmarks/serve.py lenet        # or: open_nsfw, or --model M --weights W ...
    python benchmarks/serve.py lenet --requests 400 --concurrency 1,8,32
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
M = SHARED / "caffe-models"
PRESETS = {
    "lenet": ["--model", f"{M}/trained/lenet_mnist_ethereon/examples/mnist/lenet.prototxt",
              "--weights", f"{M}/trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel"],
    "open_nsfw": ["--model", f"{M}/trained/open_nsfw/deploy.prototxt",
                  "--weights", f"{M}/trained/open_nsfw/resnet_50_1by2_nsfw.caffemodel",
                  "--mean", "104,117,123", "--raw-scale", "255", "--channel-swap", "2,1,0",
                  "--image-dims", "256,256", "--fold"],
}


def image(preset: str) -> bytes:
    src = M / "images" / "coffee.png"
    im = Image.open(src).convert("L" if preset == "lenet" else "RGB")
    im = im.resize((28, 28) if preset == "lenet" else (256, 256))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


async def drive(url: str, good: bytes, n: int, concurrency: int) -> dict:
    bad = [(b"not an image", "text/plain", 415), (good[: len(good) // 3], "image/jpeg", 400)]
    counter, lat, codes = iter(range(n)), [], {"good_errors": 0, "bad_right": 0, "bad_wrong": 0}

    async def worker():
        async with httpx.AsyncClient(timeout=120) as c:
            for i in counter:
                body, ctype, want = (good, "image/jpeg", 200) if i % 10 else bad[(i // 10) % 2]
                t0 = time.perf_counter()
                try:
                    code = (await c.post(url + "/predict", content=body,
                                         headers={"content-type": ctype})).status_code
                except httpx.HTTPError:
                    code = -1
                if want == 200:
                    lat.append(time.perf_counter() - t0)
                    codes["good_errors"] += code != 200
                else:
                    codes["bad_right" if code == want else "bad_wrong"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return dict(codes, rps=n / wall, p50=np.percentile(lat, 50) * 1e3, p99=np.percentile(lat, 99) * 1e3)


def batch_stats(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    s = float(re.search(r"^brewnet_batch_size_sum (\S+)", text, re.M).group(1))
    c = float(re.search(r"^brewnet_batch_size_count (\S+)", text, re.M).group(1))
    return s, c


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", nargs="?", choices=sorted(PRESETS), default="lenet")
    p.add_argument("--requests", type=int, default=400, help="per concurrency level")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-batch", default="16")
    p.add_argument("--max-delay-ms", default="5")
    args, extra = p.parse_known_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "brewnet.cli", "serve", *PRESETS[args.preset], *extra,
           "--port", str(port), "--max-batch", args.max_batch, "--max-delay-ms", args.max_delay_ms]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}): {' '.join(cmd)}")
        good = image(args.preset)
        asyncio.run(drive(url, good, 20, 4))      # warm-up, not reported
        print(f"brewnet serve {args.preset}: {args.requests} requests per row (1 in 10 bad), "
              f"--max-batch {args.max_batch} --max-delay-ms {args.max_delay_ms}")
        print(f"{'concurrency':>11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean batch':>10} "
              f"{'good errors':>11} {'bad: right code':>15}")
        for conc in [int(c) for c in args.concurrency.split(",")]:
            s0, c0 = batch_stats(url)
            r = asyncio.run(drive(url, good, args.requests, conc))
            s1, c1 = batch_stats(url)
            mean = (s1 - s0) / max(c1 - c0, 1)
            print(f"{conc:>11} {r['rps']:>8.1f} {r['p50']:>8.1f} {r['p99']:>8.1f} {mean:>10.2f} "
                  f"{r['good_errors']:>11} {r['bad_right']:>7}/{r['bad_right'] + r['bad_wrong']}")
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
