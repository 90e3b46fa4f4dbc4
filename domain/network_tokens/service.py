"""Network tokens: provisioning through jobs, reads, card art, cryptograms, suspend, resume, delete
(spec, core document: sections 2 "Network token", "Network token details", "Network token account",
"Cryptogram"; 3 states; 4 "Network tokens"; proxy rule 7).

Every call to the card network runs in a worker (``spec/README.md`` decision 5): the API records a job
(:func:`infra.jobs.record`) in the transaction of its change, waits for the outcome without blocking the
event loop (woken by the job's outcome message, ``infra/wait.py``; up to
``TESSERA_NETWORK_TOKEN_WAIT_SECONDS``) and answers with what is known. The tasks in
``tasks/network_tokens.py`` are thin shells around the ``*_input`` / ``apply_*`` /
``*_failed`` functions here. The job id is the network's idempotency key, so a job run twice (a worker
killed after the network answered and before its commit) gets the same network token, not a second one.

States (the spec's table; ``inactive`` is ours to design):

* ``POST /network-tokens`` records the network token ``inactive`` with a ``network_tokens.provision``
  job. Success makes it ``active`` (event ``network-token.created``). A permanent failure (declined,
  unsupported network) or a dead letter **removes** the row, so nothing unusable stays behind: the
  waiting create answers 422, or, when it had already answered 202, the event ``network-token.failed``
  tells it, and ``GET /network-tokens/{id}`` answers 404 saying the provisioning failed.
* ``PUT .../suspend``: ``active`` -> ``suspended`` once the network confirms (event
  ``network-token.suspended``); ``PUT .../resume``: ``suspended`` -> ``active`` (``network-token.resumed``).
  Any other starting state is a 409, as is a second change while one is under way.
* ``DELETE``: any state -> removed at once (204, event ``network-token.deleted``); the network is told by
  a ``network_tokens.delete`` job, retried until it confirms. A network token removed while its
  provisioning ran is deleted at the network as soon as the network answers.

At rest: the network token's data (the DPAN and its expiration) and the provisioning input (card
number, cvc, cardholder) are sealed with the tenant's key (purposes ``network-token`` and
``network-token-source``); the provisioning input is dropped when the job ends. Cryptograms are never
stored: the worker seals each one to a one-time X25519 public key of the waiting request, whose
private key never leaves that request's memory, and the sealed value is wiped when read.
Events carry ids and status only; log rows use the entity type ``network-token``.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlalchemy import ScalarSelect, update
from sqlmodel import Session, col, select

from domain.network_tokens.token_intents import load_intent_data
from domain.tenancy import audit
from domain.tenancy.auth import system_caller
from domain.tenancy.caller import Caller
from domain.tokens.cards import card_brand, validate_card
from domain.tokens.expressions import reveal_last_filter
from domain.tokens.service import load_token_data
from domain.webhooks import events
from infra import jobs
from infra.errors import Problem, not_found, validation_problem
from infra.jobs import PermanentError
from infra.lookup import parse_uuid
from providers import ProviderNotConfigured
from providers.card_network import (
    PROVIDER_NAME,
    CardNetwork,
    CardToProvision,
    Cryptogram,
    ProvisionedToken,
    card_network_for,
)
from storage.crypto import get_keyring
from storage.db import Rows, read_first, session_scope, stage_rows
from storage.models import Job, Tenant
from storage.models_network_tokens import NetworkToken
from storage.states import JOB_FAILED, JobStatus, NetworkTokenStatus
from storage.types import TextAsUuid, table_of, utcnow

PROVISION_TASK = "network_tokens.provision"
CARD_ART_TASK = "network_tokens.card_art"
CRYPTOGRAM_TASK = "network_tokens.cryptogram"
SUSPEND_TASK = "network_tokens.suspend"
RESUME_TASK = "network_tokens.resume"
DELETE_TASK = "network_tokens.delete"
EXPIRE_INTENTS_TASK = "network_tokens.expire_token_intents"
#: The subject type of the jobs on one network token (``Job.subject_type``).
SUBJECT = "network_token"

READ, REVEAL = "network-token:read", "network-token:reveal"
ENTITY_TYPE = "network-token"
DATA_PURPOSE = "network-token"
SOURCE_PURPOSE = "network-token-source"

PROVISION_MAX_ATTEMPTS = 6
"""Provisioning attempts before a dead letter; transient failures wait 1, 2, 4, 8, 16 s (±20 %)."""
PROVISION_BACKOFF_BASE = 1.0
CHANGE_MAX_ATTEMPTS = 5
"""Attempts of a suspend or resume before it is given up (the token keeps its state)."""
CALL_MAX_ATTEMPTS = 3
"""Attempts of a card art or cryptogram call (its caller waits for it)."""
DELETE_MAX_ATTEMPTS = 10
"""Attempts to tell the network about a deletion before a dead letter (replayable with requeue)."""
CARD_ART_TTL = dt.timedelta(hours=24)
"""How long fetched card art is answered from the database before the network is asked again."""

_SOURCES = ("data", "token_id", "token_intent_id")
_DATA_KEYS = ("number", "expiration_month", "expiration_year", "cvc")
_TOKENS = table_of(NetworkToken)


@dataclass(frozen=True)
class Started:
    """A network token operation recorded as a job: the network token and the job to wait for."""

    network_token_id: uuid.UUID
    job_id: uuid.UUID


# ---- views ---------------------------------------------------------------------------------------


def _reveals(caller: Caller) -> bool:
    """True when ``caller`` sees the complete number (``network-token:reveal`` wins over read)."""
    return caller.has(REVEAL)


def mask_number(number: str) -> str:
    """The network token number with only its last four digits visible (``XXXXXXXXXXXX7892``)."""
    return reveal_last_filter(number, 4) or ""


def _open_data(session: Session, token: NetworkToken) -> dict | None:
    if token.data_ct is None:
        return None
    plain = get_keyring().decrypt(session, token.tenant_id, DATA_PURPOSE, str(token.id), token.data_ct)
    return json.loads(plain)


def network_token_view(token: NetworkToken, data: dict | None, *, reveal: bool) -> dict:
    """The network token object (spec section 2).

    ``data`` (the plain ``{number, expiration_month, expiration_year}``, None while inactive) is shown
    with ``number`` complete when ``reveal``, else masked to its last four digits. ``network_token``
    is None while inactive. ``token_id`` / ``token_intent_id`` are null unless the network token was
    made from a token / an intent. ``_extras``: ``merchant_id`` (as sent), ``network_reference`` (the
    card network's own id of the token, null while inactive).
    """
    shown = None
    if data is not None:
        shown = {
            "number": data["number"] if reveal else mask_number(data["number"]),
            "expiration_month": data["expiration_month"],
            "expiration_year": data["expiration_year"],
        }
    return {
        "id": token.id,
        "tenant_id": token.tenant_id,
        "data": shown,
        "network_token": token.details,
        "card": dict(token.card or {}),
        "status": token.status,
        "par": token.par,
        "token_id": token.token_id,
        "token_intent_id": token.token_intent_id,
        "created_by": token.created_by,
        "created_at": token.created_at,
        "modified_by": token.modified_by,
        "modified_at": token.modified_at,
        "_extras": {"merchant_id": token.merchant_id, "network_reference": token.network_reference},
    }


def _view(session: Session, caller: Caller, token: NetworkToken) -> dict:
    return network_token_view(token, _open_data(session, token), reveal=_reveals(caller))


def _event(
    session: Session, token_id: uuid.UUID, tenant_id: uuid.UUID, kind: str, status: str, trace_id: str | None
) -> None:
    """Emit ``network-token.<kind>`` with ids and status only."""
    events.emit(
        session,
        tenant_id=tenant_id,
        type=f"network-token.{kind}",
        data={"network_token": {"id": str(token_id), "status": status}},
        trace_id=trace_id,
    )


# ---- lookups -------------------------------------------------------------------------------------


def _get(session: Session, tenant_id: uuid.UUID, token_id: object, *, lock: bool = False) -> NetworkToken:
    """The tenant's network token, else a 404 problem (another tenant's answers the same)."""
    parsed = parse_uuid(token_id)
    token = None
    if parsed is not None:
        query = select(NetworkToken).where(NetworkToken.id == parsed, NetworkToken.tenant_id == tenant_id)
        if lock:
            query = query.with_for_update().execution_options(populate_existing=True)
        token = session.exec(query).first()
    if token is None:
        raise not_found("network token")
    return token


def _removed_by_failure(session: Session, tenant_id: uuid.UUID, token_id: object) -> Problem:
    """The 404 of a network token that is not there: it names the provisioning failure when the
    tenant's network token was removed because its provisioning failed."""
    parsed = parse_uuid(token_id)
    job = None
    if parsed is not None:
        job = session.exec(
            select(Job).where(
                Job.kind == PROVISION_TASK,
                Job.subject_id == str(parsed),
                Job.tenant_id == tenant_id,
                col(Job.status).in_(JOB_FAILED),
            )
        ).first()
    if job is None:
        return not_found("network token")
    code = (job.result or {}).get("code") or "network_unavailable"
    return Problem(404, f"The network token was removed: its provisioning failed ({code}).", extra={"code": code})


