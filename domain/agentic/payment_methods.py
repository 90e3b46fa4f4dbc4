"""Agentic payment methods, the pieces the API verbs (:mod:`domain.agentic.service`) and the workers
(:mod:`domain.agentic.enrollment`) share: the rails a card provisions, finding and locking rows, the
card checks, a rail's visible state and its event, provider error objects, the enrollment lease's
release (spec 001 sections 2-4).

Rails follow from the card: visa -> ``agentic-token``/``vic``, mastercard ->
``agentic-token``/``agentpay``, and any network the processor supports (visa, mastercard, amex) ->
``spt``/``psp``.

Payment method updated_at moves only with what a client can see: a rail's status, error code or
provider ids, the card's data, the status (deleted). Leases, jobs and idempotency records do not.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import secrets
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, not_
from sqlmodel import Session, col, select

from domain.agentic import leases
from domain.agentic.errors import CATALOGUE, agentic_error
from domain.agentic.views import rail_event_data, rail_view
from domain.tenancy.usage import record_token_activity
from domain.tokens.store import live_token_data
from domain.webhooks import events
from infra import jobs
from providers.agentic import DISPLAY_FIELDS
from storage.crypto import get_keyring
from storage.db import Rows, in_constants, lazy_session, read_first, stage_write
from storage.models import Job, Tenant
from storage.models_agentic import PaymentMethod, PaymentMethodRail, ProviderError
from storage.states import PaymentMethodStatus, RailStatus
from storage.types import table_of, utcnow

SOURCE_TYPE = "svc_card_token"
RAIL_EVENT = "agentic.payment-method.rail.retried"
ENTITY_TYPE = "payment_method"

ENROLL_TASK = "agentic.enroll_rail"
POLL_TASK = "agentic.poll_rail"
DELETE_TASK = "agentic.delete_payment_method"
ENROLL_MAX_ATTEMPTS = 4
DELETE_MAX_ATTEMPTS = 4
#: A provider-pending enrollment is polled this many times (backing off to 30 s): about 20 minutes.
POLL_MAX_ATTEMPTS = 45

#: The associated-data purpose of a payment method's card sealed into an enabled rail's outcome message.
ANSWER_PURPOSE = "agentic-payment-method-answer"

#: The only valid (rail, provider) pairs (spec 001 section 4, Rails and providers).
VALID_PAIRS: tuple[tuple[str, str], ...] = (("agentic-token", "vic"), ("agentic-token", "agentpay"), ("spt", "psp"))
RAILS = ("agentic-token", "spt")
#: card brand -> the agentic-token provider of its network
TOKEN_PROVIDER_OF_BRAND = {"visa": "vic", "mastercard": "agentpay"}
#: the networks the processor behind psp supports
PSP_BRANDS = frozenset({"visa", "mastercard", "amex"})


def new_id(prefix: str) -> str:
    """A new resource id: ``prefix`` + 32 hex characters (``pm_``, ``prv_``, ``agt_``)."""
    return f"{prefix}{secrets.token_hex(16)}"


#: The most rails one card has (:func:`rails_for_brand`): one of each kind.
MOST_RAILS = len(RAILS)


def rails_for_brand(brand: str | None) -> list[tuple[str, str]]:
    """The (rail, provider) pairs a card of ``brand`` provisions, agentic-token first."""
    pairs = []
    if brand in TOKEN_PROVIDER_OF_BRAND:
        pairs.append(("agentic-token", TOKEN_PROVIDER_OF_BRAND[brand]))
    if brand in PSP_BRANDS:
        pairs.append(("spt", "psp"))
    return pairs


def tenant_type(session: Session, tenant_id: uuid.UUID) -> str:
    """The type of tenant ``tenant_id`` (which provider URLs its calls use). Raises 500
    ``INTERNAL_ERROR`` when the tenant is gone (its rows go with it: a job that found them cannot
    meet this)."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise agentic_error("INTERNAL_ERROR", "The tenant is gone.")
    return tenant.type


