"""Provisioning a network token: ``POST /network-tokens`` and its ``network_tokens.provision`` job
(spec, core document section 4 "Network tokens"; section 3 states).

The API side records the network token ``inactive`` with its provisioning job in one statement
(:func:`create_network_token`), waits for the job's outcome (``infra/wait.py``) and answers it
(:func:`provisioning_outcome`). The worker side reads what it needs with the lease statement
(:func:`provisioning_reads`), calls the network outside any transaction (:func:`provisioning_input`
gives the adapter and the card; the job id is the network's idempotency key) and writes the answer
(:func:`apply_provisioned`; in one statement with the job's completion, :func:`provisioned_write`,
whose values its outcome message carries, the DPAN sealed as at rest, so the waiting create answers
without reading the row back) or removes the network token after a permanent failure or a dead
letter (:func:`provisioning_failed`).

At rest the provisioning input (card number, cvc, cardholder) is sealed with the tenant's key under
:data:`SOURCE_PURPOSE` and dropped when the job ends.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Update, bindparam, update
from sqlalchemy import select as select_rows
from sqlmodel import Session, select

from domain.network_tokens.errors import provisioning_problem
from domain.network_tokens.records import (
    ENTITY_TYPE,
    PROVISION_MAX_ATTEMPTS,
    PROVISION_TASK,
    SUBJECT,
    Started,
    emit,
    get_token,
    job_subject,
    locked_job,
    network_for,
    record_network_delete,
)
from domain.network_tokens.token_intents import load_intent_data
from domain.network_tokens.views import DATA_PURPOSE, caller_view, card_view, created_row, provisioned_values
from domain.tenancy import audit
from domain.tenancy.auth import system_caller
from domain.tenancy.caller import Caller
from domain.tokens.cards import validate_card
from domain.tokens.service import load_token_data
from domain.webhooks import events
from infra import jobs
from infra.errors import Problem, validation_problem
from infra.jobs import LeaseReads
from infra.lookup import parse_uuid
from infra.wait import Outcome
from providers.card_network import (
    CardNetwork,
    CardToProvision,
    ProvisionedToken,
    ensure_configured,
)
from storage.crypto import DecryptionError, KeyNotCached, get_keyring
from storage.db import Rows, insert_rows_last, lazy_session, read_first, server_prepared
from storage.models import Job, Tenant
from storage.models_network_tokens import NetworkToken
from storage.states import JOB_FAILED, JobStatus, NetworkTokenStatus
from storage.types import TextAsUuid, table_of, utcnow

log = logging.getLogger("tessera.network_tokens")

#: The purpose the provisioning input is sealed under (``storage.crypto``).
SOURCE_PURPOSE = "network-token-source"

#: The event of a provisioned network token (spec section 4; its data: ids and status).
CREATED_EVENT = "network-token.created"

_SOURCES = ("data", "token_id", "token_intent_id")
_DATA_KEYS = ("number", "expiration_month", "expiration_year", "cvc")
_TOKENS = table_of(NetworkToken)
#: A tenant's network token, the row as stored (built once, planned once per connection).
_READ_TOKEN = server_prepared(
    select_rows(_TOKENS).where(
        _TOKENS.c.id == bindparam("network_token_id", type_=_TOKENS.c.id.type),
        _TOKENS.c.tenant_id == bindparam("tenant_id", type_=_TOKENS.c.tenant_id.type),
    )
)


# ---- create --------------------------------------------------------------------------------------


@dataclass
class _Source:
    card: dict
    token_id: str | None = None
    intent_id: uuid.UUID | None = None


def _from_data(data: object, overridden: bool, now: dt.datetime, errors: dict[str, list[str]]) -> _Source:
    """Raw card data: every card rule of ``validate_card``; no overrides, no ``name``, both expirations."""
    if overridden:
        for name in ("expiration_month", "expiration_year"):
            errors.setdefault(name, []).append(
                "an expiration override is accepted only with token_id or token_intent_id"
            )
    card, found = validate_card(data, today=now.date(), prefix="data")
    errors.update(found)
    if isinstance(data, dict):
        if "name" in data:
            errors.setdefault("data.name", []).append("This property is not allowed; send cardholder_info.name.")
        for name in ("expiration_month", "expiration_year"):
            if data.get(name) is None:
                errors.setdefault(f"data.{name}", []).append("is required")
    if errors or card is None:  # no errors means a card (``validate_card``)
        raise validation_problem(errors)
    return _Source(card=card)


def _from_token(session: Session, caller: Caller, token_id: object, now: dt.datetime, errors: dict) -> _Source:
    """A card token of the tenant holding a number (else an error under ``token_id``)."""
    try:
        token, data = load_token_data(session, caller.tenant_id, str(token_id), now=now)
    except Problem:
        errors["token_id"] = ["no token of the tenant has this id"]
        return _Source(card={})
    if token.type != "card" or not isinstance(data, dict) or not data.get("number"):
        errors["token_id"] = ["must name a token holding card data with a number"]
        return _Source(card={})
    return _Source(card=dict(data), token_id=token.id)


def _from_intent(session: Session, caller: Caller, intent_id: object, now: dt.datetime, errors: dict) -> _Source:
    """A live token intent of the tenant holding a number (else an error under ``token_intent_id``)."""
    try:
        intent, data = load_intent_data(session, caller.tenant_id, intent_id, now=now)
    except Problem:
        errors["token_intent_id"] = ["no token intent of the tenant has this id"]
        return _Source(card={})
    if not data.get("number"):
        errors["token_intent_id"] = ["must name a token intent holding card data with a number"]
        return _Source(card={})
    # an intent that became a token already: the network token names both
    return _Source(card=dict(data), intent_id=intent.id, token_id=intent.token_id)


def _resolve_source(session: Session, caller: Caller, request: dict, now: dt.datetime) -> _Source:
    """The card of a create request (spec section 4 rules), or a 400 problem keyed by property.

    The one place the create body's rules are checked; the route's model only checks each property's
    form (types, lengths, ranges)."""
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
    if given[0] == "data":
        source = _from_data(request["data"], month is not None or year is not None, now, errors)
    elif given[0] == "token_id":
        source = _from_token(session, caller, request["token_id"], now, errors)
    else:
        source = _from_intent(session, caller, request["token_intent_id"], now, errors)
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
    ensure_configured(caller)  # a production tenant without a configured network: 422 before anything
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
        gated=True,  # the message goes before the commit: the request waits for the outcome
    ).id
    values = {
        "id": token_id,
        "tenant_id": caller.tenant_id,
        "status": NetworkTokenStatus.INACTIVE,
        "data_ct": None,
        "details": None,
        "card": card_view(card),
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
    }
    rows.add(_TOKENS, values)
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=token_id, operation="create")
    insert_rows_last(session, rows)  # the unit's only write: one durable statement when nothing was read
    return Started(token_id, job_id, created=created_row(values))


def provisioning_outcome(
    session: Session, caller: Caller, started: Started, *, outcome: Outcome | None = None
) -> tuple[int, dict]:
    """After the bounded wait: ``(201, active object)``, ``(202, inactive object)`` or a raised problem.

    ``outcome``: the job's outcome the wait ended with (its status and the safe part of its result),
    used as it is when settled: a failure is answered from its code (the worker removed the network
    token in the transaction that settled the job), a success is answered from what the outcome
    statement wrote when its message carried it (:func:`_answered`: no statement), else reads the
    network token once, without locks. Otherwise the job row is locked while deciding, so a worker
    finishing at this moment either is seen (201 / 422) or sees the 202 (``announced``) and emits
    ``network-token.failed`` if it fails.
    """
    answered = settled_answer(session, caller, started, outcome)
    if answered is not None:
        return answered
    status = outcome.status if outcome is not None else None
    if status == JobStatus.SUCCEEDED:  # one read outside any transaction, a plain row
        row = read_first(_READ_TOKEN, {"network_token_id": started.network_token_id, "tenant_id": caller.tenant_id})
        if row is not None and row.status != NetworkTokenStatus.INACTIVE:
            return 201, caller_view(session, caller, row)
    job = locked_job(session, started.job_id)
    if job.status in JOB_FAILED:
        raise provisioning_problem(job.status, job.result)
    token = get_token(session, caller.tenant_id, started.network_token_id, lock=True)
    if job.status == JobStatus.SUCCEEDED and token.status != NetworkTokenStatus.INACTIVE:
        return 201, caller_view(session, caller, token)
    token.announced = True
    session.add(token)
    return 202, caller_view(session, caller, token)


def settled_answer(
    session: Session | None, caller: Caller, started: Started, outcome: Outcome | None
) -> tuple[int, dict] | None:
    """The answer the job's outcome message gives by itself, no statement run: a failure raises its
    problem (:func:`provisioning_problem`), a success answers ``(201, active object)`` when the
    message carried what the outcome statement wrote (:func:`_answered`); None otherwise (no outcome
    yet, no answer in it, or one that does not open): :func:`provisioning_outcome` then reads.
    ``session`` None: the tenant's key from the keyring's cache only (an uncached key gives None),
    so the event loop may call it."""
    if outcome is None:
        return None
    if outcome.status in JOB_FAILED:
        raise provisioning_problem(outcome.status, outcome.result)
    if outcome.status == JobStatus.SUCCEEDED:
        answered = _answered(session, caller, started, outcome)
        if answered is not None:
            return 201, answered
    return None


def _answered(session: Session | None, caller: Caller, started: Started, outcome: Outcome) -> dict | None:
    """The active network token as ``caller`` sees it, from what the create recorded and what the
    provisioning's outcome statement wrote (its message's ``answer``, :func:`provisioned_write`):
    no statement runs when the tenant's key is cached (``session`` None: only then). None when the
    message carried no answer, or one that does not open, or the key is not cached and ``session``
    is None (the caller then reads the row)."""
    if outcome.answer is None or started.created is None:
        return None
    try:
        row = started.created.provisioned(outcome.answer)
        return caller_view(session, caller, row)
    except KeyNotCached:  # asked on the loop: the caller reads the key with the row
        return None
    except (LookupError, ValueError, TypeError, DecryptionError):  # a malformed value, a key version unknown
        if session is not None:  # on the loop, the finish that follows says it
            log.warning("the outcome of job %s carried an answer that does not open; reading the row", started.job_id)
        return None


# ---- the provisioning job (worker side) ----------------------------------------------------------


def provisioning_reads() -> LeaseReads:
    """What a provisioning job needs, read by its lease statement (:func:`infra.jobs.lease`), each
    table joined once by its primary key: the tenant's type and the network token's (the job's
    subject) tenant, status, sealed input and merchant (NULLs when the network token is gone)."""
    token, tenant = table_of(NetworkToken).alias("network_token"), table_of(Tenant)
    return LeaseReads(
        {
            "tenant_type": tenant.c.type,
            "token_tenant_id": token.c.tenant_id,
            "status": token.c.status,
            "source_ct": token.c.source_ct,
            "merchant_id": token.c.merchant_id,
        },
        ((tenant, tenant.c.id == Job.tenant_id), (token, token.c.id == TextAsUuid(Job.subject_id))),
    )


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
    with lazy_session() as session:  # the tenant's key is cached: no statement runs
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
    return network_for(read["tenant_type"]), card


@functools.cache
def _provisioned_update() -> Update:
    """The ``UPDATE`` writing the network's answer into the network token, built once with bind
    parameters (their values: :func:`_provisioned_params`): ``active`` (or the network's
    ``suspended``), DPAN sealed, details, PAR, provisioning input dropped; only an inactive network
    token of the job's tenant is changed."""
    columns = _TOKENS.c
    return (
        update(_TOKENS)
        .where(
            columns.id == bindparam("nt_id", type_=columns.id.type),
            columns.tenant_id == bindparam("nt_tenant_id", type_=columns.tenant_id.type),
            columns.status == NetworkTokenStatus.INACTIVE,
        )
        .values(
            data_ct=bindparam("nt_data_ct", type_=columns.data_ct.type),
            details=bindparam("nt_details", type_=columns.details.type),
            par=bindparam("nt_par", type_=columns.par.type),
            network_reference=bindparam("nt_reference", type_=columns.network_reference.type),
            status=bindparam("nt_status", type_=columns.status.type),
            source_ct=None,
            pending_job_id=None,
            modified_at=bindparam("nt_modified_at", type_=columns.modified_at.type),
        )
    )