def read_network_token(session: Session, caller: Caller, token_id: object) -> dict:
    """``GET /network-tokens/{id}``: the object by the read rules; a ``read`` log row.

    404 when missing or another tenant's (naming the provisioning failure when that removed it).
    """
    try:
        token = _get(session, caller.tenant_id, token_id)
    except Problem:
        raise _removed_by_failure(session, caller.tenant_id, token_id) from None
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="read")
    return _view(session, caller, token)


def proxy_value(session: Session, tenant_id: uuid.UUID, network_token_id: object) -> dict:
    """The network token object with complete data, for the proxy's
    ``{{ network_token: ID | json: "$.data.number" }}`` expressions (spec, Proxy rule 7).

    No permission check and no log row (the proxy does both). Cryptograms and ECI values are never
    part of it. Raises a 404 problem for a missing or other tenant's network token and a 422 problem
    for one that cannot be used for transactions (``inactive`` or ``suspended``).
    """
    token = _get(session, tenant_id, network_token_id)
    if token.status != NetworkTokenStatus.ACTIVE:
        raise Problem(
            422, f"The network token {token.id} is {token.status}; it cannot be used.", title="Network token not usable"
        )
    return network_token_view(token, _open_data(session, token), reveal=True)


# ---- create --------------------------------------------------------------------------------------


