"""Fixtures of the sandbox tests: one sandbox served over real HTTP on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest

from sandbox.app import make_app
from tests.conftest import free_port, serve_in_thread
from tests.helpers import ApiClient
from tests.sandbox import HANG_SECONDS, PENDING_SECONDS, SLOW_SECONDS


@pytest.fixture(scope="session")
def sandbox_url() -> Iterator[str]:
    """Base URL of a sandbox (short delays) served in a background thread's event loop."""
    port = free_port()
    factory = partial(make_app, slow_seconds=SLOW_SECONDS, hang_seconds=HANG_SECONDS, pending_seconds=PENDING_SECONDS)
    stop = serve_in_thread(factory, port)
    yield f"http://127.0.0.1:{port}"
    stop()


@pytest.fixture
def sandbox(sandbox_url: str) -> ApiClient:
    """A plain HTTP client of the sandbox, whose state is reset for this test."""
    client = ApiClient(sandbox_url)
    assert client.post("/_admin/reset").status == 204
    return client
