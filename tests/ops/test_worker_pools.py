"""``tessera worker``: the prefork pool for most queues, and the providers queue on a thread pool of its
own (a second Celery node in the same process group), so provider calls never queue behind the
prefork pool."""

from __future__ import annotations

import os
import signal

import pytest

from infra.celery import create_app
from tessera.worker import providers_command, providers_hostname
from tests.helpers import wait_until


def test_providers_node_names_follow_the_worker_name():
    assert providers_hostname(None) == "celery-providers@%h"
    assert providers_hostname("a@%h") == "a-providers@%h"
    command = providers_command(["--concurrency", "1", "--hostname", "b@%h"])
    assert command[-8:] == ["-Q", "providers", "-P", "threads", "-c", "16", "-n", "b-providers@%h"]


def test_tessera_worker_runs_the_providers_queue_on_threads_beside_the_prefork_pool(platform):
    worker = platform.start_worker("--concurrency", "1", "-n", "pools@%h")
    app = create_app(platform.settings())
    try:
        def nodes():
            found = app.control.inspect(timeout=1.0).stats() or {}
            return found if len(found) == 2 else None

        stats = wait_until(nodes, timeout=30, interval=0.5)
        queues = app.control.inspect(timeout=1.0).active_queues()
    finally:
        app.close()
    (prefork,) = [name for name in stats if name.startswith("pools@")]
    (threads,) = [name for name in stats if name.startswith("pools-providers@")]
    assert stats[prefork]["pool"]["implementation"].endswith("prefork:TaskPool")
    assert stats[prefork]["pool"]["max-concurrency"] == 1
    assert stats[threads]["pool"]["implementation"].endswith("thread:TaskPool")
    assert stats[threads]["pool"]["max-concurrency"] == 16
    assert {q["name"] for q in queues[threads]} == {"providers"}
    assert "providers" not in {q["name"] for q in queues[prefork]}
    assert {"default", "webhooks", "files", "mail", "sweeps", "reactors"} <= {q["name"] for q in queues[prefork]}

    worker.signal(signal.SIGTERM)  # a warm shutdown stops both nodes
    assert worker.popen.wait(60) == 0, worker.output()
    with pytest.raises(ProcessLookupError):  # nothing of the group is left: the providers node stopped too
        wait_until(lambda: os.killpg(worker.popen.pid, 0) and None, timeout=30, interval=0.2)
