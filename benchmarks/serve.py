"""Load test of ``brewnet serve``: starts the server on loopback, drives it from a separate client
process at concurrency 1, 8 and 32 for a bounded number of requests, mixes in bad requests (1 in
10: wrong content type or a truncated image), stops the server, and prints requests/s, p50/p99
latency, mean batch size, error counts, and the CPU seconds per request of the server and of
the client (the two share the machine's cores, so the client's cost is part of the result).

    python benchmarks/serve.py lenet        # or: open_nsfw, or --model M --weights W ...
    python benchmarks/serve.py lenet --requests 2000 --concurrency 1,8,32 --body jpeg,npy

The client keeps one HTTP/1.1 keep-alive connection per concurrent worker and writes prepared
request bytes on asyncio streams: 0.1-0.25 ms of CPU per request on the shared 2 cores, where
an httpx client (`--client httpx`, the earlier load generator) spent 3-4 ms, more than the
LeNet server itself.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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
INPUT = {"lenet": (1, 28, 28), "open_nsfw": (3, 224, 224)}


def bodies(preset: str, kind: str) -> tuple[bytes, str]:
    """(body, content type) of a good request: a JPEG of the shared coffee picture, or the same
    picture already shaped as the net input (.npy)."""
    from PIL import Image

    im = Image.open(M / "images" / "coffee.png").convert("L" if preset == "lenet" else "RGB")
    if kind == "jpeg":
        buf = io.BytesIO()
        im.resize((28, 28) if preset == "lenet" else (256, 256)).save(buf, "JPEG", quality=90)
        return buf.getvalue(), "image/jpeg"
    c, h, w = INPUT[preset]
    x = np.asarray(im.resize((w, h)), np.float32).reshape(h, w, c).transpose(2, 0, 1) / 255
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(x))
    return buf.getvalue(), "application/x-npy"


def request(port: int, body: bytes, ctype: str) -> bytes:
    return (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_of(pid: int) -> float:
    """User + system CPU seconds so far of a process (all its threads) and of its live child
    processes (``--workers N``), from /proc."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(cpu_of(int(c)) for c in f.read().split())
    except FileNotFoundError:        # gone meanwhile
        pass
    return total


async def _raw(port, reqs, n, conc, lat, codes):
    counter = iter(range(n))

    async def worker():
        reader = writer = None
        for i in counter:
            data, want = reqs[i % len(reqs)]
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(data)
                head = await reader.readuntil(b"\r\n\r\n")
                code = int(head[9:12])
                size = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                await reader.readexactly(size)
                if re.search(rb"(?i)connection: *close", head):
                    writer.close()
                    writer = None
            except (OSError, asyncio.IncompleteReadError, AttributeError, ValueError):
                code, writer = -1, None
            record(lat, codes, want, code, time.perf_counter() - t0)
        if writer is not None:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(conc)))


async def _httpx(port, reqs, n, conc, lat, codes):
    import httpx

    counter = iter(range(n))

    async def worker():
        async with httpx.AsyncClient(timeout=120) as c:
            for i in counter:
                (body, ctype), want = reqs[i % len(reqs)]
                t0 = time.perf_counter()
                try:
                    code = (await c.post(f"http://127.0.0.1:{port}/predict", content=body,
                                         headers={"content-type": ctype})).status_code
                except httpx.HTTPError:
                    code = -1
                record(lat, codes, want, code, time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(conc)))


def record(lat, codes, want, code, seconds):
    if want == 200:
        lat.append(seconds)
        codes["good_errors"] += code != 200
    else:
        codes["bad_right" if code == want else "bad_wrong"] += 1


