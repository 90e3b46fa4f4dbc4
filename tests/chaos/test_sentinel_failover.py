"""Redis Sentinel failover under the platform: the master is killed (SIGKILL), the sentinel promotes
the replica, and the platform follows it without losing a job.

The platform (``tests/chaos/platform.py``: real ``tessera api``, ``beat`` and ``worker`` processes)
reaches a Sentinel group of its own (``tests/factories/sentinel.py``: a master behind a password, one
replica, one sentinel behind a password of its own, the master held down after 1 s) through
``sentinel://`` URLs for the broker and for its Redis. A job submitted while the failover runs
completes once; a job submitted after it completes within the api's bounded wait, and the wait is
woken by the job's outcome message on the new master (the database safety net is set far past the
wait, so nothing else could end it in time). Skipped, with the reason, where ``redis-server`` is missing.
"""

from __future__ import annotations

import shutil
import time

import pytest

from tests.chaos.platform import platform
from tests.chaos.test_worker_kill import YEAR, _provision, _provisioned, _provisioned_once
from tests.factories.agentic import fresh_visa
from tests.factories.sentinel import sentinel_group
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.sentinel,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server to run a Sentinel group"),
]

#: The api's bounded wait for a network token (seconds), and the database re-read behind the outcome
#: message, set past it: a wait that ends with the token active within the wait was woken by the message.
WAIT_SECONDS = 10
POLL_SECONDS = 60


def _followed(group, port: int) -> bool:
    """The platform is on the server on ``port``: a worker blocked on its queues and the api's
    job-outcome subscription."""
    clients = group.node(port).client_list()
    return any(c.get("cmd") == "brpop" for c in clients) and any(c.get("psub", "0") != "0" for c in clients)


def test_the_platform_follows_a_sentinel_failover_without_losing_a_job(redis_flushed, s3_server):
    with sentinel_group(down_after_ms=1000, failover_timeout_ms=2000) as group:
        settings = {
            **group.settings(),
            "TESSERA_NETWORK_TOKEN_WAIT_SECONDS": str(WAIT_SECONDS),
            "TESSERA_JOB_WAIT_POLL_SECONDS": str(POLL_SECONDS),
        }
        with platform("sentinel", settings) as p:
            p.start_worker()
            before = _provision(p)
            wait_until(lambda: _provisioned(p, before), timeout=30, interval=0.2)
            assert group.master_address() == ("127.0.0.1", group.master_port)
            assert _followed(group, group.master_port)

            group.kill("master")
            killed = time.monotonic()
            during = _provision(p)  # recorded while the master is gone; its request waits for the job
            answered = time.monotonic() - killed
            wait_until(lambda: group.master_address()[1] == group.replica_port, timeout=20, interval=0.1)
            promoted = time.monotonic() - killed
            wait_until(lambda: _followed(group, group.replica_port), timeout=30, interval=0.2)
            followed = time.monotonic() - killed

            started = time.monotonic()
            after = p.client.post(
                "/network-tokens",
                {"data": {"number": fresh_visa(), "expiration_month": 12, "expiration_year": YEAR}},
            )
            took = time.monotonic() - started
            assert after.status == 201, after  # settled within the wait: woken by the outcome message
            assert after.json["status"] == "active" and took < WAIT_SECONDS, (after.json["status"], took)

            wait_until(lambda: _provisioned(p, during), timeout=30, interval=0.2)
            for subject in (before, during):
                _provisioned_once(p, subject)
            assert not p.unfinished_work()
            print(
                f"sentinel failover: a request recording a job at the kill answered after {answered:.1f} s; the "
                f"replica was the master after {promoted:.1f} s, worker and api on it after {followed:.1f} s; a job "
                f"submitted then answered in {took:.2f} s"
            )
