"""A real headless Chromium for the browser tests (Debian's ``chromium``, ``scripts/chromium.sh``).

:data:`CHROMIUM` is None when it is not installed: the browser tests skip with :data:`SKIP_REASON`.
:class:`Browser` drives one page through the DevTools protocol (aiohttp's websocket client): open a
URL, type into inputs, click, and read the page the browser shows, as a person would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = "Chromium is not installed (scripts/chromium.sh installs Debian's chromium): browser test not run"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Browser:
    """One headless Chromium with a fresh profile and one page; use as a context manager."""

    def __init__(self, profile_parent: Path, timeout: float = 30) -> None:
        # Chromium's helper processes may still be writing the profile as it is removed.
        self._profile = tempfile.TemporaryDirectory(dir=profile_parent, ignore_cleanup_errors=True)
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._process: subprocess.Popen | None = None
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._events: list[dict] = []

    def __enter__(self) -> Browser:
        log = Path(self._profile.name) / "chromium.log"
        with log.open("wb") as sink:
            self._process = subprocess.Popen(
                [
                    CHROMIUM,
                    *CHROMIUM_FLAGS,
                    f"--user-data-dir={self._profile.name}/profile",
                    "--remote-debugging-port=0",
                    "about:blank",
                ],
                stdout=subprocess.DEVNULL,
                stderr=sink,
                start_new_session=True,  # its own process group: stopped with every helper process
            )
        endpoint = None
        deadline = time.monotonic() + self.timeout
        while endpoint is None and time.monotonic() < deadline and self._process.poll() is None:
            # Chromium says "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID" on stderr.
            found = re.search(r"DevTools listening on (ws://\S+)", log.read_text(errors="replace"))
            endpoint = found.group(1) if found else time.sleep(0.1)
        assert endpoint, "Chromium did not open its DevTools endpoint: " + log.read_text(errors="replace")[-2000:]
        self._loop.run_until_complete(self._attach(endpoint))
        return self

    def __exit__(self, *_exc) -> None:
        try:
            self._loop.run_until_complete(self._close())
        finally:
            self._loop.close()
            if self._process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait(10)
            self._profile.cleanup()

    async def _attach(self, endpoint: str) -> None:
        self._session = aiohttp.ClientSession()
        base = "http://" + endpoint.removeprefix("ws://").split("/", 1)[0]
        async with self._session.get(base + "/json/list") as answer:
            pages = [t for t in await answer.json(content_type=None) if t["type"] == "page"]
        self._socket = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        await self._call("Page.enable")
        await self._call("Runtime.enable")

    async def _close(self) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, **params) -> dict:
        number = next(self._ids)
        await self._socket.send_str(json.dumps({"id": number, "method": method, "params": params}))
        async with asyncio.timeout(self.timeout):
            while True:
                message = json.loads((await self._socket.receive()).data)
                if message.get("id") == number:
                    assert "error" not in message, message
                    return message.get("result", {})
                self._events.append(message)

    async def _wait_for_event(self, method: str) -> dict:
        async with asyncio.timeout(self.timeout):
            while True:
                for event in self._events:
                    if event.get("method") == method:
                        self._events.remove(event)
                        return event
                self._events.append(json.loads((await self._socket.receive()).data))

    def open(self, url: str) -> None:
        """Navigate to ``url`` and wait until the page has loaded."""
        self._events.clear()
        self._loop.run_until_complete(self._call("Page.navigate", url=url))
        self._loop.run_until_complete(self._wait_for_event("Page.loadEventFired"))

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (as the DevTools console would give it)."""
        result = self._loop.run_until_complete(
            self._call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        )
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element and type ``text`` into it, key by key."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self._loop.run_until_complete(self._call("Input.insertText", text=text))

    def click_and_wait(self, selector: str) -> None:
        """Click the element (a real mouse click at its centre) and wait for the page it leads to."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        self._events.clear()
        for kind in ("mousePressed", "mouseReleased"):
            self._loop.run_until_complete(
                self._call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)
            )
        self._loop.run_until_complete(self._wait_for_event("Page.loadEventFired"))

    def text(self) -> str:
        """The text the page shows."""
        return self.evaluate("document.body.innerText")