def lock_existing(session: Session, pm_id: str) -> PaymentMethod:
    """:func:`lock` for a payment method the request itself wrote or found: 500 ``INTERNAL_ERROR``
    when it is gone (which cannot happen short of a manual delete)."""
    pm = lock(session, pm_id)
    if pm is None:
        raise agentic_error("INTERNAL_ERROR")
    return pm


def rails_of(session: Session, pm_id: str) -> list[PaymentMethodRail]:
    """The rails of a payment method, in their order."""
    return list(
        session.exec(
            select(PaymentMethodRail)
            .where(PaymentMethodRail.payment_method_id == pm_id)
            .order_by(col(PaymentMethodRail.position))
            .execution_options(populate_existing=True)
        ).all()
    )


def find(session: Session, tenant_id: uuid.UUID, pm_id: str, *, lock: bool = False) -> PaymentMethod:
    """The tenant's payment method (locked for update when ``lock``), else 404
    ``PAYMENT_METHOD_NOT_FOUND`` (another tenant's answers the same)."""
    query = select(PaymentMethod).where(PaymentMethod.id == pm_id, PaymentMethod.tenant_id == tenant_id)
    if lock:
        query = query.with_for_update()
    pm = session.exec(query.execution_options(populate_existing=True)).first()
    if pm is None:
        raise agentic_error("PAYMENT_METHOD_NOT_FOUND")
    return pm


