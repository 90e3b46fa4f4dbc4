"""The simulated card networks' account updater: one batch call per chunk of rows.

``POST /card-network/account-updates`` answers every row with a result code from ``SANDBOX.md``'s
account updater table. It is a hot path (300,000 rows in ~100 calls): rows are decided with dict
lookups and a few comparisons, nothing is logged or counted per row.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from sandbox.cards import is_pan
from sandbox.replies import invalid_request, optional_type_errors, read_json_object, require_valid
from sandbox.state import sandbox_of

ENDPOINT = "card-network.account-updates"
MAX_ITEMS = 10_000
"""Most rows one call may carry."""

SANDBOX_MERCHANT_IDS = (None, "", "SANDBOX")
"""Merchant ids a test tenant may send; any other gives ``ERR_INVALID_CONFIG``."""


@dataclass(frozen=True)
class _Update:
    """An ``UPD_*`` outcome: the new number (None: unchanged) and years added to the expiration."""

    code: str
    new_pan: str | None
    years: int


_UPDATES = {
    "4000000000001018": _Update("UPD_PAN", "4012888888881881", 3),
    "4000000000001026": _Update("UPD_EXP_DATE", None, 3),
    "4000000000001034": _Update("UPD_BRAND_CONV", "5555550000001018", 0),
    "4000000000001042": _Update("UPD_CORRECTED", "4000000000001109", 0),
}

_NOTICES = {
    "4000000000001059": "WRN_CLOSED_ACCOUNT",
    "4000000000001067": "WRN_CONTACT_CARDHOLDER",
    "4000000000001075": "WRN_ISSUER_NOT_ENROLLED",
    "4000000000001083": "WRN_ISSUER_NO_DATA",
    "4000000000001091": "WRN_OPT_OUT",
    "3566002020360505": "WRN_UNSUPPORTED_NETWORK",
    "4000000000001117": "ERR_UNDEFINED",
}
"""Rows answered with a code only (warnings and the undefined error)."""

routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """Add the account updater route to ``app`` (it keeps no state)."""
    app.add_routes(routes)


@routes.post("/card-network/account-updates")
async def account_updates(request: web.Request) -> web.Response:
    """200 ``{results: [...]}``, one result per item, in order; 400 for a malformed call.

    See ``sandbox/README.md`` for the request, the result shape and the precedence of codes.
    """
    body = await read_json_object(request)
    sandbox_of(request).requests.count(ENDPOINT, None)
    items = _items(body)
    today = datetime.datetime.now(datetime.UTC).date()
    this_month = (today.year, today.month)
    merchant_id = body.get("merchant_id")
    results = []
    for index, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("ref"), str)):
            raise invalid_request({f"items[{index}]": "must be an object with a string ref"})
        results.append(_result(item, merchant_id, this_month))
    return web.json_response({"results": results})


def _items(body: dict[str, Any]) -> list[Any]:
    """The ``items`` of a call, after checking the call-level fields; 400 when they are malformed."""
    items = body.get("items")
    errors = optional_type_errors({"merchant_id": (body.get("merchant_id"), str)})
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        errors["items"] = f"must be an array of at most {MAX_ITEMS} rows"
        items = []
    if body.get("tenant_type", "test") != "test":
        errors["tenant_type"] = "the sandbox serves test tenants only"
    require_valid(errors)
    return items


def _result(item: dict[str, Any], default_merchant_id: object, this_month: tuple[int, int]) -> dict[str, Any]:
    """The result of one row (``{ref, code, new_pan?, new_expiration_month?, new_expiration_year?}``)."""
    ref, pan = item["ref"], item.get("pan")
    month, year = item.get("expiration_month"), item.get("expiration_year")
    merchant_id = item.get("merchant_id")
    if merchant_id is None:
        merchant_id = default_merchant_id
    if merchant_id not in SANDBOX_MERCHANT_IDS:
        return {"ref": ref, "code": "ERR_INVALID_CONFIG"}
    if not (isinstance(pan, str) and is_pan(pan)):
        return {"ref": ref, "code": "ERR_INVALID_PAN"}
    if not _valid_expiration(month, year, this_month):
        return {"ref": ref, "code": "ERR_INVALID_EXP_DATE"}
    update = _UPDATES.get(pan)
    if update is None:
        return {"ref": ref, "code": _NOTICES.get(pan)}
    result = {"ref": ref, "code": update.code, "new_pan": update.new_pan or pan}
    if month is None and update.years:
        year, month = this_month
    if isinstance(month, int) and isinstance(year, int):  # both, or neither (``_valid_expiration``)
        result["new_expiration_month"] = month
        result["new_expiration_year"] = year + update.years
    return result


def _valid_expiration(month: object, year: object, this_month: tuple[int, int]) -> bool:
    """True when both are absent, or month 1-12 and four-digit year, not before ``this_month``."""
    if month is None and year is None:
        return True
    return (
        type(month) is int
        and type(year) is int
        and 1 <= month <= 12
        and 1000 <= year <= 9999
        and (year, month) >= this_month
    )
