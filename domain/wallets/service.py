"""Wallet tokens on the platform (spec 001 sections 2, 4, 5 and 9): merchant keys, tokenize, reads.

The crypto lives in :mod:`domain.wallets.wallet_a` and :mod:`domain.wallets.wallet_b`; this module
stores what they verified and answers the resources. Design decisions (the spec does not show them;
they are documented in the OpenAPI descriptions of ``app/routes/wallets.py`` too):

* **Merchant keys.** wallet-a: ``{certificate, private_key}`` PEM of the payment processing
  certificate; the answer ``{id, public_key_hash, merchant_id, expires_at, created_at}`` never holds
  the key. ``merchant_id`` is the certificate subject's UID (the wallet provider's merchant
  identifier) when present, else the hex merchant id hash of extension 1.2.840.113635.100.6.32.
  wallet-b: ``{private_key}`` (PEM or base64 PKCS#8 DER, P-256), answered the same way with
  ``merchant_id`` the recipient id ``merchant:<tenant id>`` (the tenant id is the merchant id toward
  the provider, section 4). Private keys are sealed with the tenant's data key (purpose
  ``wallet-merchant-key``). Every key whose certificate has not expired is active (rotation); a
  wallet-a token picks one by ``header.publicKeyHash``; a wallet-b token is tried with each.
* **Tokenize.** Verification and decryption failures raise the library's 4xx problems before
  anything is written. A stored transaction is accepted once per tenant and wallet: a replayed token
  answers 409 (wallet-a ``transaction_id``, wallet-b ``messageId``); a wallet-b ``PAN_ONLY`` token
  stores no wallet token and gives a new token intent until its ``messageExpiration``.
* **Cryptograms are not kept past their use.** The cryptogram is sealed apart from the card data and
  erased at its first use: the first ``GET /wallet-a/{id}`` with ``wallet-a:reveal`` or the first
  proxy request reading the token (``{{ wallet-a: <id> | ... }}``), whichever comes first; unused,
  it is erased ``TESSERA_WALLET_CRYPTOGRAM_RETENTION_SECONDS`` after creation (it reads as gone at
  once; the row is cleared at its next read). Every other view shows ``threeds_cryptogram`` null.
* **Card enrichment** comes from the network token itself (``bin``, ``last4``, expiration, ``brand``);
  the platform holds no BIN table, so ``funding``, ``authentication``, ``issuer``, ``issuer_country``,
  ``segment`` and ``product`` are null.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from collections.abc import Sequence
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from config.settings import get_settings
from domain.network_tokens import token_intents
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tokens.cards import bin_of, card_brand, default_card_mask
from domain.tokens.expressions import apply_mask, make_context
from domain.wallets import wallet_a, wallet_b
from domain.wallets.errors import MerchantCertificateInvalid, MerchantKeyNotFound
from domain.wallets.fields import DEFAULT_CLOCK, Authentication, CardData, Clock
from infra.errors import Problem, validation_problem
from infra.lookup import get_owned, parse_uuid
from storage.crypto import get_keyring
from storage.models_wallets import WalletMerchantKey, WalletToken

WALLET_A, WALLET_B = "wallet-a", "wallet-b"
KEY_PURPOSE = "wallet-merchant-key"
DATA_PURPOSE = "wallet-token"
CRYPTOGRAM_PURPOSE = "wallet-cryptogram"
#: The ``type`` of a wallet-b cryptogram token (the spec names dpan/mpan for wallet-a only).
WALLET_B_TYPE = "network_token"
#: The clock every wallet check reads when none is given (wall time; tests inject a fixed one).
CLOCK: Clock = DEFAULT_CLOCK


# ---- merchant keys -------------------------------------------------------------------------------


def _pem_bytes(value: str) -> bytes:
    return value.encode("utf-8")


def _merchant_id(certificate: x509.Certificate, id_hash: bytes) -> str:
    uids = certificate.subject.get_attributes_for_oid(NameOID.USER_ID)
    return str(uids[0].value) if uids else id_hash.hex()


def key_view(row: WalletMerchantKey) -> dict:
    """A merchant key as answered: ``{id, public_key_hash, merchant_id, expires_at, created_at}``."""
    return {
        "id": row.id,
        "public_key_hash": row.public_key_hash,
        "merchant_id": row.merchant_id,
        "expires_at": row.expires_at,
        "created_at": row.created_at,
    }


def _store_key(
    session: Session, caller: Caller, row: WalletMerchantKey, private_key: ec.EllipticCurvePrivateKey
) -> dict:
    der = private_key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    row.private_key_ct = get_keyring().encrypt(session, caller.tenant_id, KEY_PURPOSE, str(row.id), der)
    session.add(row)
    audit.record(session, caller, entity_type=f"{row.wallet}-merchant-key", entity_id=row.id, operation="create")
    return key_view(row)


def add_wallet_a_certificate(
    session: Session, caller: Caller, *, certificate: str, private_key: str, clock: Clock | None = None
) -> dict:
    """``POST /wallet-a/merchant-certificates``: store a payment processing certificate and its key.

    422 (``merchant_certificate_invalid``) when the PEM cannot be read, the key is not P-256, does not
    belong to the certificate, or the merchant id extension is missing; 422 when the certificate has
    expired. Answers :func:`key_view`.
    """
    now = (clock or CLOCK)()
    key = wallet_a.MerchantKey.from_pem(_pem_bytes(certificate), _pem_bytes(private_key))
    cert = x509.load_pem_x509_certificate(_pem_bytes(certificate))
    if key.expires_at is not None and key.expires_at <= now:
        raise MerchantCertificateInvalid(f"the certificate expired at {key.expires_at.isoformat()}")
    row = WalletMerchantKey(
        tenant_id=caller.tenant_id,
        wallet=WALLET_A,
        public_key_hash=key.public_key_hash_b64,
        merchant_id=_merchant_id(cert, key.merchant_id_hash),
        certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
        private_key_ct=b"",
        expires_at=key.expires_at,
        created_by=caller.application_id,
        created_at=now,
    )
    return _store_key(session, caller, row, key.private_key)


def _wallet_b_private_key(value: str) -> ec.EllipticCurvePrivateKey:
    text = value.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_private_key(text.encode(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
                raise ValueError("not P-256")
            return key
        return wallet_b.private_key_from_b64_pkcs8(text)
    except (ValueError, TypeError):
        raise MerchantCertificateInvalid("private_key must be an EC P-256 key, PEM or base64 PKCS#8 DER") from None


def add_wallet_b_key(session: Session, caller: Caller, *, private_key: str, clock: Clock | None = None) -> dict:
    """``POST /wallet-b/merchant-keys``: store a wallet-b merchant private key (P-256, PEM or base64
    PKCS#8 DER); 422 ``merchant_certificate_invalid`` otherwise. Answers :func:`key_view` with
    ``merchant_id`` the recipient id ``merchant:<tenant id>``."""
    key = _wallet_b_private_key(private_key)
    row = WalletMerchantKey(
        tenant_id=caller.tenant_id,
        wallet=WALLET_B,
        public_key_hash=base64.b64encode(wallet_a.public_key_hash(key.public_key())).decode(),
        merchant_id=recipient_id(caller.tenant_id),
        private_key_ct=b"",
        created_by=caller.application_id,
        created_at=(clock or CLOCK)(),
    )
    return _store_key(session, caller, row, key)


def list_keys(session: Session, caller: Caller, wallet: str) -> list[dict]:
    """The tenant's merchant keys of ``wallet``, oldest first (a handful at most: no pagination)."""
    rows = session.exec(
        select(WalletMerchantKey)
        .where(WalletMerchantKey.tenant_id == caller.tenant_id, WalletMerchantKey.wallet == wallet)
        .order_by(col(WalletMerchantKey.created_at), col(WalletMerchantKey.id))
    ).all()
    return [key_view(row) for row in rows]


def delete_key(session: Session, caller: Caller, wallet: str, key_id: object) -> None:
    """Remove a merchant key (404 when missing or another tenant's); tokens sealed for it are refused
    from then on with ``merchant_key_not_found``."""
    row = get_owned(
        session,
        WalletMerchantKey,
        key_id,
        caller.tenant_id,
        what="merchant key" if wallet == WALLET_B else "merchant certificate",
        where=lambda key: key.wallet == wallet,
    )
    session.delete(row)
    audit.record(session, caller, entity_type=f"{wallet}-merchant-key", entity_id=row.id, operation="delete")


def _active_keys(
    session: Session, tenant_id: uuid.UUID, wallet: str, now: dt.datetime
) -> list[tuple[WalletMerchantKey, ec.EllipticCurvePrivateKey]]:
    rows = session.exec(
        select(WalletMerchantKey).where(WalletMerchantKey.tenant_id == tenant_id, WalletMerchantKey.wallet == wallet)
    ).all()
    keyring = get_keyring()
    out = []
    for row in rows:
        if row.expires_at is not None and row.expires_at <= now:
            continue
        der = keyring.decrypt(session, tenant_id, KEY_PURPOSE, str(row.id), row.private_key_ct)
        key = serialization.load_der_private_key(der, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        out.append((row, key))
    return out


def recipient_id(tenant_id: uuid.UUID) -> str:
    """The wallet-b recipient id of a tenant: ``merchant:<tenant id>`` (the tenant id is the merchant id)."""
    return f"merchant:{tenant_id}"


# ---- wallet token resources ----------------------------------------------------------------------


def _card(data: CardData) -> dict:
    return {
        "bin": bin_of(data.number),
        "last4": data.number[-4:],
        "expiration_month": data.expiration_month,
        "expiration_year": data.expiration_year,
        "brand": card_brand(data.number),
        "funding": None,
        "authentication": None,
        "issuer": None,
        "issuer_country": None,
        "segment": None,
        "product": None,
    }


def _masked(data: dict) -> dict:
    return apply_mask(default_card_mask(), make_context("card", data, {}))  # type: ignore[return-value]


def token_view(row: WalletToken, *, data: dict | None = None, cryptogram: str | None = None) -> dict:
    """The wallet token resource (spec 001 section 2). ``data`` (already masked or complete) is left
    out when None; ``authentication.threeds_cryptogram`` is ``cryptogram`` (None in masked views)."""
    view = {
        "id": row.id,
        "type": row.type,
        "tenant_id": row.tenant_id,
        "status": row.status,
        "ingest_source": row.ingest_source,
        "expires_at": row.expires_at,
        "created_by": row.created_by,
        "modified_by": row.modified_by,
        "created_at": row.created_at,
        "modified_at": row.modified_at,
        "transaction_id": row.transaction_id,
        "payment_data_type": row.payment_data_type,
        "device_manufacturer_identifier": row.device_manufacturer_identifier,
        "fingerprint": row.fingerprint,
        "card": row.card,
        "authentication": None
        if row.payment_data_type == "EMV"
        else {"threeds_cryptogram": cryptogram, "eci_indicator": row.eci_indicator},
    }
    if data is not None:
        view["data"] = data
    return view


def _expires_at(requested: dt.datetime | None, default: dt.datetime | None, now: dt.datetime) -> dt.datetime | None:
    if requested is None:
        return default
    if requested.tzinfo is None:
        requested = requested.replace(tzinfo=dt.UTC)
    if requested <= now:
        raise validation_problem({"expires_at": ["must be in the future"]})
    return requested


def _store_token(
    session: Session,
    caller: Caller,
    row: WalletToken,
    data: CardData,
    authentication: Authentication | None,
    now: dt.datetime,
) -> WalletToken:
    keyring = get_keyring()
    plain = json.dumps(data.as_dict(), separators=(",", ":")).encode()
    row.data_ct = keyring.encrypt(session, caller.tenant_id, DATA_PURPOSE, str(row.id), plain)
    row.fingerprint = keyring.fingerprint(session, caller.tenant_id, data.number)
    row.card = _card(data)
    if authentication is not None:
        row.eci_indicator = authentication.eci_indicator
        row.cryptogram_ct = keyring.encrypt(
            session, caller.tenant_id, CRYPTOGRAM_PURPOSE, str(row.id), authentication.threeds_cryptogram.encode()
        )
        row.cryptogram_expires_at = now + dt.timedelta(seconds=get_settings().wallet_cryptogram_retention_seconds)
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:
        raise Problem(
            409,
            f"This {row.wallet} token was already accepted (transaction {row.transaction_id}); "
            "a wallet token is accepted once.",
            title="Wallet token replayed",
        ) from None
    audit.record(session, caller, entity_type=row.wallet, entity_id=row.id, operation="create")
    return row


def create_wallet_a(
    session: Session,
    caller: Caller,
    apple_payment_data: Any,
    *,
    expires_at: dt.datetime | None = None,
    clock: Clock | None = None,
) -> dict:
    """``POST /wallet-a``: verify and decrypt ``apple_payment_data`` (:func:`wallet_a.decrypt_payment`)
    with the tenant's active merchant certificates, store the resource, answer ``{wallet_a: resource}``
    without ``data``.

    Raises the library's 4xx problems (400 malformed, 422 refused: ``merchant_key_not_found`` also
    when the tenant has no certificate), 400 for ``expires_at`` in the past, 409 for a replayed
    transaction. Nothing is stored on any failure.
    """
    settings = get_settings()
    clock = clock or CLOCK
    now = clock()
    keys = _active_keys(session, caller.tenant_id, WALLET_A, now)
    if not keys:
        raise MerchantKeyNotFound(
            "no active merchant certificate is configured; add one with POST /wallet-a/merchant-certificates"
        )
    merchant_keys = [
        wallet_a.MerchantKey(
            private_key=key,
            merchant_id_hash=wallet_a.merchant_id_hash(
                x509.load_pem_x509_certificate(_pem_bytes(row.certificate_pem or ""))
            ),
            public_key_hash=base64.b64decode(row.public_key_hash),
            expires_at=row.expires_at,
        )
        for row, key in keys
    ]
    payment = wallet_a.decrypt_payment(
        apple_payment_data,
        merchant_keys=merchant_keys,
        root=wallet_a.load_root_ca(settings.wallet_a_root_ca),
        clock=clock,
        signing_time_window=dt.timedelta(seconds=settings.wallet_a_signing_time_window_seconds),
    )
    row = WalletToken(
        tenant_id=caller.tenant_id,
        wallet=WALLET_A,
        type=payment.type,
        transaction_id=payment.transaction_id,
        payment_data_type=payment.payment_data_type,
        device_manufacturer_identifier=payment.device_manufacturer_identifier,
        data_ct=b"",
        expires_at=_expires_at(expires_at, payment.expires_at, now),
        created_by=caller.application_id,
        created_at=now,
    )
    _store_token(session, caller, row, payment.data, payment.authentication, now)
    return {"wallet_a": token_view(row)}


def _root_keys() -> list[wallet_b.RootSigningKey]:
    path = get_settings().wallet_b_root_keys
    if not path:
        raise Problem(
            503, "wallet-b root signing keys are not configured on this deployment (TESSERA_WALLET_B_ROOT_KEYS)."
        )
    with open(path, "rb") as handle:
        return wallet_b.RootSigningKey.from_key_list(json.loads(handle.read()))


def create_wallet_b(
    session: Session,
    caller: Caller,
    google_payment_data: Any,
    *,
    expires_at: dt.datetime | None = None,
    clock: Clock | None = None,
) -> dict:
    """``POST /wallet-b``: verify and decrypt an ECv2 token (:func:`wallet_b.decrypt_token`) sealed for
    ``merchant:<tenant id>`` with the tenant's merchant keys. ``CRYPTOGRAM_3DS`` stores a wallet token
    and answers ``{google_pay: resource}`` without ``data``; ``PAN_ONLY`` answers ``{token_intent: ...}``
    (a token intent holding the card, :mod:`domain.network_tokens.token_intents`).

    Raises the library's 4xx problems, 503 when the root keys are not configured, 409 for a replayed
    ``messageId``. Nothing is stored on any failure.
    """
    clock = clock or CLOCK
    now = clock()
    keys = _active_keys(session, caller.tenant_id, WALLET_B, now)
    if not keys:
        raise MerchantKeyNotFound("no wallet-b merchant key is configured; add one with POST /wallet-b/merchant-keys")
    payment = wallet_b.decrypt_token(
        google_payment_data,
        recipient_id=recipient_id(caller.tenant_id),
        merchant_keys=[k for _, k in keys],
        root_keys=_root_keys(),
        clock=clock,
    )
    if payment.resource_kind == "token_intent":
        intent = token_intents.create_intent(session, caller, type="card", data=payment.data.as_dict(), now=now)
        return {"token_intent": intent}
    card_end = dt.datetime(
        payment.data.expiration_year + payment.data.expiration_month // 12,
        payment.data.expiration_month % 12 + 1,
        1,
        tzinfo=dt.UTC,
    ) - dt.timedelta(microseconds=1)
    row = WalletToken(
        tenant_id=caller.tenant_id,
        wallet=WALLET_B,
        type=WALLET_B_TYPE,
        transaction_id=payment.message_id,
        payment_data_type="3DSecure",
        data_ct=b"",
        expires_at=_expires_at(expires_at, card_end, now),
        created_by=caller.application_id,
        created_at=now,
    )
    _store_token(session, caller, row, payment.data, payment.authentication, now)
    return {"google_pay": token_view(row)}


def _open(session: Session, row: WalletToken) -> dict:
    return json.loads(get_keyring().decrypt(session, row.tenant_id, DATA_PURPOSE, str(row.id), row.data_ct))


def _take_cryptogram(session: Session, row: WalletToken, caller_id: uuid.UUID | None, now: dt.datetime) -> str | None:
    """The cryptogram if still kept, erasing it (its one use); an expired one is erased unread."""
    if row.cryptogram_ct is None:
        return None
    cryptogram = None
    if row.cryptogram_expires_at is None or row.cryptogram_expires_at > now:
        cryptogram = (
            get_keyring().decrypt(session, row.tenant_id, CRYPTOGRAM_PURPOSE, str(row.id), row.cryptogram_ct).decode()
        )
    row.cryptogram_ct = None
    row.cryptogram_expires_at = None
    row.modified_by, row.modified_at = caller_id, now
    session.add(row)
    return cryptogram


def read_wallet_a(session: Session, caller: Caller, token_id: object, *, clock: Clock | None = None) -> dict:
    """``GET /wallet-a/{id}``: the resource at top level; ``data`` complete and the cryptogram (once)
    with ``wallet-a:reveal``, else ``data`` masked (``wallet-a:read``). 404 when missing or another
    tenant's. Writes a ``read`` log row."""
    now = (clock or CLOCK)()
    row = get_owned(
        session,
        WalletToken,
        token_id,
        caller.tenant_id,
        what="wallet token",
        where=lambda token: token.wallet == WALLET_A,
    )
    data = _open(session, row)
    audit.record(session, caller, entity_type=WALLET_A, entity_id=row.id, operation="read")
    if caller.has("wallet-a:reveal"):
        return token_view(row, data=data, cryptogram=_take_cryptogram(session, row, caller.application_id, now))
    return token_view(row, data=_masked(data))


def _jsonable(value: object) -> str:
    return value.isoformat() if isinstance(value, dt.datetime) else str(value)


def load_for_proxy(
    session: Session, tenant_id: uuid.UUID, wallet: str, ids: Sequence[str], *, now: dt.datetime | None = None
) -> dict[str, dict]:
    """The resources of ``ids`` (text ids as written in expressions) of ``wallet`` in the tenant, each
    complete (``data`` and the cryptogram), for a proxy request: ``{id: resource}`` with ids and times
    as JSON text. Reading a cryptogram here is its use: it is erased in the caller's transaction."""
    now = now or CLOCK()
    wanted = {parse_uuid(i): i for i in ids if parse_uuid(i) is not None}
    if not wanted:
        return {}
    rows = session.exec(
        select(WalletToken).where(
            WalletToken.tenant_id == tenant_id, WalletToken.wallet == wallet, col(WalletToken.id).in_(list(wanted))
        )
    ).all()
    found = {}
    for row in rows:
        view = token_view(row, data=_open(session, row), cryptogram=_take_cryptogram(session, row, None, now))
        found[wanted[row.id]] = json.loads(json.dumps(view, default=_jsonable))
    return found
