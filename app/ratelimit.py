"""Per-client-IP rate limits (spec, core document section 8), kept in Redis or in process.

Each rule counts requests in fixed windows of ``TESSERA_RATE_LIMIT_WINDOW_SECONDS``; the request
that exceeds a rule's count blocks that IP for that rule for ``TESSERA_RATE_LIMIT_BLOCK_SECONDS``
and every request meanwhile answers 429 with ``Retry-After``; when the block ends the rule's count
starts again from zero (a client that waited out its block is not blocked again by the requests that
got it blocked, however long the window). Rules:

* ``global``: every request, ``TESSERA_RATE_LIMIT_GLOBAL`` (1000) per window;
* ``token-create``: ``POST /tokens``, ``POST /tokenize`` and the payment-forwarding tokenize,
  ``TESSERA_RATE_LIMIT_TOKEN_CREATE`` (200);
* ``token-list``: ``GET /tokens`` and ``GET /v2/tokens``, ``TESSERA_RATE_LIMIT_TOKEN_LIST`` (100);
* ``token-search``: ``POST /tokens/search`` and ``POST /v2/tokens/search``,
  ``TESSERA_RATE_LIMIT_TOKEN_SEARCH`` (50).

The Documents API counts per application rather than per IP (:func:`minute_limiter`, rule
:data:`DOCUMENTS_RULE`): ``TESSERA_RATE_LIMIT_DOCUMENTS_PER_MINUTE`` (25) per minute, blocked for a
minute past it, whatever ``TESSERA_RATE_LIMIT_ENABLED`` says.

The application factory (``app/main.py``) makes the limiters and the one Redis client they share, and
closes that client. With ``TESSERA_REDIS_URL`` set the counters are shared by every api process (one Lua script call per
request); without it each process counts on its own, and so does a process whose Redis fails or does
not answer within a second (logged at most once a minute) until Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from config.settings import Settings

log = logging.getLogger("tessera.ratelimit")

#: How long one request waits for Redis before it is counted in process instead.
_REDIS_TIMEOUT_SECONDS = 1.0

_SCRIPT = """
local blocked = 0
for i = 1, #KEYS, 2 do
  local ttl = redis.call('PTTL', KEYS[i + 1])
  if ttl > 0 then blocked = math.max(blocked, ttl) end
end
if blocked > 0 then return math.ceil(blocked / 1000) end
local window = tonumber(ARGV[1])
local block = tonumber(ARGV[2])
for i = 1, #KEYS, 2 do
  local count = redis.call('INCR', KEYS[i])
  if count == 1 then redis.call('EXPIRE', KEYS[i], window) end
  if count > tonumber(ARGV[2 + (i + 1) / 2]) then
    redis.call('SET', KEYS[i + 1], '1', 'EX', block)
    redis.call('DEL', KEYS[i])
    blocked = block
  end
end
return blocked
"""


#: The Documents API's rule name (counted per application).
DOCUMENTS_RULE = "documents"


@dataclass(frozen=True)
class Rule:
    """A named limit: at most ``limit`` requests per window."""

    name: str
    limit: int


def rules_for(settings: Settings, method: str, path: str) -> list[Rule]:
    """The rules that apply to one request."""
    rules = [Rule("global", settings.rate_limit_global)]
    path = path.rstrip("/") or "/"
    if method == "POST" and path in ("/tokens", "/tokenize", "/connections/psp-forward/tokenize"):
        rules.append(Rule("token-create", settings.rate_limit_token_create))
    elif method == "GET" and path in ("/tokens", "/v2/tokens"):
        rules.append(Rule("token-list", settings.rate_limit_token_list))
    elif method == "POST" and path in ("/tokens/search", "/v2/tokens/search"):
        rules.append(Rule("token-search", settings.rate_limit_token_search))
    return rules


class RateLimiter:
    """Counts requests per (rule, IP); :meth:`hit` returns the seconds to wait, 0 when allowed."""

    def __init__(self, settings: Settings, redis_client=None):
        self._settings = settings
        self._redis = redis_client
        self._script = redis_client.register_script(_SCRIPT) if redis_client is not None else None
        self._counts: dict[tuple[str, str, int], int] = {}
        self._blocked: dict[tuple[str, str], float] = {}
        self._warned_at = -math.inf

    async def hit(self, ip: str, rules: list[Rule]) -> int:
        """Count one request from ``ip`` against ``rules``; the Retry-After seconds or 0."""
        window = self._settings.rate_limit_window_seconds
        block = self._settings.rate_limit_block_seconds
        if self._script is not None:
            slot = int(time.time() // window)
            keys: list[str] = []
            for rule in rules:
                prefix = f"{self._settings.redis_key_prefix}tessera:rl"
                keys += [f"{prefix}:{rule.name}:{ip}:{slot}", f"{prefix}:block:{rule.name}:{ip}"]
            try:
                async with asyncio.timeout(_REDIS_TIMEOUT_SECONDS):
                    return int(await self._script(keys=keys, args=[window, block, *(r.limit for r in rules)]))
            except (RedisError, OSError, TimeoutError) as exc:
                # Redis down or stalled: count in this process rather than fail every request.
                self._warn_degraded(exc)
        return self._hit_in_process(ip, rules, window, block)

    def _warn_degraded(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning("rate limits counted in process: Redis is unavailable (%s)", type(exc).__name__)

    def _hit_in_process(self, ip: str, rules: list[Rule], window: int, block: int) -> int:
        now = time.monotonic()
        waits = [self._blocked.get((rule.name, ip), 0) - now for rule in rules]
        if max(waits) > 0:
            return max(1, math.ceil(max(waits)))
        slot = int(time.time() // window)
        if len(self._counts) > 100_000:
            self._counts = {k: v for k, v in self._counts.items() if k[2] == slot}
        if len(self._blocked) > 100_000:
            self._blocked = {k: until for k, until in self._blocked.items() if until > now}
        retry = 0
        for rule in rules:
            key = (rule.name, ip, slot)
            self._counts[key] = self._counts.get(key, 0) + 1
            if self._counts[key] > rule.limit:
                self._blocked[(rule.name, ip)] = now + block
                del self._counts[key]  # the count starts afresh when the block ends
                retry = block
        return retry


def minute_limiter(settings: Settings, redis_client=None) -> RateLimiter:
    """A :class:`RateLimiter` counting in windows of one minute, blocked for one minute past a limit
    (the Documents API's, per application: spec section 8)."""
    minute = settings.model_copy(update={"rate_limit_window_seconds": 60, "rate_limit_block_seconds": 60})
    return RateLimiter(minute, redis_client)
