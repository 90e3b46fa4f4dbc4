"""Fixtures of the tenant administration tests: a real SMTP server on loopback (aiosmtpd) that the
platform's worker sends invitation mails to, and a second api whose documents limits are small.

The worker reads ``TESSERA_SMTP_URL`` and ``TESSERA_PUBLIC_BASE_URL`` from the process settings when a
mail task runs, so :func:`mailbox` points them at the SMTP server and at the test api for the length
of one test and puts them back afterwards (other tests expect the mail file sink).
"""

from __future__ import annotations

import pytest

from tests.admin.support import Mailbox, SmtpSink
from tests.conftest import RunningApi, free_port, serve_in_thread


@pytest.fixture(scope="session")
def smtp_sink():
    """aiosmtpd's ``Controller`` on a free loopback port, collecting every message."""
    sink = SmtpSink(free_port()).start()
    yield sink
    sink.stop()


@pytest.fixture
def mailbox(api, smtp_sink, monkeypatch):
    """The platform's mail goes to ``smtp_sink`` and invitation links point at the test api (this test only)."""
    from config.settings import reload_settings

    monkeypatch.setenv("TESSERA_SMTP_URL", f"smtp://127.0.0.1:{smtp_sink.port}")
    monkeypatch.setenv("TESSERA_PUBLIC_BASE_URL", api.base_url)
    reload_settings()
    yield Mailbox(smtp_sink)
    monkeypatch.undo()
    reload_settings()


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
