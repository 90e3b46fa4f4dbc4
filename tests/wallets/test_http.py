"""Wallet tokens over real HTTP: merchant certificates and keys, POST /wallet-a and GET /wallet-a/{id},
POST /wallet-b, the shut-down connections, and proxy expressions reading wallet tokens.

Tokens are issued by the tests' own chain (tests/wallets/issuers.py), which the running API trusts
through TESSERA_WALLET_A_ROOT_CA / TESSERA_WALLET_B_ROOT_KEYS (tests/wallets/conftest.py).
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import hashlib
import json
import uuid

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from sqlmodel import func, select

from domain.proxy.detokenize import detokenize
from domain.proxy.errors import ProxyError
from domain.proxy.values import SqlValueLoader
from domain.tenancy.caller import Caller
from storage.db import session_scope
from storage.models_network_tokens import TokenIntent
from storage.models_wallets import WalletMerchantKey, WalletToken
from storage.types import utcnow
from tests.wallets.conftest import HTTP_CA, HTTP_ISSUER, flip
from tests.wallets.issuers import (
    INTERMEDIATE_OID,
    MERCHANT_ID_OID,
    Merchant,
    WalletACA,
    WalletBIssuer,
    apple_payment,
    certificate,
    google_message,
    key_pem,
    new_key,
)

PAN = "4895370012003478"
CRYPTOGRAM = "AgAAAAAABk4DWZ4C28yUQAAAAAA="


def merchant_pem(merchant: Merchant, *, days: int = 365) -> str:
    """The merchant's payment processing certificate, valid around today, as PEM text."""
    now = utcnow()
    value = b"\x0c\x40" + merchant.id_hash.hex().upper().encode()
    cert = certificate(
        f"Payment Processing:{merchant.identifier}",
        merchant.key,
        extra=(x509.UnrecognizedExtension(MERCHANT_ID_OID, value),),
        not_before=now - dt.timedelta(days=2),
        not_after=now + dt.timedelta(days=days),
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def register(client, merchant: Merchant):
    return client.post(
        "/wallet-a/merchant-certificates",
        {"certificate": merchant_pem(merchant), "private_key": key_pem(merchant.key).decode()},
    )


def apple_body(
    merchant: Merchant,
    *,
    ca: WalletACA = HTTP_CA,
    payment: dict | None = None,
    transaction_id: bytes | None = None,
    **options,
) -> dict:
    """A POST /wallet-a body: a token sealed for ``merchant``, signed now by ``ca``."""
    options.setdefault("signing_time", utcnow())
    tx = transaction_id or hashlib.sha256(str(utcnow().timestamp()).encode() + new_key_bytes()).digest()
    token = ca.token(payment or apple_payment(), merchant, transaction_id=tx, **options)
    return {
        "apple_payment_data": {
            "paymentData": token,
            "transactionIdentifier": tx.hex().upper(),
            "paymentMethod": {"network": "Visa"},
        }
    }


def new_key_bytes() -> bytes:
    return new_key().private_numbers().private_value.to_bytes(32, "big")


def stored(tenant_id, model=WalletToken) -> int:
    with session_scope() as session:
        return session.exec(select(func.count()).select_from(model).where(model.tenant_id == tenant_id)).one()


@pytest.fixture
def merchant(tenant) -> Merchant:
    m = Merchant()
    assert register(tenant.client, m).status == 201
    return m


# ---- merchant certificates ----------------------------------------------------------------------


def test_merchant_certificates_are_added_listed_and_deleted_without_their_key(tenant, other_tenant, limited):
    first, second = Merchant(), Merchant(identifier="merchant.com.tessera.other")
    answer = register(tenant.client, first)
    assert answer.status == 201, answer
    body = answer.json
    assert set(body) == {"id", "public_key_hash", "merchant_id", "expires_at", "created_at"}
    assert body["public_key_hash"] == base64.b64encode(first.key_hash).decode()
    assert body["merchant_id"] == first.id_hash.hex()
    assert "PRIVATE" not in answer.raw.decode()
    assert register(tenant.client, second).status == 201

    listed = tenant.client.get("/wallet-a/merchant-certificates")
    assert listed.status == 200
    assert [c["public_key_hash"] for c in listed.json["data"]] == [
        base64.b64encode(first.key_hash).decode(),
        base64.b64encode(second.key_hash).decode(),
    ]
    assert "PRIVATE" not in listed.raw.decode()
    assert other_tenant.client.get("/wallet-a/merchant-certificates").json["data"] == []
    with session_scope() as session:
        row = session.get(WalletMerchantKey, uuid.UUID(body["id"]))
        assert key_pem(first.key) not in row.private_key_ct  # sealed at rest

    reader = limited(tenant, ["wallet-a:create", "wallet-a:reveal"])
    assert reader.get("/wallet-a/merchant-certificates").status == 403
    assert other_tenant.client.delete(f"/wallet-a/merchant-certificates/{body['id']}").status == 404
    assert tenant.client.delete(f"/wallet-a/merchant-certificates/{body['id']}").status == 204
    assert tenant.client.delete(f"/wallet-a/merchant-certificates/{body['id']}").status == 404
    assert len(tenant.client.get("/wallet-a/merchant-certificates").json["data"]) == 1


def test_unusable_merchant_certificates_are_refused(tenant):
    m = Merchant()
    wrong_key = tenant.client.post(
        "/wallet-a/merchant-certificates", {"certificate": merchant_pem(m), "private_key": key_pem(new_key()).decode()}
    )
    assert wrong_key.status == 422 and wrong_key.json["code"] == "merchant_certificate_invalid"
    assert "does not belong" in wrong_key.json["detail"]
    garbage = tenant.client.post("/wallet-a/merchant-certificates", {"certificate": "x", "private_key": "y"})
    assert garbage.status == 422 and garbage.json["code"] == "merchant_certificate_invalid"
    missing = tenant.client.post("/wallet-a/merchant-certificates", {"certificate": merchant_pem(m)})
    assert missing.status == 400 and "private_key" in missing.json["errors"]
    assert stored(tenant.id, WalletMerchantKey) == 0


# ---- POST /wallet-a and GET /wallet-a/{id} -------------------------------------------------------


def test_a_token_is_verified_decrypted_and_stored_without_answering_its_data(tenant, merchant):
    answer = tenant.client.post("/wallet-a", apple_body(merchant))
    assert answer.status == 201, answer
    resource = answer.json["wallet_a"]
    assert "data" not in resource and PAN not in answer.raw.decode() and CRYPTOGRAM not in answer.raw.decode()
    assert resource["type"] == "dpan"
    assert resource["status"] == "active" and resource["ingest_source"] == "device_decrypted"
    assert resource["payment_data_type"] == "3DSecure"
    assert resource["device_manufacturer_identifier"] == "040010030273"
    assert resource["authentication"] == {"threeds_cryptogram": None, "eci_indicator": "7"}
    assert resource["card"]["bin"] == PAN[:6] and resource["card"]["last4"] == PAN[-4:]
    assert resource["card"]["expiration_month"] == 12 and resource["card"]["expiration_year"] == 2029
    assert resource["card"]["brand"] == "visa"
    assert resource["expires_at"].startswith("2029-12-31T23:59:59")
    assert resource["tenant_id"] == str(tenant.id) and resource["fingerprint"]


def test_get_masks_with_read_and_reveals_the_cryptogram_once(tenant, merchant, limited):
    created = tenant.client.post("/wallet-a", apple_body(merchant)).json["wallet_a"]
    reader = limited(tenant, ["wallet-a:read"])
    masked = reader.get(f"/wallet-a/{created['id']}")
    assert masked.status == 200, masked
    assert masked.json["data"]["number"] != PAN and masked.json["data"]["number"].endswith(PAN[-4:])
    assert masked.json["authentication"]["threeds_cryptogram"] is None

    revealer = limited(tenant, ["wallet-a:reveal"])
    revealed = revealer.get(f"/wallet-a/{created['id']}")
    assert revealed.status == 200
    assert revealed.json["data"] == {"number": PAN, "expiration_month": 12, "expiration_year": 2029}
    assert revealed.json["authentication"] == {"threeds_cryptogram": CRYPTOGRAM, "eci_indicator": "7"}
    assert revealed.json["modified_at"] is not None
    again = revealer.get(f"/wallet-a/{created['id']}")
    assert again.json["data"]["number"] == PAN
    assert again.json["authentication"]["threeds_cryptogram"] is None  # erased after its one use

    assert limited(tenant, ["wallet-a:create"]).get(f"/wallet-a/{created['id']}").status == 403
    assert tenant.client.get("/wallet-a/not-a-uuid").status == 404


def test_another_tenant_cannot_read_a_wallet_token(tenant, other_tenant, merchant):
    created = tenant.client.post("/wallet-a", apple_body(merchant)).json["wallet_a"]
    assert other_tenant.client.get(f"/wallet-a/{created['id']}").status == 404


def test_rotation_picks_the_key_the_token_names_and_a_deleted_key_stops_working(tenant, merchant):
    newer = Merchant()
    newer_id = register(tenant.client, newer).json["id"]
    assert tenant.client.post("/wallet-a", apple_body(newer)).status == 201
    assert tenant.client.post("/wallet-a", apple_body(merchant)).status == 201
    assert tenant.client.delete(f"/wallet-a/merchant-certificates/{newer_id}").status == 204
    refused = tenant.client.post("/wallet-a", apple_body(newer))
    assert refused.status == 422 and refused.json["code"] == "merchant_key_not_found"


def test_a_replayed_token_is_refused(tenant, merchant):
    body = apple_body(merchant)
    assert tenant.client.post("/wallet-a", body).status == 201
    replay = tenant.client.post("/wallet-a", body)
    assert replay.status == 409, replay
    assert stored(tenant.id) == 1


def _tampered_data(body: dict) -> dict:
    body["apple_payment_data"]["paymentData"]["data"] = flip(body["apple_payment_data"]["paymentData"]["data"])
    return body


def _tampered_signature(body: dict) -> dict:
    body["apple_payment_data"]["paymentData"]["signature"] = flip(
        body["apple_payment_data"]["paymentData"]["signature"]
    )
    return body


def _tampered_ephemeral_key(body: dict) -> dict:
    header = body["apple_payment_data"]["paymentData"]["header"]
    other = (
        new_key().public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    header["ephemeralPublicKey"] = base64.b64encode(other).decode()
    return body


def _mismatched_identifier(body: dict) -> dict:
    body["apple_payment_data"]["transactionIdentifier"] = "00" * 32
    return body


@pytest.mark.parametrize(
    ("tamper", "status", "code"),
    [
        (_tampered_data, 422, "message_digest_mismatch"),
        (_tampered_signature, 422, "signature_invalid"),
        (_tampered_ephemeral_key, 422, "message_digest_mismatch"),
        (_mismatched_identifier, 400, "malformed_token"),
    ],
)
def test_tampered_tokens_are_refused_and_nothing_is_stored(tenant, merchant, tamper, status, code):
    answer = tenant.client.post("/wallet-a", tamper(apple_body(merchant)))
    assert answer.status == status, answer
    assert answer.json["code"] == code and answer.json["detail"]
    assert PAN not in answer.raw.decode()
    assert stored(tenant.id) == 0


def _expired_intermediate_ca() -> WalletACA:
    """The trusted chain with its intermediate (same key and name) expired yesterday."""
    now = utcnow()
    ca = copy.copy(HTTP_CA)
    ca.intermediate = certificate(
        "Test Application Integration CA",
        ca.intermediate_key,
        issuer=HTTP_CA.root,
        issuer_key=HTTP_CA.root_key,
        ca=True,
        marker=INTERMEDIATE_OID,
        not_before=now - dt.timedelta(days=30),
        not_after=now - dt.timedelta(days=1),
    )
    return ca


def test_refusals_name_the_failed_check(tenant, merchant):
    stranger = Merchant()
    cases = [
        (apple_body(stranger), "merchant_key_not_found"),
        (apple_body(stranger, key_hash_of=merchant), "decryption_failed"),  # sealed for another key
        (apple_body(merchant, ca=_expired_intermediate_ca()), "certificate_invalid"),
        (apple_body(merchant, ca=WalletACA()), "certificate_invalid"),  # chains to another root
        (apple_body(merchant, signing_time=utcnow() - dt.timedelta(hours=1)), "signing_time_out_of_window"),
        (apple_body(merchant, payment=apple_payment(applicationExpirationDate="2912")), "payment_data_invalid"),
    ]
    for body, code in cases:
        answer = tenant.client.post("/wallet-a", body)
        assert answer.status == 422, (code, answer)
        assert answer.json["code"] == code
    unsupported = apple_body(merchant)
    unsupported["apple_payment_data"]["paymentData"]["version"] = "RSA_v1"
    answer = tenant.client.post("/wallet-a", unsupported)
    assert answer.status == 422 and answer.json["code"] == "unsupported_version"
    missing = tenant.client.post("/wallet-a", {"apple_payment_data": {"transactionIdentifier": "ab"}})
    assert missing.status == 400 and missing.json["code"] == "malformed_token"
    assert stored(tenant.id) == 0


def test_a_tenant_without_certificates_is_told_how_to_add_one(tenant):
    answer = tenant.client.post("/wallet-a", apple_body(Merchant()))
    assert answer.status == 422 and answer.json["code"] == "merchant_key_not_found"
    assert "/wallet-a/merchant-certificates" in answer.json["detail"]


def test_mpan_and_emv_tokens(tenant, merchant):
    mpan = tenant.client.post(
        "/wallet-a", apple_body(merchant, payment=apple_payment(merchantTokenIdentifier="DNITHE302308980427388297"))
    )
    assert mpan.status == 201 and mpan.json["wallet_a"]["type"] == "mpan"
    emv = tenant.client.post(
        "/wallet-a", apple_body(merchant, payment=apple_payment(paymentDataType="EMV", paymentData={"emvData": "AAEC"}))
    )
    assert emv.status == 201, emv
    assert emv.json["wallet_a"]["payment_data_type"] == "EMV" and emv.json["wallet_a"]["authentication"] is None


# ---- wallet-b ------------------------------------------------------------------------------------


@pytest.fixture
def b_key(tenant):
    key = new_key()
    answer = tenant.client.post("/wallet-b/merchant-keys", {"private_key": key_pem(key).decode()})
    assert answer.status == 201, answer
    assert answer.json["merchant_id"] == f"merchant:{tenant.id}" and "PRIVATE" not in answer.raw.decode()
    return key


def google_body(
    tenant,
    key,
    auth_method="CRYPTOGRAM_3DS",
    *,
    issuer: WalletBIssuer = HTTP_ISSUER,
    recipient: str | None = None,
    **message,
) -> dict:
    message.setdefault("expires_at", utcnow() + dt.timedelta(hours=1))
    body = google_message(auth_method, **message)
    body["messageId"] = f"msg-{new_key_bytes().hex()[:16]}"
    token = issuer.token(body, key.public_key(), recipient or f"merchant:{tenant.id}")
    return {"google_payment_data": token}


def test_wallet_b_cryptogram_tokens_answer_google_pay(tenant, b_key):
    answer = tenant.client.post("/wallet-b", google_body(tenant, b_key))
    assert answer.status == 201, answer
    assert set(answer.json) == {"google_pay"}
    resource = answer.json["google_pay"]
    assert "data" not in resource and PAN not in answer.raw.decode()
    assert resource["type"] == "network_token" and resource["authentication"]["eci_indicator"] == "05"
    assert resource["card"]["last4"] == PAN[-4:]
    as_text = dict(google_payment_data=json.dumps(google_body(tenant, b_key)["google_payment_data"]))
    assert tenant.client.post("/wallet-b", as_text).status == 201


def test_wallet_b_pan_only_tokens_answer_a_token_intent(tenant, b_key):
    answer = tenant.client.post("/wallet-b", google_body(tenant, b_key, "PAN_ONLY"))
    assert answer.status == 201, answer
    assert set(answer.json) == {"token_intent"}
    assert answer.json["token_intent"]["data"]["number"].endswith(PAN[-4:])
    assert PAN not in answer.raw.decode()
    assert stored(tenant.id, TokenIntent) == 1 and stored(tenant.id) == 0


def test_wallet_b_refusals(tenant, b_key):
    expired = WalletBIssuer(intermediate_expires_at=utcnow() - dt.timedelta(minutes=1))
    expired.root_key = HTTP_ISSUER.root_key
    cases = [
        (google_body(tenant, b_key, recipient="merchant:someone-else"), "message_signature_invalid"),
        (google_body(tenant, b_key, issuer=expired), "intermediate_key_expired"),
        (google_body(tenant, b_key, issuer=WalletBIssuer()), "intermediate_key_signature_invalid"),
        (google_body(tenant, new_key()), "decryption_failed"),
        (google_body(tenant, b_key, expires_at=utcnow() - dt.timedelta(seconds=1)), "message_expired"),
    ]
    for body, code in cases:
        answer = tenant.client.post("/wallet-b", body)
        assert answer.status == 422, (code, answer)
        assert answer.json["code"] == code
    body = google_body(tenant, b_key)
    body["google_payment_data"]["signedMessage"] = body["google_payment_data"]["signedMessage"].replace("a", "b", 1)
    assert tenant.client.post("/wallet-b", body).json["code"] == "message_signature_invalid"
    assert stored(tenant.id) == 0 and stored(tenant.id, TokenIntent) == 0


def test_wallet_b_without_keys_and_permissions(tenant, limited):
    answer = tenant.client.post("/wallet-b", google_body(tenant, new_key()))
    assert answer.status == 422 and answer.json["code"] == "merchant_key_not_found"
    creator = limited(tenant, ["wallet-b:create"])
    assert creator.post("/wallet-b/merchant-keys", {"private_key": key_pem(new_key()).decode()}).status == 403
    assert limited(tenant, ["wallet-a:create"]).post("/wallet-b", google_body(tenant, new_key())).status == 403


def test_wallet_b_keys_are_listed_and_deleted(tenant, b_key):
    listed = tenant.client.get("/wallet-b/merchant-keys").json["data"]
    assert len(listed) == 1
    assert tenant.client.get("/wallet-a/merchant-certificates").json["data"] == []
    assert tenant.client.delete(f"/wallet-a/merchant-certificates/{listed[0]['id']}").status == 404
    assert tenant.client.delete(f"/wallet-b/merchant-keys/{listed[0]['id']}").status == 204
    answer = tenant.client.post("/wallet-b", google_body(tenant, b_key))
    assert answer.status == 422 and answer.json["code"] == "merchant_key_not_found"


# ---- the shut-down connections -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "replacement"),
    [
        ("POST", "/connections/wallet-a/session", "/wallet-a/session"),
        ("POST", "/connections/apple-pay/domain-registration", "/wallet-a/domain-registration"),
        ("GET", "/connections/wallet-a/domain-registration", "/wallet-a/domain-registration"),
        ("POST", "/connections/wallet-a", "/wallet-a"),
        ("POST", "/connections/google-pay", "/wallet-b"),
    ],
)
def test_wallet_connections_are_gone(tenant, method, path, replacement):
    answer = tenant.client.request(method, path, body={})
    assert answer.status == 410, answer
    assert answer.json["replacement"] == replacement and "July 1, 2026" in answer.json["detail"]


def test_other_connections_are_not_wallets(tenant):
    assert tenant.client.post("/connections/someone", {}).status == 404


# ---- proxy expressions ---------------------------------------------------------------------------


def _proxy(tenant, body: dict, *permissions: str):
    caller = Caller(
        tenant.id, "test", tenant.application_id, "server_to_server", frozenset(permissions or ("proxy:invoke",))
    )
    with session_scope() as session:
        return detokenize(
            caller, SqlValueLoader(session), headers=[], body=json.dumps(body).encode(), content_type="application/json"
        )


def test_proxy_expressions_read_a_wallet_token_and_use_up_its_cryptogram(tenant, merchant, b_key):
    a_id = tenant.client.post("/wallet-a", apple_body(merchant)).json["wallet_a"]["id"]
    b_id = tenant.client.post("/wallet-b", google_body(tenant, b_key)).json["google_pay"]["id"]
    template = {
        "number": f'{{{{ wallet-a: {a_id} | json: "$.data.number" }}}}',
        "cryptogram": f'{{{{ wallet-a: {a_id} | json: "$.authentication.threeds_cryptogram" }}}}',
        "eci": f'{{{{ wallet-a: {a_id} | json: "$.authentication.eci_indicator" }}}}',
        "b_number": f'{{{{ wallet-b: {b_id} | json: "$.data.number" }}}}',
    }
    first = json.loads(_proxy(tenant, template).body)
    assert first == {"number": PAN, "cryptogram": CRYPTOGRAM, "eci": "7", "b_number": PAN}
    second = json.loads(_proxy(tenant, template).body)
    assert second == {"number": PAN, "cryptogram": "", "eci": "7", "b_number": PAN}
    revealed = tenant.client.get(f"/wallet-a/{a_id}").json
    assert revealed["authentication"]["threeds_cryptogram"] is None


def test_proxy_expressions_need_proxy_invoke_and_an_existing_wallet_token(tenant, other_tenant, merchant):
    a_id = tenant.client.post("/wallet-a", apple_body(merchant)).json["wallet_a"]["id"]
    body = {"n": f'{{{{ wallet-a: {a_id} | json: "$.data.number" }}}}'}
    with pytest.raises(ProxyError) as denied:
        _proxy(tenant, body, "wallet-a:reveal")
    assert denied.value.status == 403
    with pytest.raises(ProxyError) as unknown:
        _proxy(other_tenant, body)
    assert unknown.value.status == 400
    wrong_wallet = {"n": f'{{{{ wallet-b: {a_id} | json: "$.data.number" }}}}'}
    with pytest.raises(ProxyError):
        _proxy(tenant, wrong_wallet)


# ---- the public vector, an injected clock, the cryptogram's retention ---------------------------

VECTOR_SIGNED_AT = dt.datetime(2021, 9, 1, 19, 3, 6, tzinfo=dt.UTC)


def test_the_public_vector_decrypts_over_http_with_its_root_and_a_fixed_clock(tenant, wallet_a_vector, monkeypatch):
    from domain.wallets import service

    settings = service.get_settings()
    monkeypatch.setattr(
        service, "get_settings", lambda: settings.model_copy(update={"wallet_a_root_ca": wallet_a_vector["root_path"]})
    )
    monkeypatch.setattr(service, "CLOCK", lambda: VECTOR_SIGNED_AT)
    added = tenant.client.post(
        "/wallet-a/merchant-certificates",
        {
            "certificate": wallet_a_vector["certificate"].decode(),
            "private_key": wallet_a_vector["private_key"].decode(),
        },
    )
    assert added.status == 201, added
    assert added.json["public_key_hash"] == wallet_a_vector["token"]["header"]["publicKeyHash"]
    token = wallet_a_vector["token"]
    body = {"apple_payment_data": {"paymentData": token, "transactionIdentifier": token["header"]["transactionId"]}}
    created = tenant.client.post("/wallet-a", body)
    assert created.status == 201, created
    revealed = tenant.client.get(f"/wallet-a/{created.json['wallet_a']['id']}").json
    assert revealed["data"] == {"number": "5353756319181169", "expiration_month": 9, "expiration_year": 2024}
    assert revealed["transaction_id"] == token["header"]["transactionId"].lower()

    monkeypatch.setattr(service, "CLOCK", lambda: VECTOR_SIGNED_AT + dt.timedelta(minutes=6))
    late = tenant.client.post("/wallet-a", body)
    assert late.status == 422 and late.json["code"] == "signing_time_out_of_window", late
    monkeypatch.setattr(service, "CLOCK", lambda: VECTOR_SIGNED_AT)
    tampered = copy.deepcopy(body)
    tampered["apple_payment_data"]["paymentData"]["data"] = flip(token["data"])
    assert tenant.client.post("/wallet-a", tampered).json["code"] == "message_digest_mismatch"


def test_an_unused_cryptogram_is_gone_after_its_retention(tenant, merchant, limited):
    created = tenant.client.post("/wallet-a", apple_body(merchant)).json["wallet_a"]
    with session_scope() as session:
        row = session.get(WalletToken, uuid.UUID(created["id"]))
        assert row.cryptogram_ct is not None and CRYPTOGRAM.encode() not in row.cryptogram_ct  # sealed
        assert row.cryptogram_expires_at > utcnow()
        row.cryptogram_expires_at = utcnow() - dt.timedelta(seconds=1)
        session.add(row)
    revealed = limited(tenant, ["wallet-a:reveal"]).get(f"/wallet-a/{created['id']}")
    assert revealed.json["authentication"]["threeds_cryptogram"] is None
    assert revealed.json["data"]["number"] == PAN
    with session_scope() as session:
        assert session.get(WalletToken, uuid.UUID(created["id"])).cryptogram_ct is None


def test_wallet_operations_are_logged(tenant, merchant):
    created = tenant.client.post("/wallet-a", apple_body(merchant)).json["wallet_a"]
    tenant.client.get(f"/wallet-a/{created['id']}")
    logs = tenant.client.get("/logs").json["data"]
    rows = [(row["entity_type"], row["operation"]) for row in logs if row["entity_id"] == created["id"]]
    assert ("wallet-a", "create") in rows and ("wallet-a", "read") in rows
    types = {t["value"] for t in tenant.client.get("/logs/entity-types").json}
    assert {"wallet-a", "wallet-b", "wallet-a-merchant-key", "wallet-a-domain"} <= types
