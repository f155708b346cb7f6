"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ended by a NUL byte on the browser's fds 3 and 4), so no websocket client, no
browser package and no port: a page is loaded, a file given to its ``<input type=file>`` as a
person picking it would (``DOM.setFileInputFiles`` fires the input's change event), the DOM read
with ``Runtime.evaluate``, the page captured with ``Page.captureScreenshot``."""
from __future__ import annotations

import base64
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find() -> str | None:
    return next((p for p in map(shutil.which, BINARIES) if p), None)


class CDPError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page (``with Chromium(path) as b: b.open(url) ...``)."""

    def __init__(self, binary: str, width: int = 1100, height: int = 760):
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="brewnet-chromium-")
        to_browser_r, self._out = os.pipe()
        self._in, from_browser_w = os.pipe()
        # the child's fds 3 and 4, placed above 10 first so dup2 cannot clobber one with the other
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser_r, from_browser_w)]
        os.close(to_browser_r)
        os.close(from_browser_w)

        def fds():
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=fds, pass_fds=(3, 4))
        for fd in high:
            os.close(fd)
        self._ids = itertools.count(1)
        self._answers: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()
        self.session = None

    # -- the protocol ---------------------------------------------------------------------------
    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for m in messages:
                msg = json.loads(m)
                if "id" in msg:
                    with self._cond:
                        self._answers[msg["id"]] = msg
                        self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def send(self, method: str, timeout: float = 60, **params) -> dict:
        i = next(self._ids)
        msg = {"id": i, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while i not in self._answers:
                if self._closed:
                    raise CDPError(f"{method}: the browser closed its pipe")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CDPError(f"{method}: no answer in {timeout} s")
                self._cond.wait(left)
            answer = self._answers.pop(i)
        if "error" in answer:
            raise CDPError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    # -- what a test does -----------------------------------------------------------------------
    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && document.body !== null")

    def evaluate(self, expression: str):
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise CDPError(f"{expression}: {r['exceptionDetails'].get('text')}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise CDPError(f"waited {timeout} s for {expression}")
            time.sleep(0.1)

    def pick_file(self, selector: str, path: str) -> None:
        root = self.send("DOM.getDocument")["root"]["nodeId"]
        node = self.send("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        if not node:
            raise CDPError(f"no element {selector}")
        self.send("DOM.setFileInputFiles", files=[os.path.abspath(path)], nodeId=node)

    def screenshot(self, path) -> None:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except CDPError:
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
