"""Tests of the sandbox providers (``sandbox/``), spoken to over real HTTP on loopback.

Helpers shared by the test modules: request bodies, admin look-ups, a client call with its own
timeout, and a sandbox served by ``sandbox.app.run`` in a child process.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3

from tests.conftest import free_port
from tests.helpers import ApiClient, wait_until

SLOW_SECONDS = 1.0
HANG_SECONDS = 3.0
PENDING_SECONDS = 0.5
"""Delays of the sandbox served to the tests (see ``conftest.py``)."""

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def future_year(years: int = 2) -> int:
    """A four-digit year ``years`` after the current one."""
    return datetime.datetime.now(datetime.UTC).year + years


def card(pan: str, **fields: Any) -> dict[str, Any]:
    """A card body ``{pan, expiration_month: 12, expiration_year: <in 2 years>}`` plus ``fields``."""
    return {"pan": pan, "expiration_month": 12, "expiration_year": future_year(), **fields}


def idempotent(key: str) -> dict[str, str]:
    """Request headers carrying ``Idempotency-Key: key``."""
    return {"Idempotency-Key": key}


def admin(client: ApiClient, path: str, **query: str) -> dict[str, Any]:
    """The JSON answer of the admin endpoint ``/_admin/<path>`` filtered by ``query``; asserts 200."""
    answer = client.get(f"/_admin/{path}?{urlencode(query)}")
    assert answer.status == 200, answer
    return answer.json


def post_with_timeout(
    base_url: str, path: str, body: Any, timeout: float, headers: dict[str, str] | None = None
) -> urllib3.BaseHTTPResponse | None:
    """POST ``body`` as JSON, giving up after ``timeout`` seconds: the answer, or None on timeout."""
    try:
        return urllib3.request("POST", base_url + path, json=body, headers=headers, timeout=timeout, retries=False)
    except urllib3.exceptions.ReadTimeoutError:
        return None


@contextmanager
def sandbox_process(**environment: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``sandbox.app.run`` in a child process with extra ``environment``; yields it and its base URL.

    The process is stopped with SIGTERM (if still running) on exit.
    """
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", f"from sandbox.app import run; run('127.0.0.1', {port})"]
    with subprocess.Popen(
        command,
        cwd=PROJECT_ROOT,
        env={**os.environ, **environment},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            wait_until(lambda: _healthy(base_url), timeout=20)
            yield process, base_url
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(10)


def _healthy(base_url: str) -> bool:
    """True once ``GET /health`` answers 200."""
    try:
        return urllib3.request("GET", base_url + "/health", retries=False, timeout=1).status == 200
    except urllib3.exceptions.HTTPError:
        return False
