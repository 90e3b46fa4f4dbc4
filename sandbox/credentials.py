"""The simulated agentic providers' payment credentials: minting on an allowance (card, network-token,
identifier and MPP formats; an MPP token is a JWE sealed for the merchant's key) and the admin view of
what was minted (``SANDBOX.md``, Agentic providers: credentials; ``sandbox/README.md``).

The allowance records and the special outcomes of the test cards are :mod:`sandbox.allowance_state`'s.
Minted values are returned once and never kept.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from joserfc import jwe
from joserfc.errors import JoseError
from joserfc.jwk import ECKey, OKPKey

from sandbox.agentic import hang, rejection
from sandbox.allowance_state import (
    ALLOWANCES,
    CREDENTIAL_NUMBER_PREFIX,
    FORMATS,
    MAX_CHALLENGE_LENGTH,
    MPP_ALGORITHM,
    Allowances,
    Amount,
    Behaviour,
    MintedCredential,
    ProviderAllowance,
    allowance_in_path,
    now,
    parse_amount,
    special_behaviour,
)
from sandbox.cards import CardFilter, luhn_check_digit
from sandbox.replies import Reply, read_json_object, require_valid
from sandbox.state import SANDBOX, Sandbox, respond_idempotently

routes = web.RouteTableDef()


@dataclass(frozen=True)
class MintRequest:
    """A validated mint: the format, the amount and, for ``mpp``, the merchant's key set and challenge."""

    format: str
    amount: Amount
    key_set: dict[str, Any] | None
    challenge: str | None


@routes.post("/agentic/{provider}/allowances/{allowance_id}/credentials")
async def mint_credential(request: web.Request) -> web.Response:
    """Mint a payment credential; 201 with it (its value this once) or a 422 refusal."""
    provider, allowance = allowance_in_path(request, "credentials", "create")
    body = await read_json_object(request)
    errors: dict[str, str] = {}
    if body.get("format") not in FORMATS[provider]:
        errors["format"] = f"must be one of {', '.join(FORMATS[provider])}"
    amount = parse_amount(body.get("amount"), "amount", errors)
    key_set, challenge = _mpp_fields(body, errors)
    require_valid(errors)
    assert amount is not None, "a malformed amount is in errors"
    ask = MintRequest(body["format"], amount, key_set, challenge)
    operation = partial(_mint, request.app[SANDBOX], request.app[ALLOWANCES], allowance, ask)
    return await respond_idempotently(request, ("credential.mint", provider, allowance.id), operation)


