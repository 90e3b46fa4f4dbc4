"""Bank account verification: ``POST /bank-verification/accounts/verify``.

Body ``{routing_number, account_number}`` (strings of digits); answers 200 ``{status}`` decided by
the account alone (``sandbox/README.md``, "Bank account verification"): :data:`OUTCOMES` for the
routing number :data:`ROUTING_NUMBER`, ``error`` for every other account (unknown to the provider).
"""

from __future__ import annotations

from aiohttp import web

from sandbox.replies import invalid_request, read_json_object

#: The routing number of the sandbox's test accounts.
ROUTING_NUMBER = "021000021"
#: Account number -> status, for :data:`ROUTING_NUMBER`.
OUTCOMES = {"00001": "enabled", "00002": "disabled", "00003": "error"}
routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """Add the verification route to ``app`` (no state: every answer follows from the account)."""
    app.add_routes(routes)


def outcome(routing_number: str, account_number: str) -> str:
    """The status the sandbox answers for an account."""
    if routing_number != ROUTING_NUMBER:
        return "error"
    return OUTCOMES.get(account_number, "error")


@routes.post("/bank-verification/accounts/verify")
async def verify(request: web.Request) -> web.Response:
    """200 ``{status}``; 400 ``invalid_request`` unless both numbers are strings of digits."""
    body = await read_json_object(request)
    errors = {
        field: "must be a string of digits"
        for field in ("routing_number", "account_number")
        if not isinstance(body.get(field), str) or not body[field].isdigit()
    }
    if errors:
        raise invalid_request(errors)
    return web.json_response({"status": outcome(body["routing_number"], body["account_number"])})