@functools.cache
def _provisioned_update_returning() -> Update:
    """:func:`_provisioned_update` returning the changed network token's id."""
    return _provisioned_update().returning(_TOKENS.c.id)


def _provisioned_params(
    session: Session, tenant_id: uuid.UUID, token_id: uuid.UUID, outcome: ProvisionedToken
) -> dict[str, Any]:
    """The values of :func:`_provisioned_update`'s parameters for the network's answer ``outcome``
    (the DPAN sealed with the tenant's key)."""
    data = {
        "number": outcome.number,
        "expiration_month": outcome.expiration_month,
        "expiration_year": outcome.expiration_year,
    }
    return {
        "nt_id": token_id,
        "nt_tenant_id": tenant_id,
        "nt_data_ct": get_keyring().encrypt(session, tenant_id, DATA_PURPOSE, str(token_id), json.dumps(data).encode()),
        "nt_details": outcome.details,
        "nt_par": outcome.par,
        "nt_reference": outcome.reference,
        "nt_status": _provisioned_status(outcome),
        "nt_modified_at": utcnow(),
    }


def _provisioned_status(outcome: ProvisionedToken) -> NetworkTokenStatus:
    """The network token's status after provisioning: the network's ``suspended``, else ``active``."""
    if outcome.status in (NetworkTokenStatus.ACTIVE, NetworkTokenStatus.SUSPENDED):
        return NetworkTokenStatus(outcome.status)
    return NetworkTokenStatus.ACTIVE