@dataclass
class _Source:
    card: dict
    token_id: str | None = None
    intent_id: uuid.UUID | None = None


def _resolve_source(session: Session, caller: Caller, request: dict, now: dt.datetime) -> _Source:
    """The card of a create request (spec section 4 rules), or a 400 problem keyed by property."""
    errors: dict[str, list[str]] = {}
    given = [name for name in _SOURCES if request.get(name) is not None]
    if not given:
        raise validation_problem({"body": ["exactly one of data, token_id and token_intent_id is required"]})
    if len(given) > 1:
        raise validation_problem({name: ["send only one of data, token_id and token_intent_id"] for name in given})
    month, year = request.get("expiration_month"), request.get("expiration_year")
    if (month is None) != (year is None):
        missing = "expiration_year" if year is None else "expiration_month"
        errors[missing] = ["expiration_month and expiration_year must be sent together"]
    source = _Source(card={})
    if given[0] == "data":
        if month is not None or year is not None:
            for name in ("expiration_month", "expiration_year"):
                errors.setdefault(name, []).append(
                    "an expiration override is accepted only with token_id or token_intent_id"
                )
        data = request["data"]
        card, found = validate_card(data, today=now.date(), prefix="data")
        errors.update(found)
        if isinstance(data, dict):
            if "name" in data:
                errors.setdefault("data.name", []).append("This property is not allowed; send cardholder_info.name.")
            for name in ("expiration_month", "expiration_year"):
                if data.get(name) is None:
                    errors.setdefault(f"data.{name}", []).append("is required")
        if errors:
            raise validation_problem(errors)
        source.card = card
    elif given[0] == "token_id":
        try:
            token, data = load_token_data(session, caller.tenant_id, str(request["token_id"]), now=now)
        except Problem:
            token, data = None, None
        if token is None:
            errors["token_id"] = ["no token of the tenant has this id"]
        elif token.type != "card" or not isinstance(data, dict) or not data.get("number"):
            errors["token_id"] = ["must name a token holding card data with a number"]
        else:
            source.card, source.token_id = dict(data), token.id
    else:
        try:
            intent, data = load_intent_data(session, caller.tenant_id, request["token_intent_id"], now=now)
        except Problem:
            intent, data = None, None
        if intent is None:
            errors["token_intent_id"] = ["no token intent of the tenant has this id"]
        elif not data.get("number"):
            errors["token_intent_id"] = ["must name a token intent holding card data with a number"]
        else:
            # an intent that became a token already: the network token names both
            source.card, source.intent_id, source.token_id = dict(data), intent.id, intent.token_id
    if errors:
        raise validation_problem(errors)
    if month is not None:
        source.card["expiration_month"], source.card["expiration_year"] = month, year
    month, year = source.card.get("expiration_month"), source.card.get("expiration_year")
    if month is None or year is None:
        message = "the source has no expiration; send expiration_month and expiration_year"
        raise validation_problem({"expiration_month": [message], "expiration_year": [message]})
    if (year, month) < (now.year, now.month):
        where = "expiration_year" if request.get("expiration_year") is not None else given[0]
        raise validation_problem({where: [f"the card expired (valid through {month:02d}/{year})"]})
    return source


