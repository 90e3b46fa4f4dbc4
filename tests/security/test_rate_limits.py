"""The rate limits hold under concurrency: many requests at once never get more through than the
limit (the counters are one Redis script call per request, shared by every api process).

* the Documents API: 25 requests per minute per application (core document section 8), against the
  test session's api;
* the per-IP rules (``app/ratelimit.py``): a second api on the same Redis with the limits on and a
  small ``token-list`` count (the test session's api runs with them off).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import free_port, serve_in_thread
from tests.helpers import ApiClient, in_one_minute_window

THREADS = 16


def _burst(call, count: int) -> list[int]:
    """The statuses of ``count`` calls, ``THREADS`` at a time, all in one window of the limits."""
    in_one_minute_window(15)
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        return list(pool.map(lambda _: call().status, range(count)))


def test_the_documents_limit_holds_under_concurrency(api, tenant, limited):
    client = limited(tenant, ["document:read"])  # an application of its own: its own minute
    statuses = _burst(lambda: client.get(f"/documents/{uuid.uuid4()}"), 60)
    assert statuses.count(429) == 35, statuses  # 25 through (404: nothing there), every other one refused
    assert set(statuses) == {404, 429}


def test_the_per_ip_limits_hold_under_concurrency(api, tenant):
    from app.main import init_app
    from config.settings import get_settings

    settings = get_settings().model_copy(
        update={
            "rate_limit_enabled": True,
            "rate_limit_token_list": 20,
            "rate_limit_window_seconds": 60,
            "rate_limit_block_seconds": 60,
        }
    )
    port = free_port()
    stop = serve_in_thread(lambda: init_app(settings), port)
    try:
        client = ApiClient(f"http://127.0.0.1:{port}", tenant.api_key)
        statuses = _burst(lambda: client.get("/v2/tokens"), 50)
        assert statuses.count(200) == 20 and statuses.count(429) == 30, statuses
        blocked = client.get("/v2/tokens")
        assert blocked.status == 429 and int(blocked.headers["Retry-After"]) > 0
    finally:
        stop()
        from tests.conftest import REDIS_PREFIX, run_redis

        store = run_redis()  # the loopback address's counters, for later tests
        for key in store.scan_iter(match=f"{REDIS_PREFIX}tessera:rl:*", count=1000):
            store.delete(key)
        store.close()
