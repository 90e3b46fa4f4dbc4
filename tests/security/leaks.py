"""The secrets scanner of the whole test run (a pytest plugin loaded by ``tests/conftest.py``).

What it watches, in every test of the run, whichever directories are collected:

* log records of the api and the worker (both run in the test process): the root-logger capture of
  ``tests/ops/conftest.py`` (:data:`CAPTURE`), installed for every test;
* problem details: every 4xx/5xx answer the platform gives a :class:`tests.helpers.ApiClient`;
* webhook event payloads: every signed delivery a :class:`tests.helpers.WebhookReceiver` gets, and at the
  end the ``events`` rows, delivery and attempt errors, job errors and results in the run's database;
* Celery task arguments: every message published (``before_task_publish``), api and worker alike.

Each piece of text is scanned as it passes (``tests/ops/scan.py``: card numbers, CVCs, API keys,
private key PEMs, webhook signing secrets); only the findings are kept, masked, with the test that
was running. ``tests/security/test_secrets.py::test_no_secret_leaks_anywhere`` runs last and fails
on any finding.
"""

from __future__ import annotations

import collections
import json
import os
import threading

import pytest
from celery.signals import before_task_publish

from tests.ops.scan import find_secrets, redact

FINAL_TEST = "test_no_secret_leaks_anywhere"


class Leaks:
    """Counts of what was scanned per channel, and every finding as ``(test, channel, kinds, text)``."""

    def __init__(self) -> None:
        self.scanned: collections.Counter[str] = collections.Counter()
        self.findings: list[tuple[str, str, str, str]] = []
        self._lock = threading.Lock()

    def observe(self, channel: str, text: str | bytes) -> None:
        """Scan ``text`` seen on ``channel`` ("problem details", "task arguments" ...)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        found = find_secrets(text)
        with self._lock:
            self.scanned[channel] += 1
            if found:
                test = os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)")
                self.findings.append((test, channel, ", ".join(sorted(set(found))), redact(text)[:300]))


LEAKS = Leaks()


def observe(channel: str, text: str | bytes) -> None:
    """Scan ``text`` seen on ``channel`` (see :class:`Leaks`)."""
    LEAKS.observe(channel, text)


@before_task_publish.connect(weak=False)
def _task_arguments(sender=None, body=None, headers=None, **_kwargs) -> None:
    """Every task message published in this process: its arguments (protocol 2 body) and headers."""
    observe("task arguments", json.dumps([sender, body, headers], default=str))


#: ``(channel, query)``: what the run's database holds that reaches a receiver, a log or a client.
DATABASE_TEXT = (
    ("event payloads", "SELECT data::text FROM events"),
    ("delivery errors", "SELECT last_error FROM jobs WHERE kind = 'webhooks.deliver' AND last_error IS NOT NULL"),
    ("delivery errors", "SELECT error FROM webhook_attempts WHERE error IS NOT NULL"),
    ("job errors and results", "SELECT coalesce(last_error, '') || ' ' || coalesce(result::text, '') FROM jobs"),
)


def scan_database(url: str) -> int:
    """Scan :data:`DATABASE_TEXT` in the database at ``url``; the number of rows scanned."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    rows = 0
    try:
        with engine.connect() as conn:
            for channel, query in DATABASE_TEXT:
                for (value,) in conn.execute(text(query)):
                    observe(channel, value or "")
                    rows += 1
    finally:
        engine.dispose()
    return rows


def pytest_configure(config):
    """Keep the log capture on the root logger for every test of the run."""
    from tests.ops.conftest import CAPTURE, _KeepCapturing

    CAPTURE.ensure_installed()
    if not config.pluginmanager.has_plugin("tessera-ops-log-capture"):
        config.pluginmanager.register(_KeepCapturing(), "tessera-ops-log-capture")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The final scan runs after every other test."""
    last = [item for item in items if item.name == FINAL_TEST]
    items[:] = [item for item in items if item.name != FINAL_TEST] + last