def lock(session: Session, pm_id: str) -> PaymentMethod | None:
    """The payment method locked for update (every writer takes this lock first), or None."""
    return session.exec(
        select(PaymentMethod)
        .where(PaymentMethod.id == pm_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()


def merge_card(current: dict | None, provider_card: dict | None) -> tuple[dict | None, bool]:
    """``current`` completed with a provider's card data: fields still missing are filled and null
    display values backfilled; known values are kept. Returns ``(card, changed)``."""
    if not provider_card:
        return current, False
    merged = dict(current or {"type": "card"})
    for name, value in provider_card.items():
        if name == "display" or value is None:
            continue
        if merged.get(name) is None:
            merged[name] = value
    display = dict(merged.get("display") or dict.fromkeys(DISPLAY_FIELDS))
    for name, value in (provider_card.get("display") or {}).items():
        if value is not None and display.get(name) is None:
            display[name] = value
    merged["display"] = display
    return merged, merged != (current or {})


def record_provider_error(
    session: Session,
    rail: Any,
    *,
    code: str,
    provider_code: str | None = None,
    correlation_id: str | None = None,
    operation: str = "enrollment",
    detail: str | None = None,
    allowance_id: str | None = None,
    payment_credential_id: str | None = None,
) -> ProviderError:
    """Add a provider error object for ``rail`` (a payment method's or an allowance's: it has
    ``tenant_id``, ``rail``, ``provider`` and ``payment_method_id`` or ``allowance_id``), with
    catalogue title and remediation; never the provider's message or body."""
    _status, title, remediation = CATALOGUE.get(code, CATALOGUE["PROVIDER_ENROLLMENT_FAILED"])
    error = ProviderError(
        id=new_id("prv_"),
        tenant_id=rail.tenant_id,
        code=code,
        title=title,
        detail=(detail or remediation)[:500],
        provider=rail.provider,
        operation=operation,
        rail=rail.rail,
        provider_code=provider_code,
        provider_correlation_id=correlation_id,
        payment_method_id=getattr(rail, "payment_method_id", None),
        allowance_id=allowance_id or getattr(rail, "allowance_id", None),
        payment_credential_id=payment_credential_id,
        occurred_at=utcnow(),
    )
    session.add(error)
    return error


def settle_rail(
    session: Session,
    pm: PaymentMethod,
    rail: PaymentMethodRail,
    *,
    status: RailStatus,
    error_code: str | None = None,
    provider_ids: dict | None = None,
    trace_id: str | None = None,
) -> bool:
    """Set a rail's visible state; True when it changed (then the payment method's updated_at
    moves). A rail that was shown ``pending`` emits its event when it leaves pending."""
    before = rail_view(rail)
    rail.status = status
    rail.error_code = error_code if status == RailStatus.ERROR else None
    if provider_ids is not None:
        rail.provider_ids = dict(provider_ids)
    changed = rail_view(rail) != before
    now = utcnow()
    if changed:
        rail.updated_at = now
        pm.updated_at = now
    if status != RailStatus.PENDING and rail.notify:
        rail.notify = False
        events.emit(session, tenant_id=pm.tenant_id, type=RAIL_EVENT, data=rail_event_data(pm, rail), trace_id=trace_id)
    session.add(rail)
    session.add(pm)
    return changed


def enrolling_rails(pm_id: Any, operation_id: Any, *, other_than_job: uuid.UUID | None = None) -> Select:
    """``SELECT`` of the ids of the rails of payment method ``pm_id`` in operation ``operation_id``
    whose enrollment job is not settled yet (but ``other_than_job``); both may be SQL expressions.
    The one test of "an enrollment of the operation is still running" that releasing its lease asks."""
    unsettled = select(Job.id).where(
        Job.id == PaymentMethodRail.job_id,
        Job.kind == ENROLL_TASK,
        # constants, not an expanding IN: the statement's text is the same on every run
        not_(in_constants(table_of(Job).c.status, jobs.TERMINAL)),
    )
    if other_than_job is not None:
        unsettled = unsettled.where(Job.id != other_than_job)
    return select(PaymentMethodRail.id).where(
        PaymentMethodRail.payment_method_id == pm_id,
        PaymentMethodRail.operation_id == operation_id,
        unsettled.exists(),
    )


def release_if_done(session: Session, pm_id: str, operation_id: str | None, *, finished_job: uuid.UUID) -> None:
    """Release operation ``operation_id``'s lease when none of its enrollment jobs but
    ``finished_job`` is still running (called with the payment method locked, so the statement sees
    every outcome committed before the lock): one ``DELETE ... WHERE NOT EXISTS`` of such a job, sent
    with the transaction's other queued writes just before its commit (``storage.db.stage_write``)."""
    if operation_id is None:
        return
    busy = enrolling_rails(pm_id, operation_id, other_than_job=finished_job).exists()
    stage_write(session, leases.release_statement(pm_id, operation_id, unless=busy))


def job_statuses(session: Session, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    """The status of each job."""
    if not job_ids:
        return {}
    rows = session.exec(select(Job.id, Job.status).where(col(Job.id).in_(job_ids))).all()
    return dict(rows)


def mark_deleted(session: Session, pm: PaymentMethod) -> None:
    """The cascade is complete: the payment method is deleted (updated_at moves once, now)."""
    now = utcnow()
    pm.status = PaymentMethodStatus.DELETED
    pm.deleted_at = now
    pm.updated_at = now
    session.add(pm)


# ---- the card behind a payment method ------------------------------------------------------------


def card_source(
    session: Session,
    tenant_id: uuid.UUID,
    token_id: str,
    *,
    today: dt.date | None = None,
    rows: Rows | None = None,
    read: Callable[[Any, dict], Any] = read_first,
) -> dict:
    """The data of the card token ``token_id`` of the tenant, else 400 ``INVALID_TOKEN``. The token's
    activity of the month is written now, or queued in ``rows`` (the caller's one recording statement).
    The token is read outside the session's transaction, or by ``read``
    (``domain.tokens.store.live_token_data``).

    "A card token readable in the tenant": a live (unexpired) token of the tenant whose type is
    ``card`` and whose data holds a number and an expiration not in the past. The caller needs no
    token read permission: the create permission lets the platform read the card internally, for
    the providers only (public applications, which hold create permissions alone, may create).
    """
    now = utcnow()
    found = live_token_data(session, tenant_id, token_id, now, read=read)
    if found is None:
        return checked_card(None, None, today=today)
    record_token_activity(session, tenant_id, [token_id], now=now, rows=rows)
    kind, data = found
    return checked_card(kind, data, today=today)


def checked_card(kind: str | None, data: Any, *, today: dt.date | None = None) -> dict:
    """``data`` when it is a card token's readable card data (the rules of :func:`card_source`;
    ``kind`` is the token's type, None when no live token of the tenant has the id), else 400
    ``INVALID_TOKEN``."""
    if kind is None:
        raise agentic_error("INVALID_TOKEN", "No card token with this id exists in the tenant.")
    if kind != "card" or not isinstance(data, dict) or not isinstance(data.get("number"), str):
        raise agentic_error("INVALID_TOKEN", "The token is not a card token.")
    month, year = data.get("expiration_month"), data.get("expiration_year")
    if not isinstance(month, int) or not isinstance(year, int):
        raise agentic_error("INVALID_TOKEN", "The card token has no expiration date; providers need one.")
    today = today or utcnow().date()
    if (year, month) < (today.year, today.month):
        raise agentic_error("INVALID_TOKEN", "The card has expired.")
    return data


# ---- an enabled rail's outcome message -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RailAnswer:
    """What an enabled rail's outcome statement wrote, as its message carried it (:func:`seal_answer`):
    the payment method's ``card`` and ``updated_at`` after that statement, the rail's
    ``provider_ids``, and ``released``: True when the statement released the operation's lease (it
    was the operation's last, so the payment method's values are final)."""

    payment_method_id: str
    card: dict | None
    updated_at: dt.datetime
    provider_ids: dict | None
    released: bool


def seal_answer(
    tenant_id: uuid.UUID,
    pm_id: str,
    *,
    card: dict | None,
    updated_at: dt.datetime,
    provider_ids: dict | None,
    released: bool,
) -> dict[str, Any]:
    """The ``answer`` of an enabled rail's outcome message (``infra.wait``): JSON values, the card
    sealed with the tenant's key bound to the payment method (:data:`ANSWER_PURPOSE`, base64; the
    card holds its last four digits and expiry, so it never travels readable). The tenant's key is
    cached: no statement runs once it was read. Opened by :func:`open_answer`."""
    with lazy_session() as session:
        card_ct = get_keyring().encrypt(session, tenant_id, ANSWER_PURPOSE, pm_id, json.dumps(card).encode())
    return {
        "payment_method_id": pm_id,
        "card_ct": base64.b64encode(card_ct).decode("ascii"),
        "updated_at": updated_at.isoformat(),
        "provider_ids": provider_ids,
        "released": released,
    }


def open_answer(session: Session | None, tenant_id: uuid.UUID, answer: Mapping[str, Any]) -> RailAnswer:
    """The :class:`RailAnswer` of a :func:`seal_answer` value of ``tenant_id``'s. Raises LookupError,
    ValueError or TypeError on a malformed value, ``storage.crypto.DecryptionError`` when the card
    does not open (another tenant's, another payment method's, a key version unknown);
    ``storage.crypto.KeyNotCached`` when ``session`` is None and the tenant's key is not cached."""
    pm_id = answer["payment_method_id"]
    provider_ids = answer["provider_ids"]
    if not isinstance(pm_id, str) or not (provider_ids is None or isinstance(provider_ids, dict)):
        raise TypeError("a malformed rail answer")
    sealed = base64.b64decode(answer["card_ct"], validate=True)
    card = json.loads(get_keyring().decrypt(session, tenant_id, ANSWER_PURPOSE, pm_id, sealed))
    updated_at = dt.datetime.fromisoformat(answer["updated_at"])
    if updated_at.tzinfo is None:
        raise ValueError("a rail answer's updated_at without its offset")
    return RailAnswer(pm_id, card, updated_at, provider_ids, answer["released"] is True)