def provisioned_write(job: Job, outcome: ProvisionedToken | None) -> jobs.OutcomeWrite | None:
    """:func:`apply_provisioned` as one write with the job's completion (:func:`infra.jobs.settle_with`),
    when the network token's change is all it writes: no enabled webhook of the tenant subscribes to
    ``network-token.created`` (events are read only to be delivered: none is written then, as for
    tokens, :func:`domain.webhooks.events.emit`). None otherwise, and when there is nothing to write."""
    if outcome is None:
        return None
    tenant_id, token_id = job_subject(job)
    with lazy_session() as session:  # the tenant's key and subscriptions are cached: no statement runs
        if CREATED_EVENT in events.subscriptions.types(session, tenant_id):
            return None
        params = _provisioned_params(session, tenant_id, token_id, outcome)
    answer = provisioned_values(
        status=params["nt_status"],
        details=params["nt_details"],
        par=params["nt_par"],
        reference=params["nt_reference"],
        modified_at=params["nt_modified_at"],
        data_ct=params["nt_data_ct"],
    )
    return jobs.OutcomeWrite(_provisioned_update(), params, {"network_token_id": job.subject_id}, answer)


def apply_provisioned(session: Session, job: Job, outcome: ProvisionedToken | None) -> dict:
    """Write the network's answer: the token becomes ``active`` (DPAN sealed, details, PAR), its
    provisioning input is dropped, ``network-token.created`` is emitted. A network token removed
    meanwhile is deleted at the network instead. Returns the job result (ids only)."""
    result = {"network_token_id": job.subject_id}
    if outcome is None:
        return {**result, "skipped": True}
    tenant_id, token_id = job_subject(job)
    # One statement: the job row is locked already (``JobTask``), so the lock order is the job row,
    # then the network token; only an inactive network token of the job's tenant is changed.
    changed = session.execute(
        _provisioned_update_returning(), _provisioned_params(session, tenant_id, token_id, outcome)
    ).first()
    if changed is None:
        found = session.execute(select(_TOKENS.c.tenant_id).where(_TOKENS.c.id == token_id).with_for_update()).first()
        if found is None or found.tenant_id != tenant_id:  # removed meanwhile
            record_network_delete(session, tenant_id, outcome.reference, job.trace_id)
            return {**result, "removed": True}
        return {**result, "skipped": True}
    emit(session, token_id, tenant_id, "created", _provisioned_status(outcome), job.trace_id)
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
        emit(session, token.id, token.tenant_id, "failed", "failed", job.trace_id)
