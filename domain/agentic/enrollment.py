"""The worker side of agentic payment methods: rail enrollment, polling, the delete cascade.

Each function is one step of a job task (``tasks/agentic.py``, template ``infra/task.py``):

* **enrollment** (``agentic.enroll_rail``, one job per rail; a create's rail jobs share one message
  and enroll side by side, each on a thread of its own, ``infra.task.JobTask.run``):
  :func:`perform_enrollment` reads the card from the card token and calls the provider with the job
  id as idempotency key, outside any transaction; :func:`apply_enrollment` writes the outcome (an
  enabled rail's usually as one durable statement with the job's completion,
  :func:`enrolled_write`; the enabled rails of one create together as one statement,
  :func:`enrolled_together`); :func:`enrollment_failed` records a rejection (the rail in ``error`` with
  a catalogue code, and a provider error object). The last enrollment job of an operation releases
  its lease.
* **polling** (``agentic.poll_rail``): a provider that answered ``pending`` is asked again, backing
  off from 0.5 s to 30 s, until the enrollment is enabled (about 20 minutes at most; then the rail
  records ``PROVIDER_ENROLLMENT_FAILED``). The platform polls rather than taking the provider's
  callback: no inbound endpoint to secure, and a lost callback cannot leave a rail pending.
* **delete cascade** (``agentic.delete_payment_method``): cancels every allowance the payment method
  backs at its providers (:func:`domain.agentic.allowance_work.cancel_rails`), then removes each
  rail's provider enrollment, recording each cancellation and removal as it happens, so a cascade
  stopped half-way resumes where it stopped; the allowances become ``cancelled`` with the deletion.

Every writing step locks the payment method row first, so the steps of one payment method (and the
API's) are serialised. A job whose rail has moved on to another job (a retry overtook a poll) or
whose payment method is being deleted drops its outcome. A rail that was shown ``pending`` emits
``agentic.payment-method.rail.retried`` when it settles.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    CTE,
    JSON,
    Boolean,
    ColumnElement,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    column,
    exists,
    false,
    func,
    literal_column,
    or_,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Session, select

from config.settings import Settings
from domain.agentic import allowance_work, leases
from domain.agentic.errors import CATALOGUE, failed_rail, name_failed_rail
from domain.agentic.payment_methods import (
    POLL_MAX_ATTEMPTS,
    POLL_TASK,
    card_source,
    checked_card,
    enrolling_rails,
    lock,
    mark_deleted,
    merge_card,
    rails_of,
    record_provider_error,
    release_if_done,
    seal_answer,
    settle_rail,
    tenant_type,
)
from domain.tenancy.usage import activity_recorded, record_token_activity_unflushed
from domain.tokens.store import live_token_join, open_token_data
from infra import jobs
from infra.errors import Problem
from infra.jobs import PermanentError, TransientError
from providers import ProviderNotConfigured
from providers.agentic import DISPLAY_FIELDS, UNCLASSIFIED, Enrollment, EnrollmentCard, EnrollmentFailed
from providers.agentic_http import require_provider
from storage.db import lazy_session, server_prepared, session_scope, stage_changes
from storage.models import Job, Tenant
from storage.models_agentic import OperationLease, PaymentMethod, PaymentMethodRail
from storage.states import PaymentMethodStatus, RailStatus
from storage.types import TextAsUuid, table_of, utcnow


@dataclass(frozen=True)
class Stale:
    """The job's work was overtaken (another job took the rail, the payment method is being
    deleted): its outcome is dropped."""

    reason: str


@dataclass(frozen=True)
class _Target:
    pm_id: str
    rail_id: uuid.UUID
    provider: str
    tenant_type: str
    attempt: str
    consumer: dict
    token_id: str
    tenant_id: uuid.UUID
    enrollment_id: str | None


def _target(session: Session, job: Job) -> _Target | Stale:
    rail = session.get(PaymentMethodRail, uuid.UUID(job.subject_id), populate_existing=True)
    if rail is None:
        return Stale("the rail is gone")
    if rail.job_id != job.id:
        return Stale("another job took the rail")
    pm = session.get(PaymentMethod, rail.payment_method_id, populate_existing=True)
    if pm is None or pm.status != PaymentMethodStatus.ACTIVE or pm.delete_requested_at is not None:
        return Stale("the payment method is deleted")
    return _Target(
        pm.id,
        rail.id,
        rail.provider,
        tenant_type(session, pm.tenant_id),
        rail.attempt,
        dict(pm.consumer),
        pm.token_id,
        pm.tenant_id,
        rail.enrollment_id,
    )


def enrollment_reads() -> jobs.LeaseReads:
    """What an enrollment job needs, read by its lease statement (:func:`infra.jobs.lease`), each
    table joined once by its primary key: the rail (the job's subject), its payment method, the
    tenant's type, the payment method's card token (live at the lease's time, else NULLs, see
    :func:`domain.tokens.store.live_token_join`) and whether that token already counts as active this
    month (``token_active``); no transaction of its own. A rail that is gone reads as NULLs
    (``rail_id`` None: :class:`Stale`)."""
    rail, pm, tenant = table_of(PaymentMethodRail).alias("rail"), table_of(PaymentMethod).alias("pm"), table_of(Tenant)
    token = live_token_join(pm.c.tenant_id, pm.c.token_id, jobs.LEASE_NOW)
    return jobs.LeaseReads(
        {
            "rail_id": rail.c.id,
            "rail_job_id": rail.c.job_id,
            "provider": rail.c.provider,
            "attempt": rail.c.attempt,
            "enrollment_id": rail.c.enrollment_id,
            "pm_id": pm.c.id,
            "pm_status": pm.c.status,
            "pm_delete_requested_at": pm.c.delete_requested_at,
            "consumer": pm.c.consumer,
            "token_id": pm.c.token_id,
            "tenant_id": pm.c.tenant_id,
            "tenant_type": tenant.c.type,
            **token.columns,
            "token_active": activity_recorded(pm.c.tenant_id, pm.c.token_id, jobs.LEASE_MONTH),
        },
        (
            (rail, rail.c.id == TextAsUuid(Job.subject_id)),
            (pm, pm.c.id == rail.c.payment_method_id),
            (tenant, tenant.c.id == pm.c.tenant_id),
            (token.table, token.on),
        ),
    )


def _target_read(job: Job, read: dict) -> _Target | Stale:
    """:func:`_target` from :func:`enrollment_reads`' values."""
    if read["rail_id"] is None:
        return Stale("the rail is gone")
    if read["rail_job_id"] != job.id:
        return Stale("another job took the rail")
    if (
        read["pm_id"] is None
        or read["pm_status"] != PaymentMethodStatus.ACTIVE
        or read["pm_delete_requested_at"] is not None
    ):
        return Stale("the payment method is deleted")
    return _Target(
        read["pm_id"],
        read["rail_id"],
        read["provider"],
        read["tenant_type"],
        read["attempt"],
        dict(read["consumer"]),
        read["token_id"],
        read["tenant_id"],
        read["enrollment_id"],
    )


def poll_delay(attempt: int) -> float:
    """Seconds before poll number ``attempt + 1``: 0.5, 1, 2, 4 ... capped at 30."""
    return min(30.0, 0.5 * 2 ** max(0, attempt - 1))


def _provider(target: _Target, settings: Settings):
    try:
        return require_provider(target.provider, target.tenant_type, settings)
    except ProviderNotConfigured as exc:
        raise EnrollmentFailed(exc.code, str(exc)) from None


def perform_enrollment(job: Job, settings: Settings) -> Enrollment | Stale:
    """Enroll the job's rail with its provider (idempotency key: the job id).

    Raises :class:`EnrollmentFailed` (a rejection, a read timeout, a card token no longer readable:
    ``INVALID_TOKEN``) or :class:`TransientError` (retried with backoff).
    """
    with session_scope() as session:
        target = _target(session, job)
        if isinstance(target, Stale):
            return target
        try:
            data = card_source(session, target.tenant_id, target.token_id)
        except Problem as problem:
            raise EnrollmentFailed("INVALID_TOKEN", problem.detail or "the card token is not readable") from None
    return _enroll(job, target, data, settings)


def _enroll(job: Job, target: _Target, data: dict, settings: Settings) -> Enrollment:
    card = EnrollmentCard(data["number"], data["expiration_month"], data["expiration_year"], data.get("cvc"))
    provider = _provider(target, settings)
    return provider.enroll(card, target.consumer, attempt=target.attempt, idempotency_key=str(job.id))


def perform_enrollment_read(job: Job, read: dict, settings: Settings) -> Enrollment | Stale:
    """:func:`perform_enrollment` with what the lease statement read (:func:`enrollment_reads`): no
    read transaction; the card token's activity is counted, unless the lease read it as counted this
    month already (the create that recorded the job counted it), in one statement not waiting for the
    WAL flush (the job's outcome or failure commit makes it durable). Raises as
    :func:`perform_enrollment`."""
    target = _target_read(job, read)
    if isinstance(target, Stale):
        return target
    try:
        data = None
        if read["token_type"] is not None:
            with lazy_session() as session:  # the tenant's key is cached: no statement runs
                data = open_token_data(
                    session,
                    target.tenant_id,
                    target.token_id,
                    read["token_type"],
                    read["token_data_ct"],
                    read["token_cvc_expires_at"],
                )
        data = checked_card(read["token_type"], data)
    except Problem as problem:
        raise EnrollmentFailed("INVALID_TOKEN", problem.detail or "the card token is not readable") from None
    if not read["token_active"]:
        record_token_activity_unflushed(target.tenant_id, [target.token_id])
    return _enroll(job, target, data, settings)


def perform_poll(job: Job, settings: Settings) -> Enrollment | Stale:
    """Ask the provider for the state of a pending enrollment; TransientError while still pending."""
    with session_scope() as session:
        target = _target(session, job)
    if isinstance(target, Stale):
        return target
    if not target.enrollment_id:
        raise EnrollmentFailed(UNCLASSIFIED, "no enrollment to poll")
    enrollment = _provider(target, settings).get_enrollment(target.enrollment_id)
    if enrollment.status == "pending":
        raise TransientError("the enrollment is still pending", retry_after=poll_delay(job.attempts))
    return enrollment


def _locked_rail(session: Session, job: Job) -> tuple[PaymentMethod | None, PaymentMethodRail | None]:
    """The payment method of the job's rail, locked (the lock every writer takes first), and the rail
    read after the lock: two statements."""
    rail_id = uuid.UUID(job.subject_id)
    pm = session.exec(
        select(PaymentMethod)
        .where(
            PaymentMethod.id
            == select(PaymentMethodRail.payment_method_id).where(PaymentMethodRail.id == rail_id).scalar_subquery()
        )
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if pm is None:
        return None, session.get(PaymentMethodRail, rail_id)
    return pm, session.get(PaymentMethodRail, rail_id, populate_existing=True)


def _current(pm: PaymentMethod, rail: PaymentMethodRail, job: Job) -> bool:
    """True when the job still owns the rail of an active payment method (no delete requested)."""
    return rail.job_id == job.id and pm.status == PaymentMethodStatus.ACTIVE and pm.delete_requested_at is None


def apply_enrollment(session: Session, job: Job, outcome: Enrollment | Stale) -> dict:
    """Write an enrollment's outcome (one transaction with the job's completion); the job result.

    ``enabled``: the rail is enabled (its event emitted if it had been shown pending). ``pending``:
    the rail stays pending and a poll job is recorded. The card's display data is merged in
    (backfilling what an earlier attempt lacked). After the locks (the job row, then the payment
    method with the rail), the rail's and the payment method's changes, the lease's release and the
    job's completion go out as one statement just before the commit (``storage.db.stage_write``).
    """
    pm, rail = _locked_rail(session, job)
    if isinstance(outcome, Stale) or pm is None or rail is None or not _current(pm, rail, job):
        if pm is not None and rail is not None and rail.job_id == job.id:
            release_if_done(session, pm.id, rail.operation_id, finished_job=job.id)
        return {"stale": outcome.reason if isinstance(outcome, Stale) else "overtaken"}
    rail.enrollment_id = outcome.id
    rail.enrollment_removed_at = None
    card, changed = merge_card(pm.card, outcome.card)
    if changed:
        pm.card = card
        pm.updated_at = utcnow()
    if outcome.status == "pending":
        poll = jobs.record(
            session,
            kind=POLL_TASK,
            tenant_id=pm.tenant_id,
            subject_type="rail",
            subject_id=str(rail.id),
            trace_id=job.trace_id,
            max_attempts=POLL_MAX_ATTEMPTS,
        )
        rail.job_id = poll.id
        settle_rail(session, pm, rail, status=RailStatus.PENDING, provider_ids=outcome.provider_ids)
        rail.notify = True  # pending at the provider: its settling is delivered as the event
        session.add(rail)
    else:
        settle_rail(
            session, pm, rail, status=RailStatus.ENABLED, provider_ids=outcome.provider_ids, trace_id=job.trace_id
        )
    release_if_done(session, pm.id, rail.operation_id, finished_job=job.id)
    stage_changes(session, rail)
    stage_changes(session, pm)
    return {"rail_status": outcome.status, "enrollment_id": outcome.id}


def enrolled_write(job: Job, outcome: Enrollment | Stale) -> jobs.OutcomeWrite | None:
    """:func:`apply_enrollment` of an ``enabled`` enrollment as one write with the job's completion
    (:func:`infra.jobs.settle_with`; its statement is :func:`enrolled_together`'s, with this rail's
    jobs beside it when they settle together), or None (a stale or ``pending`` outcome: a
    transaction).

    The statement changes nothing for this rail, and the transaction path runs instead, when the job
    no longer owns its rail, the payment method is not active or is being deleted, or the rail was
    shown ``pending`` (``notify``: its event is written in the transaction)."""
    if isinstance(outcome, Stale) or outcome.status != RailStatus.ENABLED:
        return None
    provider_card = outcome.card or {}
    params = {
        "rail_id": uuid.UUID(job.subject_id),
        "enrollment_id": outcome.id,
        "provider_ids": dict(outcome.provider_ids) if outcome.provider_ids is not None else None,
        "merge_card": bool(provider_card),
        "card_fields": {k: v for k, v in provider_card.items() if k != "display" and v is not None},
        "card_display": {k: v for k, v in (provider_card.get("display") or {}).items() if v is not None},
        "blank_display": dict.fromkeys(DISPLAY_FIELDS),
        "enrolled_at": utcnow(),
    }
    return jobs.OutcomeWrite(
        None,
        params,
        {"rail_status": outcome.status, "enrollment_id": outcome.id},
        answer_from=functools.partial(enrolled_answer, job.tenant_id),
        joint=enrolled_together,
    )


def enrolled_together(outcomes: Sequence[tuple[Job, jobs.OutcomeWrite]]) -> jobs.JointWrite:
    """The outcome writes of enabled rails of one payment method (:func:`enrolled_write`: one, or a
    create's rails, whose jobs were leased together) as one statement (:func:`_enrolled_together`):
    one lock of the payment method, each rail enabled, the card merged once with every provider's
    card data in the order given (:func:`merge_card` fills what is missing: the same done at once,
    the first provider's value winning, or one provider after the other), one release of the
    lease."""
    card_fields: dict[str, Any] = {}
    card_display: dict[str, Any] = {}
    for _, write in outcomes:
        card_fields = {**write.params["card_fields"], **card_fields}  # the first provider's value wins
        card_display = {**write.params["card_display"], **card_display}
    rows = [
        {
            "job_id": str(job.id),
            "rail_id": str(write.params["rail_id"]),
            "enrollment_id": write.params["enrollment_id"],
            "provider_ids": write.params["provider_ids"],
            "result": write.result,
        }
        for job, write in outcomes
    ]
    first = outcomes[0][1].params
    return jobs.JointWrite(
        _enrolled_together(),
        _ANSWERED,
        {
            "outcome_rows": rows,
            "merge_card": any(write.params["merge_card"] for _, write in outcomes),
            "card_fields": card_fields,
            "card_display": card_display,
            "blank_display": first["blank_display"],
            "enrolled_at": first["enrolled_at"],
        },
    )


_PMS, _RAILS = table_of(PaymentMethod), table_of(PaymentMethodRail)
_JSON_NULL = literal_column("'null'::jsonb", JSONB)
_JSON_EMPTY = literal_column("'{}'::jsonb", JSONB)
_DISPLAY: ColumnElement[str] = literal_column("'display'::text")


def _filled(base: ColumnElement, values: ColumnElement) -> ColumnElement:
    """``base`` (a JSON object) with each entry of ``values`` added where ``base`` has no value
    (missing or null): the SQL of one level of :func:`domain.agentic.payment_methods.merge_card`."""
    entry = func.jsonb_each(values).table_valued("key", "value").alias("entry")
    missing = func.coalesce(base.op("->", return_type=JSONB)(entry.c.key), _JSON_NULL) == _JSON_NULL
    fill = select(func.jsonb_object_agg(entry.c.key, entry.c.value)).select_from(entry).where(missing)
    return base.op("||", return_type=JSONB)(func.coalesce(fill.scalar_subquery(), _JSON_EMPTY))


def _merged_card(locked_pm: CTE) -> CTE:
    """The payment method's card (the ``card`` column of ``locked_pm``) merged with the bind
    parameters ``card_fields``, ``card_display`` and ``blank_display`` (:func:`merge_card`, in SQL):
    a CTE of one row, ``card`` (JSON) and ``changed``."""
    # Each step a materialized CTE, so that the stored card is parsed once and the merge computed
    # once: inlined, the expressions were repeated (the card parsed about ten times, each jsonb_each
    # run twice), 0.8 ms of the statement while the payment method's lock is held.
    card = cast(locked_pm.c.card, JSONB)
    parsed = (
        select(
            card.label("card"),
            func.coalesce(func.nullif(card, _JSON_NULL), literal_column("""'{"type": "card"}'::jsonb""", JSONB)).label(
                "base"
            ),
        )
        .select_from(locked_pm)
        .cte("parsed_card")
        .prefix_with("MATERIALIZED")
    )
    base = parsed.c.base
    top = _filled(base, cast(bindparam("card_fields", type_=JSON), JSONB))
    display = func.coalesce(
        func.nullif(func.nullif(base.op("->", return_type=JSONB)(_DISPLAY), _JSON_NULL), _JSON_EMPTY),
        cast(bindparam("blank_display", type_=JSON), JSONB),
    )
    merged = (
        select(
            top.op("||", return_type=JSONB)(
                func.jsonb_build_object(_DISPLAY, _filled(display, cast(bindparam("card_display", type_=JSON), JSONB)))
            ).label("card"),
            parsed.c.card.label("stored"),
        )
        .select_from(parsed)
        .cte("merged_jsonb")
        .prefix_with("MATERIALIZED")
    )
    merged_card = (
        select(
            cast(merged.c.card, JSON).label("card"), merged.c.card.is_distinct_from(merged.c.stored).label("changed")
        )
        .select_from(merged)
        .cte("merged_card")
    )
    return merged_card


@functools.cache
def _enrolled_together() -> Update:
    """The one statement of :func:`enrolled_together`, built once per process, for one rail or
    several rails of one payment method, their values one row each of the JSON array
    ``outcome_rows`` (``job_id``, ``rail_id``, ``enrollment_id``, ``provider_ids``, ``result``): the
    jobs' rows locked first (:data:`infra.jobs.LOCKED_JOBS`), then the payment method; each rail
    enabled while its job owns it, the payment method is active without a delete requested and
    ``notify`` is off; the payment method's card merged with the providers' (:func:`merge_card`, in
    SQL, only when every rail was enabled: its values are then those of every provider) and its
    ``updated_at`` moved when a rail's view or its card changed; the operation lease released when
    no other rail of the operation is still enrolling (:func:`release_if_done`). Returns, per
    enabled rail's job (:func:`infra.jobs.settle_applied`), what :func:`enrolled_answer` needs
    (:data:`_ANSWERED`); ``released`` is True for one of them at most (the greatest job id), as when
    they were written one after the other.

    The release's test locks the other rails (``FOR SHARE``) so that it reads their latest committed
    state: the statement waited for the payment method's lock while a sibling rail's outcome
    committed, and its snapshot predates that commit. A rail is still enrolling when it is
    ``pending`` with an enrollment job not settled (a create's rails are ``pending`` until their
    outcome; a retry's operation has one rail)."""
    given = (
        func.json_to_recordset(bindparam("outcome_rows", type_=JSON))
        .table_valued(
            column("job_id", _RAILS.c.job_id.type),
            column("rail_id", _RAILS.c.id.type),
            column("enrollment_id", _RAILS.c.enrollment_id.type),
            column("provider_ids", JSON),
            column("result", JSON),
        )
        .render_derived(name="outcome_row", with_types=True)
    )
    rows = select(*given.c).cte("outcome_rows")
    locked = jobs.LOCKED_JOBS
    now = bindparam("enrolled_at", type_=_RAILS.c.updated_at.type)
    locked_pm = (
        select(_PMS.c.id, _PMS.c.status, _PMS.c.delete_requested_at, _PMS.c.card)
        .where(
            exists(select(locked.c.id)),
            _PMS.c.id
            == select(_RAILS.c.payment_method_id)
            .where(_RAILS.c.id == select(rows.c.rail_id).limit(1).scalar_subquery())
            .scalar_subquery(),
        )
        .with_for_update()
        .cte("locked_payment_method")
    )
    view_changed = or_(
        _RAILS.c.status != RailStatus.ENABLED,
        cast(_RAILS.c.provider_ids, JSONB) != cast(func.coalesce(rows.c.provider_ids, _RAILS.c.provider_ids), JSONB),
    )
    enabled = (
        update(_RAILS)
        .where(
            exists(
                select(locked_pm.c.id).where(
                    locked_pm.c.status == PaymentMethodStatus.ACTIVE, locked_pm.c.delete_requested_at.is_(None)
                )
            ),
            _RAILS.c.payment_method_id == select(locked_pm.c.id).scalar_subquery(),
            _RAILS.c.id == rows.c.rail_id,
            _RAILS.c.job_id == rows.c.job_id,
            _RAILS.c.notify.is_(false()),
        )
        .values(
            enrollment_id=rows.c.enrollment_id,
            enrollment_removed_at=None,
            status=RailStatus.ENABLED,
            error_code=None,
            provider_ids=func.coalesce(rows.c.provider_ids, _RAILS.c.provider_ids),
            updated_at=case((view_changed, now), else_=_RAILS.c.updated_at),
        )
        .returning(
            _RAILS.c.id,
            _RAILS.c.payment_method_id,
            _RAILS.c.operation_id,
            _RAILS.c.provider_ids,
            rows.c.job_id,
            rows.c.result,
            (_RAILS.c.updated_at == now).label("changed"),
        )
        .cte("enabled_rails")
    )
    pm_id = select(locked_pm.c.id).scalar_subquery()
    operation_id = select(enabled.c.operation_id).limit(1).scalar_subquery()
    busy = (
        enrolling_rails(pm_id, operation_id)
        .where(_RAILS.c.id.not_in(select(enabled.c.id)), _RAILS.c.status == RailStatus.PENDING)
        .with_for_update(read=True, of=PaymentMethodRail)
        .cte("enrolling_rails")
    )
    released = (
        leases.release_statement(pm_id, operation_id, unless=exists(select(busy.c.id)))
        .returning(table_of(OperationLease).c.resource_id)
        .cte("released_lease")
    )
    every_rail = select(func.count()).select_from(enabled).scalar_subquery() == (
        select(func.count()).select_from(rows).scalar_subquery()
    )
    merged = _merged_card(locked_pm)
    merge = and_(bindparam("merge_card", type_=Boolean), every_rail)
    written = (
        update(_PMS)
        .where(_PMS.c.id == pm_id, exists(select(enabled.c.id)))
        .values(
            card=case((merge, select(merged.c.card).scalar_subquery()), else_=_PMS.c.card),
            updated_at=case(
                (
                    or_(
                        exists(select(enabled.c.id).where(enabled.c.changed)),
                        and_(merge, select(merged.c.changed).scalar_subquery()),
                    ),
                    now,
                ),
                else_=_PMS.c.updated_at,
            ),
        )
        .returning(_PMS.c.id, _PMS.c.card, _PMS.c.updated_at)
        .cte("written_payment_method")
    )
    last = select(func.max(cast(enabled.c.job_id, Text))).scalar_subquery()
    return server_prepared(
        jobs.settle_applied(
            enabled,
            select(written.c.id).scalar_subquery().label("payment_method_id"),
            select(written.c.card).scalar_subquery().label("card"),
            select(written.c.updated_at).scalar_subquery().label("updated_at"),
            enabled.c.provider_ids.label("provider_ids"),
            and_(exists(select(released.c.resource_id)), cast(enabled.c.job_id, Text) == last).label("released"),
        ).add_cte(released)
    )


#: What :func:`_enrolled_together` returns per job beside its id, by name (:func:`enrolled_answer`).
_ANSWERED = ("payment_method_id", "card", "updated_at", "provider_ids", "released")


def enrolled_answer(tenant_id: uuid.UUID | None, written: Mapping[str, Any]) -> dict | None:
    """The answer an enabled rail's outcome message carries (``infra.jobs.OutcomeWrite.answer_from``),
    from what :func:`_enrolled_together` wrote (``written``): the payment method's card sealed with the
    tenant's key (:func:`domain.agentic.payment_methods.seal_answer`), its ``updated_at``, the rail's
    provider ids, and ``released``: True when this outcome released the operation's lease, that is
    when it was the operation's last (its payment method values are then final)."""
    if tenant_id is None:
        return None
    return seal_answer(
        tenant_id,
        str(written["payment_method_id"]),
        card=written["card"],
        updated_at=written["updated_at"],
        provider_ids=written["provider_ids"],
        released=bool(written["released"]),
    )


def classify(error: Exception) -> tuple[str, str | None, str | None]:
    """``(catalogue code, provider code, provider correlation id)`` of a failed enrollment.

    A failure that is not a provider rejection (transient errors past their retries) is
    unclassifiable: ``PROVIDER_ENROLLMENT_FAILED``.
    """
    if isinstance(error, EnrollmentFailed):
        return error.code, error.provider_code, error.correlation_id
    if isinstance(error, PermanentError) and error.code in CATALOGUE:
        return error.code, None, None
    return UNCLASSIFIED, None, None


def enrollment_failed(session: Session, job: Job, error: Exception) -> None:
    """Record a failed enrollment or poll: the rail in ``error`` with the catalogue code, a provider
    error object; the event when the rail had been shown pending."""
    pm, rail = _locked_rail(session, job)
    if pm is None or rail is None or not _current(pm, rail, job):
        if pm is not None and rail is not None and rail.job_id == job.id:
            release_if_done(session, pm.id, rail.operation_id, finished_job=job.id)
        return
    code, provider_code, correlation = classify(error)
    detail = None
    if code == UNCLASSIFIED and isinstance(error, EnrollmentFailed) and error.provider_code is None:
        detail = f"The provider did not answer in time ({error}); retry the rail."
    record_provider_error(
        session, rail, code=code, provider_code=provider_code, correlation_id=correlation, detail=detail
    )
    settle_rail(session, pm, rail, status=RailStatus.ERROR, error_code=code, trace_id=job.trace_id)
    release_if_done(session, pm.id, rail.operation_id, finished_job=job.id)


# ---- delete cascade ------------------------------------------------------------------------------


def _delete_subject(job: Job) -> tuple[str, str]:
    """The payment method a delete job works on and the operation (lease owner) it belongs to."""
    return job.subject_id or "", job.operation_id or ""


def perform_delete(job: Job, settings: Settings) -> str | Stale:
    """Remove each rail's provider enrollment not removed yet, recording each removal at once.

    A failing removal raises (TransientError: retried; PermanentError: the cascade stops, and the
    next DELETE resumes it) with ``rail_id`` set on the exception.
    """
    pm_id, owner = _delete_subject(job)
    with session_scope() as session:
        pm = session.get(PaymentMethod, pm_id, populate_existing=True)
        if pm is None or pm.status == PaymentMethodStatus.DELETED or pm.delete_requested_at is None:
            return Stale("nothing to delete")
        lease = leases.held(session, pm_id)
        if lease is not None and lease.owner != owner:
            return Stale("another delete holds the payment method")
        pm_tenant_type = tenant_type(session, pm.tenant_id)
        todo = [
            (r.id, r.provider, r.enrollment_id)
            for r in rails_of(session, pm_id)
            if r.enrollment_id and r.enrollment_removed_at is None
        ]
        allowance_ids = allowance_work.payment_method_allowances(session, pm_id)
    allowance_work.cancel_rails(settings, allowance_ids, key=str(job.id))
    for rail_id, provider_name, enrollment_id in todo:
        try:
            require_provider(provider_name, pm_tenant_type, settings).delete_enrollment(enrollment_id)
        except (PermanentError, TransientError) as exc:
            name_failed_rail(exc, rail_id)
            raise
        with session_scope() as session:
            rail = session.get(PaymentMethodRail, rail_id)
            if rail is not None and rail.enrollment_id == enrollment_id:
                rail.enrollment_removed_at = utcnow()
                session.add(rail)
    return "removed"


def apply_delete(session: Session, job: Job, outcome: str | Stale) -> dict:
    """The cascade is complete: the payment method is deleted and the delete lease released."""
    pm_id, owner = _delete_subject(job)
    pm = lock(session, pm_id)
    if pm is not None and not isinstance(outcome, Stale) and pm.status == PaymentMethodStatus.ACTIVE:
        allowance_work.cancel_payment_method_allowances(session, pm_id, trace_id=job.trace_id)
        mark_deleted(session, pm)
    leases.release(session, pm_id, owner)
    return {"outcome": outcome.reason if isinstance(outcome, Stale) else outcome}


def delete_failed(session: Session, job: Job, error: Exception) -> None:
    """The cascade stopped: the payment method stays active with its delete requested (the next
    DELETE resumes it; retries answer ``PAYMENT_METHOD_DELETE_INCOMPLETE``); the lease is freed and
    the failing removal recorded as a provider error."""
    pm_id, owner = _delete_subject(job)
    pm = lock(session, pm_id)
    rail_id = failed_rail(error)
    rail = session.get(PaymentMethodRail, rail_id) if rail_id else None
    if pm is not None and rail is None:
        allowance_work.record_cancel_failure(session, error)  # an allowance the cascade could not cancel
    if pm is not None and rail is not None:
        provider_code = error.provider_code if isinstance(error, EnrollmentFailed) else None
        correlation = error.correlation_id if isinstance(error, EnrollmentFailed) else None
        record_provider_error(
            session,
            rail,
            code="PROVIDER_ALLOWANCE_CANCEL_FAILED",
            provider_code=provider_code,
            correlation_id=correlation,
            operation="deletion",
        )
    leases.release(session, pm_id, owner)