def _card_view(card: dict) -> dict:
    """The ``card`` object: brand, first six digits, last four, expiration (overrides applied)."""
    number = card["number"]
    return {
        "brand": card_brand(number),
        "bin": number[:6],
        "last4": number[-4:],
        "expiration_month": card["expiration_month"],
        "expiration_year": card["expiration_year"],
    }


def _cardholder(info: dict | None, card: dict) -> dict | None:
    """The cardholder sent to the network: ``cardholder_info``, its name defaulting to the card's."""
    info = {k: v for k, v in (info or {}).items() if v is not None}
    address = {k: v for k, v in (info.get("address") or {}).items() if v is not None}
    name = info.get("name") or card.get("name")
    holder = {key: value for key, value in (("name", name), ("address", address)) if value}
    return holder or None


def create_network_token(session: Session, caller: Caller, request: dict, *, now: dt.datetime | None = None) -> Started:
    """``POST /network-tokens``: record the network token (``inactive``) and its provisioning job.

    ``request``: ``data`` | ``token_id`` | ``token_intent_id`` (exactly one), ``expiration_month`` +
    ``expiration_year`` (overrides, only with a token or an intent, only together),
    ``cardholder_info`` ``{name?, address?}``, ``merchant_id`` (uuid string or None). 422
    (:class:`providers.ProviderNotConfigured`) for a production tenant without a live card network;
    400 keyed by property for the rules of spec section 4. Writes a ``create`` log row (and a ``read``
    row for a source token or intent). The job's task is sent when the caller's transaction commits.
    """
    now = now or utcnow()
    card_network_for(caller)  # a production tenant without a configured network: 422 before anything
    source = _resolve_source(session, caller, request, now)
    card = source.card
    rows = Rows()  # every row in one statement, no ORM object (``storage.db.insert_rows``)
    if source.intent_id is not None:  # the source's data was read: its own log row
        audit.stage(rows, caller, entity_type="token-intent", entity_id=source.intent_id, operation="read")
    elif source.token_id is not None:
        audit.stage(rows, caller, entity_type="card", entity_id=source.token_id, operation="read")
    token_id = uuid.uuid4()
    provisioning = {key: card[key] for key in _DATA_KEYS if card.get(key) is not None}
    cardholder = _cardholder(request.get("cardholder_info"), card)
    if cardholder:
        provisioning["cardholder"] = cardholder
    source_ct = get_keyring().encrypt(
        session, caller.tenant_id, SOURCE_PURPOSE, str(token_id), json.dumps(provisioning).encode()
    )
    job_id = jobs.record(
        session,
        rows=rows,
        kind=PROVISION_TASK,
        tenant_id=caller.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(token_id),
        trace_id=caller.trace_id,
        max_attempts=PROVISION_MAX_ATTEMPTS,
    ).id
    rows.add(
        _TOKENS,
        {
            "id": token_id,
            "tenant_id": caller.tenant_id,
            "status": NetworkTokenStatus.INACTIVE,
            "data_ct": None,
            "details": None,
            "card": _card_view(card),
            "source_ct": source_ct,
            "par": None,
            "network_reference": None,
            "token_id": source.token_id,
            "token_intent_id": source.intent_id,
            "merchant_id": str(request["merchant_id"]) if request.get("merchant_id") else None,
            "pending_job_id": job_id,
            "announced": False,
            "card_art": None,
            "card_art_at": None,
            "created_by": caller.application_id,
            "created_at": now,
            "modified_by": None,
            "modified_at": None,
        },
    )
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=token_id, operation="create")
    stage_rows(session, rows)
    return Started(token_id, job_id)


def _locked_job(session: Session, job_id: uuid.UUID) -> Job:
    """The job row, locked until the end of the transaction (serialises with the worker's outcome).

    Lock order everywhere: the job row first, then the network token row (no deadlocks)."""
    return session.exec(
        select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).one()


def provisioning_problem(job: Job) -> Problem:
    """The problem answered for a provisioning job that failed for good (or became a dead letter)."""
    code = (job.result or {}).get("code")
    if job.status == JobStatus.DEAD or code is None:
        return Problem(
            502,
            "The card network could not be reached; no network token was provisioned.",
            title="Card network unavailable",
            extra={"code": "network_unavailable"},
        )
    if code == "card_not_eligible":
        return Problem(
            422,
            "The card network declined the card: it is not eligible for a network token.",
            title="Card not eligible",
            extra={"code": code},
        )
    if code == "network_not_supported":
        return Problem(
            422,
            "The card's network does not issue network tokens.",
            title="Network not supported",
            extra={"code": code},
        )
    if code == "provider_not_configured":
        return ProviderNotConfigured(PROVIDER_NAME)
    return Problem(
        422,
        f"The card network refused to provision a network token ({code}).",
        title="Provisioning failed",
        extra={"code": code},
    )


