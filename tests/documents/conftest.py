"""Fixtures of the documents tests: a second api whose documents limits are small."""

from __future__ import annotations

import pytest

from tests.conftest import RunningApi, free_port, serve_in_thread

SMALL_DOCUMENT_MAX_BYTES = 2 * 1024 * 1024
SMALL_DOCUMENTS_PER_MINUTE = 3


@pytest.fixture(scope="module")
def small_limits_api(api) -> RunningApi:
    """A second api (same database, worker and S3) with a 2 MiB document cap and 3 document requests
    per minute per application."""
    from app.main import init_app
    from config.settings import get_settings

    settings = get_settings().model_copy(
        update={
            "document_max_bytes": SMALL_DOCUMENT_MAX_BYTES,
            "rate_limit_documents_per_minute": SMALL_DOCUMENTS_PER_MINUTE,
        }
    )
    port = free_port()
    stop = serve_in_thread(lambda: init_app(settings), port)
    yield RunningApi(f"http://127.0.0.1:{port}")
    stop()
