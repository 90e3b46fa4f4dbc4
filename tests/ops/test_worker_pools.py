"""``tessera worker``: the prefork pool for most queues, and the providers and reactors queues each on a
thread pool of its own (Celery nodes in the same process group), so provider calls and customer code
never queue behind the prefork pool (nor reactor runs behind webhook deliveries, mail and sweeps)."""

from __future__ import annotations

import os
import signal

import pytest

from infra.celery import create_app
from tessera.worker import child_command, child_hostname
from tests.helpers import wait_until


def test_thread_pool_node_names_follow_the_worker_name():
    assert child_hostname(None) == "celery-providers@%h"
    assert child_hostname("a@%h") == "a-providers@%h"
    assert child_hostname("a@%h", "reactors") == "a-reactors@%h"
    command = child_command(["--concurrency", "1", "--hostname", "b@%h"])
    assert command[-8:] == ["-Q", "providers", "-P", "threads", "-c", "16", "-n", "b-providers@%h"]
    command = child_command(["--hostname", "b@%h"], "reactors")
    assert command[-8:] == ["-Q", "reactors", "-P", "threads", "-c", "8", "-n", "b-reactors@%h"]


def test_tessera_worker_runs_the_providers_and_reactors_queues_on_threads_beside_the_prefork_pool(platform):
    worker = platform.start_worker("--concurrency", "1", "-n", "pools@%h")
    app = create_app(platform.settings())
    try:

        def nodes():
            found = app.control.inspect(timeout=1.0).stats() or {}
            return found if len(found) == 3 else None

        stats = wait_until(nodes, timeout=30, interval=0.5)
        queues = app.control.inspect(timeout=1.0).active_queues()
    finally:
        app.close()
    (prefork,) = [name for name in stats if name.startswith("pools@")]
    (threads,) = [name for name in stats if name.startswith("pools-providers@")]
    (code,) = [name for name in stats if name.startswith("pools-reactors@")]
    assert stats[prefork]["pool"]["implementation"].endswith("prefork:TaskPool")
    assert stats[prefork]["pool"]["max-concurrency"] == 1
    assert stats[threads]["pool"]["implementation"].endswith("thread:TaskPool")
    assert stats[threads]["pool"]["max-concurrency"] == 16
    assert {q["name"] for q in queues[threads]} == {"providers"}
    assert stats[code]["pool"]["implementation"].endswith("thread:TaskPool")
    assert stats[code]["pool"]["max-concurrency"] == 8
    assert {q["name"] for q in queues[code]} == {"reactors"}
    assert not {"providers", "reactors"} & {q["name"] for q in queues[prefork]}
    assert {"default", "webhooks", "files", "mail", "sweeps"} <= {q["name"] for q in queues[prefork]}

    worker.signal(signal.SIGTERM)  # a warm shutdown stops every node
    assert worker.popen.wait(60) == 0, worker.output()
    with pytest.raises(ProcessLookupError):  # nothing of the group is left: the thread-pool nodes stopped too
        wait_until(lambda: os.killpg(worker.popen.pid, 0) and None, timeout=30, interval=0.2)