def provisioning_outcome(
    session: Session, caller: Caller, started: Started, *, status: str | None = None
) -> tuple[int, dict]:
    """After the bounded wait: ``(201, active object)``, ``(202, inactive object)`` or a raised problem.

    ``status``: the job's status the wait ended with. A ``succeeded`` job is settled for good: the
    network token is read without locks. Otherwise the job row is locked while deciding, so a worker
    finishing at this moment either is seen (201 / 422) or sees the 202 (``announced``) and emits
    ``network-token.failed`` if it fails.
    """
    if status == JobStatus.SUCCEEDED:  # one read outside any transaction, a plain row
        token = read_first(
            select(_TOKENS).where(_TOKENS.c.id == started.network_token_id, _TOKENS.c.tenant_id == caller.tenant_id)
        )
        if token is not None and token.status != NetworkTokenStatus.INACTIVE:
            return 201, _view(session, caller, token)
    job = _locked_job(session, started.job_id)
    if job.status in JOB_FAILED:
        raise provisioning_problem(job)
    token = _get(session, caller.tenant_id, started.network_token_id, lock=True)
    if job.status == JobStatus.SUCCEEDED and token.status != NetworkTokenStatus.INACTIVE:
        return 201, _view(session, caller, token)
    token.announced = True
    session.add(token)
    return 202, _view(session, caller, token)


# ---- the provisioning job (worker side) ----------------------------------------------------------


def network_for_job(session: Session, job: Job) -> CardNetwork:
    """The adapter for the job's tenant; PermanentError ``provider_not_configured`` when none."""
    tenant = session.get(Tenant, job.tenant_id)
    return _network_for(job, tenant.type if tenant is not None else None)


def _of_token(column) -> ScalarSelect:
    """``column`` of the job's network token (its subject), as a scalar subquery over the job row."""
    return select(column).where(NetworkToken.id == TextAsUuid(Job.subject_id)).scalar_subquery()


def _tenant_type() -> ScalarSelect:
    return select(Tenant.type).where(Tenant.id == Job.tenant_id).scalar_subquery()


def provisioning_reads() -> dict[str, ScalarSelect]:
    """What a provisioning job needs, read by its lease statement (:func:`infra.jobs.lease`):
    the tenant's type and the network token's tenant, status, sealed input and merchant."""
    return {
        "tenant_type": _tenant_type(),
        "token_tenant_id": _of_token(NetworkToken.tenant_id),
        "status": _of_token(NetworkToken.status),
        "source_ct": _of_token(NetworkToken.source_ct),
        "merchant_id": _of_token(NetworkToken.merchant_id),
    }


def _network_for(job: Job, tenant_type: str | None) -> CardNetwork:
    if tenant_type is None:
        raise PermanentError("tenant_removed", "the tenant no longer exists")
    try:
        return card_network_for(tenant_type)
    except ProviderNotConfigured as exc:
        raise PermanentError("provider_not_configured", str(exc)) from None


def provisioning_input(job: Job, read: dict) -> tuple[CardNetwork, CardToProvision] | None:
    """What the provisioning job sends (``read``: :func:`provisioning_reads`' values): the adapter and
    the card. None when there is nothing to do (the network token was removed, or is no longer
    inactive). Raises PermanentError ``tenant_removed`` / ``provider_not_configured``."""
    if (
        read["token_tenant_id"] != job.tenant_id
        or read["status"] != NetworkTokenStatus.INACTIVE
        or read["source_ct"] is None
    ):
        return None
    with session_scope() as session:  # the tenant's key is cached: no statement runs
        source = json.loads(
            get_keyring().decrypt(session, job.tenant_id, SOURCE_PURPOSE, str(job.subject_id), read["source_ct"])
        )
    card = CardToProvision(
        number=source["number"],
        expiration_month=source["expiration_month"],
        expiration_year=source["expiration_year"],
        cvc=source.get("cvc"),
        cardholder=source.get("cardholder"),
        merchant_id=read["merchant_id"],
    )
    return _network_for(job, read["tenant_type"]), card


