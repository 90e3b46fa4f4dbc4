"""The wallet session gateway (wallet-a): domain registration and merchant validation.

Routes (``sandbox/README.md``, "Wallet session gateway"), one registry per environment
(``sandbox`` or ``production``; a domain registered in one is unknown to the other):

* ``POST /wallet-gateway/{environment}/domains`` ``{merchant_id, domain}``: 200 ``{domain, status:
  "verified"}``;
* ``POST /wallet-gateway/{environment}/domains/remove`` ``{merchant_id, domain}``: 204 (also when
  unknown);
* ``POST /wallet-gateway/{environment}/paymentservices/paymentSession`` ``{merchantIdentifier,
  displayName, initiative: "web", initiativeContext: <domain>}``: 200 an opaque merchant session when
  the domain is registered for the merchant in that environment and ``displayName`` has 1 to 64
  characters; 400 ``{statusMessage}`` (the provider's own rejection) otherwise. The display name
  ``SANDBOX-UNAVAILABLE`` answers 503 (the gateway is down).
"""

from __future__ import annotations

import secrets
import time

from aiohttp import web

from sandbox.replies import read_json_object
from sandbox.state import SANDBOX

ENVIRONMENTS = ("sandbox", "production")
UNAVAILABLE = "SANDBOX-UNAVAILABLE"
routes = web.RouteTableDef()


class Registry:
    """Registered ``(environment, merchant id, domain)`` triples."""

    def __init__(self) -> None:
        self.domains: set[tuple[str, str, str]] = set()

    def clear(self) -> None:
        """Forget every registration."""
        self.domains.clear()


REGISTRY = web.AppKey("wallet_gateway", Registry)


def setup(app: web.Application) -> None:
    """Add the gateway's state and routes to ``app``."""
    app[REGISTRY] = app[SANDBOX].register(Registry())
    app.add_routes(routes)


def _environment(request: web.Request) -> str:
    environment = request.match_info["environment"]
    if environment not in ENVIRONMENTS:
        raise web.HTTPNotFound()
    return environment


def _rejected(message: str) -> web.Response:
    return web.json_response({"statusCode": "400", "statusMessage": message}, status=400)


@routes.post("/wallet-gateway/{environment}/domains")
async def register_domain(request: web.Request) -> web.Response:
    """Register a domain for a merchant (the platform verified its association file)."""
    environment = _environment(request)
    body = await read_json_object(request)
    merchant, domain = str(body.get("merchant_id") or ""), str(body.get("domain") or "").lower()
    if not merchant or not domain:
        return _rejected("merchant_id and domain are required")
    request.app[REGISTRY].domains.add((environment, merchant, domain))
    return web.json_response({"domain": domain, "status": "verified"})


@routes.post("/wallet-gateway/{environment}/domains/remove")
async def remove_domain(request: web.Request) -> web.Response:
    """Forget a domain of a merchant."""
    environment = _environment(request)
    body = await read_json_object(request)
    entry = (environment, str(body.get("merchant_id") or ""), str(body.get("domain") or "").lower())
    request.app[REGISTRY].domains.discard(entry)
    return web.Response(status=204)


@routes.post("/wallet-gateway/{environment}/paymentservices/paymentSession")
async def payment_session(request: web.Request) -> web.Response:
    """Merchant validation: an opaque merchant session, or the provider's rejection."""
    environment = _environment(request)
    body = await read_json_object(request)
    merchant = str(body.get("merchantIdentifier") or "")
    domain = str(body.get("initiativeContext") or "").lower()
    display_name = body.get("displayName")
    if display_name == UNAVAILABLE:
        return web.json_response({"statusMessage": "service unavailable"}, status=503)
    if body.get("initiative") != "web":
        return _rejected("initiative must be web")
    if (environment, merchant, domain) not in request.app[REGISTRY].domains:
        return _rejected(f"Payment Services Exception merchantId={merchant} not registered for domain={domain}")
    if not isinstance(display_name, str) or not 1 <= len(display_name) <= 64:
        return _rejected("displayName must have 1 to 64 characters")
    now = int(time.time() * 1000)
    return web.json_response(
        {
            "epochTimestamp": now,
            "expiresAt": now + 3_600_000,
            "merchantSessionIdentifier": f"SSH{secrets.token_hex(16).upper()}",
            "nonce": secrets.token_hex(4),
            "merchantIdentifier": merchant,
            "domainName": domain,
            "displayName": display_name,
            "signature": secrets.token_hex(64),
            "operationalAnalyticsIdentifier": f"{display_name}:{secrets.token_hex(8).upper()}",
            "retries": 0,
        }
    )
