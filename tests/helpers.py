"""Test helpers: a plain HTTP client for the API and a real webhook receiver."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import urllib3

from tests.security.leaks import observe

_HTTP = urllib3.PoolManager(num_pools=4, maxsize=16, retries=False, timeout=urllib3.Timeout(30))


@dataclass
class Response:
    """An HTTP answer: status, headers (case-insensitive) and the parsed JSON body (or None)."""

    status: int
    headers: Any
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw) if self.raw else None

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.raw[:500]!r}>"


PROBLEM = "application/problem+json"


def assert_problem(answer: Response, status: int, prefix: str = "TS") -> dict:
    """``answer`` is an RFC 7807 problem with ``status``, carrying a trace id; returns its body."""
    assert answer.status == status, answer
    assert answer.headers["Content-Type"].split(";")[0] == PROBLEM, answer.headers
    body = answer.json
    assert isinstance(body.get("type"), str) and body["type"]
    assert isinstance(body.get("title"), str) and body["title"]
    assert body.get("status") == status
    assert answer.headers.get(f"{prefix}-TRACE-ID"), "every answer carries a trace id"
    return body


@dataclass
class ApiClient:
    """Calls the API over real HTTP with an API key in the ``<prefix>-API-KEY`` header."""

    base_url: str
    api_key: str | None = None
    prefix: str = "TS"

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        content_type: str = "application/json",
    ) -> Response:
        all_headers = {}
        if self.api_key is not None:
            all_headers[f"{self.prefix}-API-KEY"] = self.api_key
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
        if data is not None:
            all_headers["Content-Type"] = content_type
        all_headers.update(headers or {})
        answer = _HTTP.request(method, self.base_url + path, body=data, headers=all_headers, redirect=False)
        if answer.status >= 400 and f"{self.prefix}-TRACE-ID" in answer.headers:
            observe("problem details", answer.data)  # the platform's (the sandbox's own are not scanned)
        return Response(answer.status, answer.headers, answer.data)

    def get(self, path: str, **kw) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw) -> Response:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body: Any = None, **kw) -> Response:
        return self.request("PUT", path, body, **kw)

    def patch(self, path: str, body: Any = None, **kw) -> Response:
        return self.request("PATCH", path, body, **kw)

    def delete(self, path: str, **kw) -> Response:
        return self.request("DELETE", path, **kw)

    def with_key(self, api_key: str | None) -> ApiClient:
        return ApiClient(self.base_url, api_key, self.prefix)


@dataclass
class Received:
    """One request a :class:`WebhookReceiver` got."""

    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class WebhookReceiver:
    """A real HTTP server on loopback that records POSTs and answers with ``status`` (settable).

    ``hold_next = n``: the next n POSTs are recorded, then their answers wait until ``release`` is
    set (``held`` is set when one arrives): a sender can be killed while it waits for the answer."""

    status: int = 200
    received: list[Received] = field(default_factory=list)
    delay: float = 0.0
    hold_next: int = 0
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def start(self) -> WebhookReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if receiver.delay:
                    time.sleep(receiver.delay)
                if "webhook-signature" in self.headers:
                    observe("webhook deliveries", body)
                receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if receiver.hold_next > 0:
                    receiver.hold_next -= 1
                    receiver.held.set()
                    receiver.release.wait(120)
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/hook"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, predicate, timeout: float = 20.0) -> list[Received]:
        """Wait until some received requests satisfy ``predicate``; return them (or fail)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [r for r in list(self.received) if predicate(r)]
            if hits:
                return hits
            time.sleep(0.05)
        raise AssertionError(f"no matching webhook within {timeout} s; got {len(self.received)} requests")


def race(take, owners=("a", "b"), timeout: float = 30.0) -> dict[str, list]:
    """Run ``take(owner)`` (a list of what that owner got) in one thread per owner, released together
    by a barrier; returns ``{owner: what it got}`` once all are done."""
    got: dict[str, list] = {}
    start = threading.Barrier(len(owners))

    def run(owner: str) -> None:
        start.wait()
        got[owner] = take(owner)

    threads = [threading.Thread(target=run, args=(owner,)) for owner in owners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return got


def in_one_minute_window(needs: float) -> None:
    """Wait, when the current fixed minute window of the rate limits (``app/ratelimit.py``: slots of
    ``time.time() // 60``) has less than ``needs`` seconds left, for the next one to start: what
    follows then counts in one window, never split across two (each would count up to its limit)."""
    left = 60 - time.time() % 60
    if left < needs:
        time.sleep(left + 0.1)


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05):
    """Poll ``predicate()`` until it returns something truthy; return it, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