def _record_network_delete(session: Session, tenant_id: uuid.UUID, reference: str, trace_id: str | None) -> Job:
    return jobs.record(
        session,
        kind=DELETE_TASK,
        tenant_id=tenant_id,
        subject_type="network_reference",
        subject_id=reference,
        trace_id=trace_id,
        max_attempts=DELETE_MAX_ATTEMPTS,
    )


def apply_provisioned(session: Session, job: Job, outcome: ProvisionedToken | None) -> dict:
    """Write the network's answer: the token becomes ``active`` (DPAN sealed, details, PAR), its
    provisioning input is dropped, ``network-token.created`` is emitted. A network token removed
    meanwhile is deleted at the network instead. Returns the job result (ids only)."""
    result = {"network_token_id": job.subject_id}
    if outcome is None:
        return {**result, "skipped": True}
    token_id = parse_uuid(job.subject_id)
    data = {
        "number": outcome.number,
        "expiration_month": outcome.expiration_month,
        "expiration_year": outcome.expiration_year,
    }
    status = (
        outcome.status
        if outcome.status in (NetworkTokenStatus.ACTIVE, NetworkTokenStatus.SUSPENDED)
        else NetworkTokenStatus.ACTIVE
    )
    # One statement: the job row is locked already (``JobTask``), so the lock order is the job row,
    # then the network token; only an inactive network token of the job's tenant is changed.
    changed = session.execute(
        update(_TOKENS)
        .where(
            _TOKENS.c.id == token_id,
            _TOKENS.c.tenant_id == job.tenant_id,
            _TOKENS.c.status == NetworkTokenStatus.INACTIVE,
        )
        .values(
            data_ct=get_keyring().encrypt(
                session, job.tenant_id, DATA_PURPOSE, str(token_id), json.dumps(data).encode()
            ),
            details=outcome.details,
            par=outcome.par,
            network_reference=outcome.reference,
            status=status,
            source_ct=None,
            pending_job_id=None,
            modified_at=utcnow(),
        )
        .returning(_TOKENS.c.id)
    ).first()
    if changed is None:
        found = session.execute(select(_TOKENS.c.tenant_id).where(_TOKENS.c.id == token_id).with_for_update()).first()
        if found is None or found.tenant_id != job.tenant_id:  # removed meanwhile
            _record_network_delete(session, job.tenant_id, outcome.reference, job.trace_id)
            return {**result, "removed": True}
        return {**result, "skipped": True}
    _event(session, token_id, job.tenant_id, "created", status, job.trace_id)
    return result


def provisioning_failed(session: Session, job: Job, error: Exception) -> None:
    """A permanent failure or a dead letter: remove the inactive network token (a ``delete`` log
    row by the system); emit ``network-token.failed`` when the create had answered 202."""
    session.flush()  # the job's failure first: it waits for a create handler holding the job's lock
    token = session.exec(
        select(NetworkToken).where(NetworkToken.id == parse_uuid(job.subject_id)).with_for_update()
    ).first()
    if token is None or token.tenant_id != job.tenant_id or token.status != NetworkTokenStatus.INACTIVE:
        return
    announced = token.announced
    session.delete(token)
    tenant = session.get(Tenant, token.tenant_id)
    if tenant is not None:
        audit.record(session, system_caller(tenant), entity_type=ENTITY_TYPE, entity_id=token.id, operation="delete")
    if announced:
        _event(session, token.id, token.tenant_id, "failed", "failed", job.trace_id)


# ---- suspend, resume -----------------------------------------------------------------------------

_CHANGES = {
    "suspend": (NetworkTokenStatus.ACTIVE, NetworkTokenStatus.SUSPENDED, SUSPEND_TASK),
    "resume": (NetworkTokenStatus.SUSPENDED, NetworkTokenStatus.ACTIVE, RESUME_TASK),
}
_CHANGE_EVENTS = {"suspend": "suspended", "resume": "resumed"}


def request_change(session: Session, caller: Caller, token_id: object, action: str) -> Started:
    """``PUT /network-tokens/{id}/suspend`` or ``/resume``: record the job telling the network.

    ``action``: ``suspend`` (from ``active``) or ``resume`` (from ``suspended``); any other starting
    state, or another change still under way, is a 409 problem. 404 as :func:`read_network_token`.
    Writes an ``update`` log row.
    """
    required, _, task = _CHANGES[action]
    token = _get(session, caller.tenant_id, token_id, lock=True)
    if token.status != required:
        raise Problem(
            409,
            f"Only a {required} network token can be {_CHANGE_EVENTS[action]}; this one is {token.status}.",
            title="Conflict",
            extra={"status_now": token.status},
        )
    if token.pending_job_id is not None:
        pending = session.get(Job, token.pending_job_id)
        if pending is not None and pending.status not in jobs.TERMINAL:
            raise Problem(
                409, "Another change of this network token is under way; retry when it ends.", title="Conflict"
            )
    job = jobs.record(
        session,
        kind=task,
        tenant_id=caller.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(token.id),
        trace_id=caller.trace_id,
        max_attempts=CHANGE_MAX_ATTEMPTS,
    )
    token.pending_job_id = job.id
    token.modified_by = caller.application_id
    session.add(token)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="update")
    return Started(token.id, job.id)


