"""Cryptograms of network tokens: ``POST /network-tokens/{id}/cryptogram`` and its
``network_tokens.cryptogram`` job (spec, core document section 2 "Cryptogram").

Cryptograms are never stored: the waiting request makes a one-time X25519 key pair
(:func:`reply_keypair`), the worker seals the network's answer to its public key (:func:`seal_cryptogram`,
ECIES: ephemeral X25519, HKDF-SHA256, AES-256-GCM bound to the job id), and the request opens it
(:func:`open_cryptogram`); the sealed value is wiped from the job row when read.
"""

from __future__ import annotations

import base64
import json
import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlmodel import Session

from domain.network_tokens.errors import timed_out
from domain.network_tokens.records import (
    CALL_MAX_ATTEMPTS,
    CRYPTOGRAM_TASK,
    ENTITY_TYPE,
    Started,
    get_token,
    locked_job,
    record_job,
)
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra import jobs
from infra.errors import Problem
from infra.jobs import PermanentError
from providers.card_network import Cryptogram
from storage.models import Job
from storage.states import JOB_FAILED, JobStatus, NetworkTokenStatus


def reply_keypair() -> tuple[X25519PrivateKey, str]:
    """A one-time X25519 key pair for receiving a cryptogram: (private key, base64 public key)."""
    private = X25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return private, base64.b64encode(public).decode()


def _reply_key(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=ephemeral + recipient,
        info=b"tessera network-token cryptogram reply v1",
    ).derive(shared)


def seal_reply(public_key: str, plaintext: bytes, aad: bytes) -> str:
    """Encrypt ``plaintext`` to the base64 X25519 ``public_key`` (ECIES: ephemeral X25519, HKDF-SHA256,
    AES-256-GCM binding ``aad``). Base64 of ``ephemeral public (32) || nonce (12) || ciphertext``."""
    recipient = base64.b64decode(public_key)
    ephemeral = X25519PrivateKey.generate()
    ephemeral_public = ephemeral.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    key = _reply_key(ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient)), ephemeral_public, recipient)
    nonce = os.urandom(12)
    return base64.b64encode(ephemeral_public + nonce + AESGCM(key).encrypt(nonce, plaintext, aad)).decode()


def open_reply(private: X25519PrivateKey, sealed: str, aad: bytes) -> bytes:
    """Decrypt a value made by :func:`seal_reply` for ``private``'s public key."""
    raw = base64.b64decode(sealed)
    ephemeral_public, nonce, body = raw[:32], raw[32:44], raw[44:]
    recipient = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    key = _reply_key(private.exchange(X25519PublicKey.from_public_bytes(ephemeral_public)), ephemeral_public, recipient)
    return AESGCM(key).decrypt(nonce, body, aad)


def cryptogram_start(session: Session, caller: Caller, token_id: object, reply_key: str) -> Started:
    """``POST /network-tokens/{id}/cryptogram``: record the job asking the network for a cryptogram,
    sealed to ``reply_key`` (base64 X25519 public key of the waiting request). 404 as
    :func:`read_network_token`; 409 unless the network token is active. Writes a ``cryptogram`` log row."""
    token = get_token(session, caller.tenant_id, token_id)
    if token.status != NetworkTokenStatus.ACTIVE or token.network_reference is None:
        raise Problem(
            409,
            f"Only an active network token has cryptograms; this one is {token.status}.",
            title="Conflict",
            extra={"status_now": token.status},
        )
    job = record_job(session, CRYPTOGRAM_TASK, token, caller.trace_id, max_attempts=CALL_MAX_ATTEMPTS)
    job.result = {"reply_key": reply_key}
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="cryptogram")
    return Started(token.id, job.id)


def cryptogram_outcome(session: Session, started: Started) -> dict:
    """After the bounded wait: ``{"sealed", "eci"}`` (the sealed value is wiped from the job row in
    this transaction), or a problem: 409 when the network says the token is not active, 502 when it
    failed, 504 when it did not answer in time (the job is then cancelled unless running)."""
    job = locked_job(session, started.job_id)
    result = job.result or {}
    if job.status == JobStatus.SUCCEEDED and result.get("sealed"):
        sealed = dict(result)
        job.result = {"eci": sealed.get("eci"), "delivered": True}
        session.add(job)
        return sealed
    if job.status in JOB_FAILED or job.status == JobStatus.SUCCEEDED:
        code = result.get("code")
        if code == "token_not_active":
            raise Problem(
                409, "The card network says the network token is not active.", title="Conflict", extra={"code": code}
            )
        raise Problem(
            502,
            "The card network did not give a cryptogram.",
            title="Card network error",
            extra={"code": code or "network_unavailable"},
        )
    jobs.cancel_if_queued(session, job.id)
    raise timed_out("Cryptogram unavailable")


def seal_cryptogram(job: Job, cryptogram: Cryptogram) -> dict:
    """The job result carrying a cryptogram: sealed to the job's reply key, bound to the job id."""
    reply_key = (job.result or {}).get("reply_key")
    if not reply_key:
        raise PermanentError("no_reply_key", "the cryptogram job carries no reply key")
    plain = json.dumps({"cryptogram": cryptogram.cryptogram}).encode()
    return {"sealed": seal_reply(reply_key, plain, str(job.id).encode()), "eci": cryptogram.eci}


def open_cryptogram(private: X25519PrivateKey, started: Started, sealed: dict) -> dict:
    """The cryptogram object ``{cryptogram, eci}`` from :func:`cryptogram_outcome`'s sealed value."""
    plain = json.loads(open_reply(private, sealed["sealed"], str(started.job_id).encode()))
    return {"cryptogram": plain["cryptogram"], "eci": sealed.get("eci")}
