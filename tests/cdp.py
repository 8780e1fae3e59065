"""A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe``, stdlib only.

The browser tests need four things from a real browser: load a page, hear about console errors,
exceptions and network requests, evaluate JavaScript, and set the viewport. Over the pipe
transport that is JSON messages separated by NUL bytes on file descriptors 3 (to the browser)
and 4 (from it): no port to pick, no HTTP handshake, no websocket framing, no third-party
package. Every wait is on a protocol message with a deadline; nothing sleeps.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_browser() -> str | None:
    """``$AG_CHROMIUM`` if set, else the first Chromium-family browser on PATH."""
    env = os.environ.get("AG_CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class CDPError(RuntimeError):
    pass


def _high_fd(fd: int) -> int:
    """Move ``fd`` to 10 or above, so the child can dup2 onto 3 and 4 without clobbering it."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


class Browser:
    """One headless Chromium with one page (a flattened target session)."""

    def __init__(self, binary: str, *, timeout: float = 20.0, width: int = 1280, height: int = 900):
        self.timeout = timeout
        self.events: list[Message] = []
        self._next_id = 0
        self._buf = b""
        self._profile = tempfile.mkdtemp(prefix="ag-chromium-")
        to_child_r, self._to_child = (_high_fd(fd) for fd in os.pipe())
        self._from_child, from_child_w = (_high_fd(fd) for fd in os.pipe())

        def wire() -> None:  # in the child, before exec: fd 3 reads commands, fd 4 writes replies
            os.dup2(to_child_r, 3)  # dup2 makes them inheritable; every other fd of ours is
            os.dup2(from_child_w, 4)  # non-inheritable (PEP 446), so close_fds=False leaks nothing

        args = [binary, "--headless", "--no-sandbox", "--remote-debugging-pipe", f"--user-data-dir={self._profile}",
                "--no-first-run", "--no-default-browser-check", "--disable-gpu", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", f"--window-size={width},{height}",
                "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=wire,
                                     start_new_session=True)  # its helper processes share this group
        os.close(to_child_r)
        os.close(from_child_w)
        try:
            self.version = self.call("Browser.getVersion")
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.call(f"{domain}.enable", session=True)
            self.set_viewport(width, height)
        except BaseException:
            self.close()
            raise

    # -- transport

    def _send(self, msg: Message) -> None:
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_child, data):]

    def _read_one(self, deadline: float) -> Message:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError(f"no message from the browser within {self.timeout:g} s")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 16)
                if not chunk:
                    raise CDPError(f"the browser closed the pipe (exit status {self.proc.poll()})")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)  # type: ignore[no-any-return]

    def call(self, method: str, params: Message | None = None, *, session: bool = False) -> Any:
        self._next_id += 1
        msg: Message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self._send(msg)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_one(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str, pred: Callable[[Message], bool] = lambda _: True) -> Message:
        """The first event named ``method`` (already received or still to come) that satisfies ``pred``."""
        deadline = time.monotonic() + self.timeout
        seen = 0
        while True:
            for ev in self.events[seen:]:
                if ev.get("method") == method and pred(ev.get("params", {})):
                    return ev
            seen = len(self.events)
            msg = self._read_one(deadline)
            if "method" in msg:
                self.events.append(msg)

    # -- page

    def set_viewport(self, width: int, height: int = 900) -> None:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def load(self, url: str) -> None:
        """Navigate and wait for the load event; events of earlier pages are dropped."""
        self.events.clear()
        result = self.call("Page.navigate", {"url": url}, session=True)
        if result.get("errorText"):
            raise CDPError(f"cannot load {url}: {result['errorText']}")
        self.wait_for("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        """Evaluate ``expression`` in the page and return its JSON value; a thrown error is a CDPError."""
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                      session=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise CDPError(f"{expression!r} threw: {d.get('exception', {}).get('description') or d.get('text')}")
        return r["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and log errors seen since the last load."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description")))
                                                           for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def requests(self) -> list[str]:
        """URLs the page requested since the last load (data: URLs included)."""
        return [ev["params"]["request"]["url"] for ev in self.events if ev.get("method") == "Network.requestWillBeSent"]

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._send({"id": 0, "method": "Browser.close", "params": {}})
                try:
                    self.proc.wait(timeout=self.timeout)
                except subprocess.TimeoutExpired:  # a hung browser: end its process group, helpers too
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        finally:
            for fd in (self._to_child, self._from_child):
                with contextlib.suppress(OSError):
                    os.close(fd)
            shutil.rmtree(self._profile, ignore_errors=True)