def _change_problem(job: Job) -> Problem:
    code = (job.result or {}).get("code")
    if code == "token_deleted":
        return Problem(
            409,
            "The card network has deleted this network token; delete it here too.",
            title="Conflict",
            extra={"code": code},
        )
    if job.status == JobStatus.DEAD or code is None:
        return Problem(
            502,
            "The card network could not be reached; nothing was changed.",
            title="Card network unavailable",
            extra={"code": "network_unavailable"},
        )
    return Problem(
        502,
        f"The card network refused the change ({code}); nothing was changed.",
        title="Card network error",
        extra={"code": code},
    )


def change_outcome(session: Session, caller: Caller, started: Started) -> tuple[int, dict]:
    """After the bounded wait: ``(200, changed object)``, ``(202, object as it is)`` while the network
    has not confirmed yet, or a raised problem when the network refused (409 ``token_deleted``, 502)."""
    job = session.get(Job, started.job_id, populate_existing=True)
    if job.status in JOB_FAILED:
        raise _change_problem(job)
    token = _get(session, caller.tenant_id, started.network_token_id)
    return (200 if job.status == JobStatus.SUCCEEDED else 202), _view(session, caller, token)


def change_input(session: Session, job: Job) -> tuple[CardNetwork, str] | None:
    """The adapter and the network's id of the token a suspend/resume job changes; None when removed."""
    token = session.get(NetworkToken, parse_uuid(job.subject_id))
    if token is None or token.tenant_id != job.tenant_id or token.network_reference is None:
        return None
    return network_for_job(session, job), token.network_reference


def apply_change(session: Session, job: Job, action: str, network_status: str | None) -> dict:
    """The network confirmed: set the new status, emit ``network-token.suspended`` / ``.resumed``."""
    _, target, _ = _CHANGES[action]
    # the job row is locked already (``JobTask``): the lock order is the job row, then the network token
    token = session.get(NetworkToken, parse_uuid(job.subject_id), with_for_update=True)
    if network_status is None or token is None or token.tenant_id != job.tenant_id:
        return {"network_token_id": job.subject_id, "skipped": True}
    if token.pending_job_id == job.id:
        token.pending_job_id = None
    if token.status != target:
        token.status = target
        token.modified_at = utcnow()
        _event(session, token.id, token.tenant_id, _CHANGE_EVENTS[action], target, job.trace_id)
    session.add(token)
    return {"network_token_id": job.subject_id, "status": token.status}


def change_failed(session: Session, job: Job, error: Exception) -> None:
    """The network refused or could not be reached: the token keeps its status; the change is over."""
    session.flush()  # the job row first (lock order)
    token = session.get(NetworkToken, parse_uuid(job.subject_id), with_for_update=True)
    if token is not None and token.pending_job_id == job.id:
        token.pending_job_id = None
        session.add(token)


# ---- delete --------------------------------------------------------------------------------------


