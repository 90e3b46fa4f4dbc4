"""Client encryption keys: ``/keys`` (spec, core document sections 2 and 4, Client encryption keys).

Handlers are thin: the domain work lives in ``domain.client_keys.service``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Literal

from pydantic import Field

from app.api import Api, Call
from app.schemas import RequestModel, ResponseModel
from domain.client_keys import service as client_keys

KEY_TAG = "Client encryption keys"

api = Api()


# ---- shapes --------------------------------------------------------------------------------------


class KeyIn(RequestModel):
    """The body of POST /keys."""

    expires_at: dt.datetime | None = Field(
        None,
        description="ISO 8601; default TESSERA_CLIENT_KEY_DEFAULT_DAYS (182 days, about 6 months) after creation; "
        "at most 1 year after creation. A time without an offset is UTC.",
    )


class KeyOut(ResponseModel):
    """A client encryption key without its public key."""

    key_id: str
    expires_at: dt.datetime
    created_by: uuid.UUID | None
    created_at: dt.datetime


class PublicJwk(ResponseModel):
    """The public key as a JWK (RFC 8037, X25519) for JWE ECDH-ES."""

    kty: Literal["OKP"]
    crv: Literal["X25519"]
    x: str
    kid: str
    use: Literal["enc"]
    alg: Literal["ECDH-ES"]


class KeyCreatedOut(KeyOut):
    """A new client encryption key with its public key (shown only once)."""

    public_key_pem: str = Field(description="SubjectPublicKeyInfo PEM of the X25519 public key; shown only here.")
    public_key_jwk: PublicJwk = Field(description="The same public key as a JWK; shown only here.")


# ---- client encryption keys ----------------------------------------------------------------------

_KEY_TEXT = (
    "Keys are X25519 key pairs for JWE `ECDH-ES` (direct key agreement) with `A256GCM`. Encrypt a token request "
    'object (`{"data": ..., "metadata": ...}`) as a compact JWE whose protected header has `alg` ECDH-ES, `enc` '
    "A256GCM and `kid` = `key_id`, then send it in the proxy's encrypted header. Compression (`zip`), other "
    "algorithms, JWEs over 64 KiB and keys that expired or were deleted are refused. Private keys never leave the "
    "platform and are destroyed after expiry."
)


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    return value.replace(tzinfo=dt.UTC) if value is not None and value.tzinfo is None else value


@api.route(
    "POST",
    "/keys",
    permission="keys:create",
    body=KeyIn,
    body_optional=True,
    status=201,
    response=KeyCreatedOut,
    tag=KEY_TAG,
    summary="Create a client encryption key",
    errors=(400,),
    description="Returns the public key once, as `public_key_pem` (SubjectPublicKeyInfo) and `public_key_jwk`. "
    "The body is optional (no body: the default life). `expires_at` in the past or more than 1 year after "
    "creation: 400. " + _KEY_TEXT,
)
async def create_key(call: Call):
    """``POST /keys``: 201 with the key and its public key."""
    return await call.db(
        client_keys.create_key,
        call.caller,
        expires_at=_aware(call.body.expires_at),
        default_days=call.settings.client_key_default_days,
    )


@api.route(
    "GET",
    "/keys",
    permission="keys:read",
    response=list[KeyOut],
    tag=KEY_TAG,
    summary="List the client encryption keys",
    description="A plain array (not paginated), oldest first, without public keys; expired keys are listed until "
    "deleted.",
)
async def list_keys(call: Call):
    """``GET /keys``: a plain array."""
    return await call.db(client_keys.list_keys, call.caller)


@api.route(
    "GET",
    "/keys/{id}",
    permission="keys:read",
    response=KeyOut,
    tag=KEY_TAG,
    summary="Get a client encryption key",
    errors=(404,),
    description="Without the public key.",
)
async def get_key(call: Call):
    """``GET /keys/{id}``."""
    return await call.db(client_keys.read_key, call.caller, call.uuid_param(what="client encryption key"))


@api.route(
    "DELETE",
    "/keys/{id}",
    permission="keys:delete",
    status=204,
    tag=KEY_TAG,
    summary="Delete a client encryption key",
    errors=(404,),
    description="Its private key is destroyed at once: payloads encrypted with it can no longer be decrypted.",
)
async def delete_key(call: Call):
    """``DELETE /keys/{id}``: 204."""
    await call.db(client_keys.delete_key, call.caller, call.uuid_param(what="client encryption key"))