def client_main(a) -> int:
    """The load generator's process: prints one JSON line with its results and CPU time."""
    good = bodies(a.preset, a.body)
    bad = [(b"not an image", "text/plain", 415), (good[0][: len(good[0]) // 3], good[1], 400)]
    # 1 in 10 bad, alternating between the two kinds
    mix = [(good, 200) if i % 10 else ((bad[(i // 10) % 2][:2]), bad[(i // 10) % 2][2]) for i in range(20)]
    reqs = [(request(a.port, *b), w) for b, w in mix] if a.client == "raw" else mix
    lat, codes = [], {"good_errors": 0, "bad_right": 0, "bad_wrong": 0}
    run = _raw if a.client == "raw" else _httpx
    asyncio.run(run(a.port, reqs, 20, min(a.conc, 4), [], dict(codes)))     # warm-up, not counted
    c0, t0 = cpu_self(), time.perf_counter()
    asyncio.run(run(a.port, reqs, a.requests, a.conc, lat, codes))
    wall, cpu = time.perf_counter() - t0, cpu_self() - c0
    print(json.dumps(dict(codes, wall=wall, cpu=cpu, p50=float(np.percentile(lat, 50)) * 1e3,
                          p99=float(np.percentile(lat, 99)) * 1e3)))
    return 0


def breakdown(preset: str, extra: list[str], max_batch: int) -> None:
    """CPU microseconds per request of each stage, in this process without sockets (this
    thread's CPU time: preemption by other processes does not count)."""
    from brewnet.tools import serve
    from brewnet.tools.serving.app import Limits, create_app

    ap = argparse.ArgumentParser()
    serve.add_arguments(ap)
    args = ap.parse_args([*PRESETS[preset], *extra, "--max-batch", str(max_batch)])
    model, fixed, _, inline = serve.build(args)
    jpeg, npy = bodies(preset, "jpeg")[0], bodies(preset, "npy")[0]
    x = model.prepare_array(npy, "application/x-npy")

    def cpu(fn, n):
        fn()
        c0 = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - c0) / n * 1e6

    import torch

    def fwd(b):
        xb = torch.from_numpy(np.stack([x] * (fixed or b)))
        with torch.inference_mode():
            model.module(xb)

    n = 50 if preset == "lenet" else 5
    rows = [("JPEG decode + Classifier preparation", cpu(lambda: model.prepare_image(jpeg, 10 ** 9), n)),
            (".npy decode", cpu(lambda: model.prepare_array(npy, "application/x-npy"), n)),
            ("JSON decode", cpu(lambda: model.prepare_array(json.dumps(x.tolist()).encode(), "application/json"), n)),
            ("forward, batch 1", cpu(lambda: fwd(1), n)),
            (f"forward, batch {max_batch}, per input", cpu(lambda: fwd(max_batch), n) / max_batch),
            ("top-k answer + JSON body",
             cpu(lambda: json.dumps(model.answer(np.linspace(0, 1, 1000 if preset != "lenet" else 10))), n))]
    app = create_app(model, Limits(max_body=1 << 30, max_pixels=10 ** 9), max_batch, 0.005, fixed, inline)

    async def call(body, ctype):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/predict", "raw_path": b"/predict", "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]}
        msgs = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            return next(msgs, {"type": "http.disconnect"})

        async def send(m):
            if b'"error"' in m.get("body", b""):
                raise RuntimeError(m["body"].decode())
        await app(scope, receive, send)

    async def whole(body, ctype, conc, rounds):
        async with app.router.lifespan_context(app):
            await asyncio.gather(*(call(body, ctype) for _ in range(conc)))
            c0 = time.thread_time()
            for _ in range(rounds):
                await asyncio.gather(*(call(body, ctype) for _ in range(conc)))
            return (time.thread_time() - c0) / (rounds * conc) * 1e6

    for body, ctype in ((jpeg, "image/jpeg"), (npy, "application/x-npy")):
        for conc in (1, max_batch):
            us = asyncio.run(whole(body, ctype, conc, max(n // conc, 3) if preset == "lenet" else 2))
            rows.append((f"whole app in-process, {ctype}, {conc} at once", us))
    print(f"\nwhere a request's CPU goes ({preset}; forwards {'on the event loop' if inline else 'on a thread'}; "
          "the load rows' server CPU less 'whole app' is uvicorn: sockets, HTTP parsing, event loop)")
    for what, us in rows:
        print(f"{what:>48} {us:>10.0f} us")


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)", text, re.M)
    return float(m.group(1)) if m else 0.0


def get(port: int, path: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise OSError(head[:40])
    return body.decode()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", nargs="?", choices=sorted(PRESETS), default="lenet")
    p.add_argument("--requests", type=int, default=1000, help="per row")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--body", default="jpeg", help="good requests as jpeg and/or npy (jpeg,npy: a table each)")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw")
    p.add_argument("--max-batch", default="16")
    p.add_argument("--max-delay-ms", default="5")
    p.add_argument("--breakdown", action="store_true", help="also the CPU time of each stage")
    p.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)   # the client process
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--conc", type=int, help=argparse.SUPPRESS)
    args, extra = p.parse_known_args()
    if args.drive:
        return client_main(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "brewnet.cli", "serve", *PRESETS[args.preset], *extra,
           "--port", str(port), "--max-batch", args.max_batch, "--max-delay-ms", args.max_delay_ms]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                get(port, "/healthz")
                break
            except OSError:
                time.sleep(0.2)
            if server.poll() is not None:
                raise SystemExit(f"the server exited ({server.returncode}): {' '.join(cmd)}")
        print(f"brewnet serve {args.preset}: {args.requests} requests per row (1 in 10 bad), "
              f"--max-batch {args.max_batch} --max-delay-ms {args.max_delay_ms} {' '.join(extra)}; "
              f"{args.client} client in its own process; {os.cpu_count()} CPUs")
        for body in args.body.split(","):
            print(f"\ngood requests: {bodies(args.preset, body)[1]}")
            print(f"{'concurrency':>11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean batch':>10} "
                  f"{'good errors':>11} {'bad: right':>10} {'server CPU ms/req':>17} "
                  f"{'forward ms/req':>14} {'client CPU ms/req':>17}")
            seen = {}
            for conc in [int(c) for c in args.concurrency.split(",")]:
                m0, s0 = get(port, "/metrics"), cpu_of(server.pid)
                out = subprocess.run([sys.executable, __file__, args.preset, "--drive", "--port", str(port),
                                      "--conc", str(conc), "--requests", str(args.requests), "--body", body,
                                      "--client", args.client], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"the client failed: {out.stderr[-2000:]}")
                m1, s1 = get(port, "/metrics"), cpu_of(server.pid)
                r = json.loads(out.stdout.splitlines()[-1])
                d = {k: metric(m1, k) - metric(m0, k) for k in
                     ("brewnet_batch_size_sum", "brewnet_batch_size_count", "brewnet_forward_seconds_sum")}
                n = args.requests
                mean = d["brewnet_batch_size_sum"] / max(d["brewnet_batch_size_count"], 1)
                # the server's CPU also covers the client's 20 warm-up requests
                print(f"{conc:>11} {n / r['wall']:>8.1f} {r['p50']:>8.2f} {r['p99']:>8.1f} {mean:>10.2f} "
                      f"{r['good_errors']:>11} {r['bad_right']:>5}/{r['bad_right'] + r['bad_wrong']:<4} "
                      f"{(s1 - s0) * 1e3 / (n + 20):>17.2f} "
                      f"{d['brewnet_forward_seconds_sum'] * 1e3 / max(d['brewnet_batch_size_sum'], 1):>14.3f} "
                      f"{r['cpu'] * 1e3 / n:>17.2f}", flush=True)
                seen[conc] = (n / r["wall"], (s1 - s0) * 1e3 / (n + 20), r["cpu"] * 1e3 / n)
            lo, hi = min(seen), max(seen)
            if lo != hi:   # throughput gain, next to what batching saved in CPU per request
                (r0, s0, c0), (r1, s1, c1) = seen[lo], seen[hi]
                print(f"c={hi} / c={lo}: {r1 / r0:.2f}x the requests/s; CPU per request "
                      f"{s0 / s1:.2f}x less in the server, {(s0 + c0) / (s1 + c1):.2f}x less in server + client")
    finally:
        server.terminate()
        server.wait(60)
    if args.breakdown:
        breakdown(args.preset, extra, int(args.max_batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