def delete_network_token(session: Session, caller: Caller, token_id: object) -> None:
    """``DELETE /network-tokens/{id}``: remove it now from any state; tell the network by a job.

    A provisioning still queued is cancelled (one already running deletes what the network issues).
    Emits ``network-token.deleted`` and writes a ``delete`` log row. 404 as :func:`read_network_token`.
    """
    token = _get(session, caller.tenant_id, token_id)
    if token.pending_job_id is not None:
        _locked_job(session, token.pending_job_id)  # lock order: the job row, then the network token
    token = _get(session, caller.tenant_id, token_id, lock=True)
    if token.network_reference:
        _record_network_delete(session, caller.tenant_id, token.network_reference, caller.trace_id)
    if token.pending_job_id is not None:
        session.execute(
            update(Job)
            .where(col(Job.id) == token.pending_job_id, col(Job.status) == JobStatus.QUEUED)
            .values(status=JobStatus.CANCELLED, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    session.delete(token)
    _event(session, token.id, token.tenant_id, "deleted", "deleted", caller.trace_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="delete")


def delete_input(session: Session, job: Job) -> tuple[CardNetwork, str]:
    """The adapter and the network's id (the job's subject) of a network-side deletion."""
    return network_for_job(session, job), str(job.subject_id)


# ---- card art ------------------------------------------------------------------------------------


def card_art_start(
    session: Session, caller: Caller, token_id: object, *, now: dt.datetime | None = None
) -> dict | Started:
    """``GET /network-tokens/{id}/account``: the account object when fresh card art is stored (at most
    24 hours old), else the job fetching it. 404 as :func:`read_network_token`; 409 while the network
    token is inactive (no card art exists yet). Writes a ``read`` log row."""
    now = now or utcnow()
    token = _get(session, caller.tenant_id, token_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="read")
    if token.status == NetworkTokenStatus.INACTIVE or token.network_reference is None:
        raise Problem(
            409, "The network token is not provisioned yet: its card art cannot be had.", title="Card art unavailable"
        )
    if token.card_art is not None and token.card_art_at is not None and now - token.card_art_at < CARD_ART_TTL:
        return {"card_art": token.card_art}
    job = jobs.record(
        session,
        kind=CARD_ART_TASK,
        tenant_id=caller.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(token.id),
        trace_id=caller.trace_id,
        max_attempts=CALL_MAX_ATTEMPTS,
    )
    return Started(token.id, job.id)


def card_art_outcome(session: Session, caller: Caller, started: Started) -> dict:
    """After the bounded wait: the account object, or a problem (502 the network failed, 504 it did
    not answer in time; the job is then cancelled unless it is running)."""
    job = session.get(Job, started.job_id, populate_existing=True)
    if job.status == JobStatus.SUCCEEDED:
        token = _get(session, caller.tenant_id, started.network_token_id)
        if token.card_art is not None:
            return {"card_art": token.card_art}
    if job.status in JOB_FAILED or job.status == JobStatus.SUCCEEDED:
        raise Problem(
            502,
            "The card network did not give the card art.",
            title="Card art unavailable",
            extra={"code": (job.result or {}).get("code") or "network_unavailable"},
        )
    jobs.cancel_if_queued(session, job.id)
    raise Problem(
        504,
        "The card network did not answer in time; retry.",
        title="Card art unavailable",
        extra={"code": "network_timeout"},
    )


def network_reference_input(session: Session, job: Job) -> tuple[CardNetwork, str] | None:
    """The adapter and the network's id of the job's network token; None when removed or inactive."""
    return change_input(session, job)


def apply_card_art(session: Session, job: Job, art: dict | None) -> dict:
    """Store the card art fetched (``{background_color, logo, card_image}``) with its time."""
    token = session.get(NetworkToken, parse_uuid(job.subject_id))
    if art is not None and token is not None and token.tenant_id == job.tenant_id:
        token.card_art = art
        token.card_art_at = utcnow()
        session.add(token)
    return {"network_token_id": job.subject_id}


# ---- cryptograms ---------------------------------------------------------------------------------


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
    token = _get(session, caller.tenant_id, token_id)
    if token.status != NetworkTokenStatus.ACTIVE or token.network_reference is None:
        raise Problem(
            409,
            f"Only an active network token has cryptograms; this one is {token.status}.",
            title="Conflict",
            extra={"status_now": token.status},
        )
    job = jobs.record(
        session,
        kind=CRYPTOGRAM_TASK,
        tenant_id=caller.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(token.id),
        trace_id=caller.trace_id,
        max_attempts=CALL_MAX_ATTEMPTS,
    )
    job.result = {"reply_key": reply_key}
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="cryptogram")
    return Started(token.id, job.id)


def cryptogram_outcome(session: Session, started: Started) -> dict:
    """After the bounded wait: ``{"sealed", "eci"}`` (the sealed value is wiped from the job row in
    this transaction), or a problem: 409 when the network says the token is not active, 502 when it
    failed, 504 when it did not answer in time (the job is then cancelled unless running)."""
    job = _locked_job(session, started.job_id)
    if job.status == JobStatus.SUCCEEDED and (job.result or {}).get("sealed"):
        sealed = dict(job.result)
        job.result = {"eci": sealed.get("eci"), "delivered": True}
        session.add(job)
        return sealed
    if job.status in JOB_FAILED or job.status == JobStatus.SUCCEEDED:
        code = (job.result or {}).get("code")
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
    raise Problem(
        504,
        "The card network did not answer in time; retry.",
        title="Cryptogram unavailable",
        extra={"code": "network_timeout"},
    )


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