def _mpp_fields(body: dict[str, Any], errors: dict[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """``mpp.key_set`` and ``mpp.challenge`` (required for the ``mpp`` format, ignored otherwise)."""
    if body.get("format") != "mpp":
        return None, None
    mpp = body.get("mpp")
    if not isinstance(mpp, dict):
        errors["mpp"] = "must be an object {key_set, challenge} for the mpp format"
        return None, None
    key_set, challenge = mpp.get("key_set"), mpp.get("challenge")
    if not (isinstance(key_set, dict) and isinstance(key_set.get("keys"), list) and key_set["keys"]):
        errors["mpp.key_set"] = "must be a JWK set {keys: [...]} with at least one key"
    elif any(not isinstance(key, dict) or "d" in key for key in key_set["keys"]):
        errors["mpp.key_set"] = "must hold public JWKs only"
    if not (isinstance(challenge, str) and 0 < len(challenge) <= MAX_CHALLENGE_LENGTH):
        errors["mpp.challenge"] = f"must be a string of 1 to {MAX_CHALLENGE_LENGTH} characters"
    return key_set, challenge


async def _mint(sandbox: Sandbox, state: Allowances, allowance: ProviderAllowance, ask: MintRequest) -> Reply:
    """Mint ``ask`` on ``allowance`` (which must be active, unexpired, in the currency, with room)."""
    status = allowance.current_status
    if status != "active":
        code = "ALLOWANCE_NOT_ACTIVE" if status == "inactive" else f"ALLOWANCE_{status.upper()}"
        raise rejection(code, f"the allowance is {status}")
    if ask.amount.currency != allowance.amount.currency:
        raise rejection("CURRENCY_MISMATCH", "the amount is not in the allowance's currency")
    if allowance.spent + ask.amount.value > allowance.amount.value:
        raise rejection("AMOUNT_EXCEEDED", "the amount exceeds what the allowance has left")
    behaviour = special_behaviour(allowance.provider, allowance.enrollment)
    if behaviour is Behaviour.MINT_HANGS:
        await hang(sandbox)
    if behaviour is Behaviour.MINT_FAILS:
        raise rejection("PROVIDER_CREDENTIALS_FAILED", "the provider issued no credential")
    minted = MintedCredential(f"cred_{secrets.token_hex(12)}", allowance, ask.format, ask.amount, now())
    value = _credential_value(minted, ask)
    allowance.spent += ask.amount.value
    allowance.credentials += 1
    state.credentials[minted.id] = minted
    return Reply(201, minted.view(value))


def _credential_value(minted: MintedCredential, ask: MintRequest) -> dict[str, Any]:
    """The credential in its format: card fields, ``{id}``, or ``{token}`` sealed for the merchant."""
    allowance = minted.allowance
    if allowance.provider == "psp":
        inner: dict[str, Any] = {"id": f"spt_{secrets.token_hex(12)}"}
    else:
        body = CREDENTIAL_NUMBER_PREFIX + f"{secrets.randbelow(1000):03d}"
        inner = {
            "number": body + luhn_check_digit(body),
            "expiration_month": allowance.expires_at.month,
            "expiration_year": allowance.expires_at.year,
            "cvc": f"{secrets.randbelow(1000):03d}",
        }
    if ask.format != "mpp":
        return inner
    return {"token": _seal(minted, inner, ask)}


def _seal(minted: MintedCredential, inner: dict[str, Any], ask: MintRequest) -> str:
    """The MPP token: a compact JWE (``ECDH-ES``, ``A256GCM``, ``typ`` ``mpp+jwe``, the key's ``kid``)
    for the first usable key of the merchant's set, over ``{challenge, credential_id, provider,
    amount, credential, iat, exp}``; 422 ``MPP_KEY_UNSUPPORTED`` when the set has no usable key."""
    key = _recipient_key(ask.key_set or {})
    if key is None:
        raise rejection("MPP_KEY_UNSUPPORTED", "the key set holds no X25519 or P-256 encryption key")
    issued = int(minted.created_at.timestamp())
    claims = {
        "challenge": ask.challenge,
        "credential_id": minted.id,
        "provider": minted.allowance.provider,
        "amount": minted.amount.view(),
        "credential": inner,
        "iat": issued,
        "exp": int(minted.allowance.expires_at.timestamp()),
    }
    header = {**MPP_ALGORITHM, "typ": "mpp+jwe", **({"kid": key.kid} if key.kid else {})}
    return jwe.encrypt_compact(header, json.dumps(claims).encode(), key)


_RECIPIENT_KINDS: dict[tuple[str, str], type[OKPKey] | type[ECKey]] = {
    ("OKP", "X25519"): OKPKey,
    ("EC", "P-256"): ECKey,
}


def _recipient_key(key_set: dict[str, Any]) -> OKPKey | ECKey | None:
    """The first key of ``key_set`` usable for ``ECDH-ES``: OKP X25519 or EC P-256, ``use`` absent or
    ``enc``; keys that do not import are skipped."""
    for entry in key_set.get("keys", []):
        kind = _RECIPIENT_KINDS.get((entry.get("kty"), entry.get("crv")))
        if kind is None or entry.get("use", "enc") != "enc":
            continue
        try:
            return kind.import_key(entry)
        except (JoseError, ValueError, TypeError):
            continue
    return None


@routes.get("/_admin/credentials")
async def admin_credentials(request: web.Request) -> web.Response:
    """200 ``{credentials: [...], count}``: credentials minted (never their values), filtered by
    ``provider``, ``allowance_id``, ``format`` and card (``pan_last4``, ``par``, ``pan``), oldest first."""
    cards = CardFilter.from_query(request.query)
    wanted = {name: request.query.get(name) for name in ("provider", "allowance_id", "format")}
    views = (
        credential.admin_view()
        for credential in request.app[ALLOWANCES].credentials.values()
        if cards.matches(credential.allowance.card)
    )
    credentials = [view for view in views if all(value in (None, view[name]) for name, value in wanted.items())]
    return web.json_response({"credentials": credentials, "count": len(credentials)})
