"""An enabled rail's outcome as one statement on real PostgreSQL (``domain.agentic.enrollment.
enrolled_write`` through ``infra.jobs.settle_with``): the rail, the card merge, ``updated_at``, the
operation lease released by the last rail of the operation (also when the two rails settle at the
same moment), and the outcomes it leaves to the transaction path."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

import pytest
from sqlalchemy import select, text, update

from domain.agentic.enrollment import Stale, enrolled_write
from domain.agentic.payment_methods import ENROLL_TASK, merge_card
from domain.tenancy.tenants import create_tenant
from infra import jobs
from infra.dispatch import take_pending
from providers.agentic import DISPLAY_FIELDS, Enrollment
from storage.db import get_engine, session_scope
from storage.models import Job
from storage.models_agentic import OperationLease, PaymentMethod, PaymentMethodRail
from storage.types import utcnow

pytestmark = pytest.mark.worker

OPERATION = "op_statement_test"
BEFORE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PROVIDER_CARD = {
    "brand": "visa",
    "last4": "4242",
    "display": {"background_color": "#1A1F71", "art_url": "https://art.example/visa.png"},
}


def _payment_method(card: dict | None, rails: int = 2) -> tuple[str, list[Job], list[uuid.UUID]]:
    """A payment method with ``rails`` pending rails of one operation (its lease held), each with an
    enrollment job leased by this test (no worker takes it): ``(id, jobs, rail ids)``."""
    with session_scope() as session:
        tenant_id = create_tenant(
            session, name="enrollment", owner_email=f"o-{uuid.uuid4().hex[:8]}@example.com"
        ).tenant_id
        pm = PaymentMethod(
            id=f"pm_{uuid.uuid4().hex}",
            tenant_id=tenant_id,
            source={"type": "svc_card_token", "token_id": "tok"},
            token_id="tok",
            consumer={"id": "c"},
            consumer_id="c",
            card=card,
            created_at=BEFORE,
            updated_at=BEFORE,
        )
        session.add(pm)
        recorded, rail_ids = [], []
        for position, (rail, provider) in enumerate([("agentic-token", "vic"), ("spt", "psp")][:rails]):
            row = PaymentMethodRail(
                tenant_id=tenant_id,
                payment_method_id=pm.id,
                position=position,
                rail=rail,
                provider=provider,
                operation_id=OPERATION,
                created_at=BEFORE,
                updated_at=BEFORE,
            )
            job = jobs.record(
                session,
                kind=ENROLL_TASK,
                tenant_id=tenant_id,
                subject_type="rail",
                subject_id=str(row.id),
                trace_id=None,
            )
            row.job_id = job.id
            session.add(row)
            recorded.append(job.id)
            rail_ids.append(row.id)
        session.add(
            OperationLease(
                resource_id=pm.id,
                tenant_id=tenant_id,
                operation="enroll",
                owner=OPERATION,
                expires_at=utcnow() + dt.timedelta(minutes=5),
            )
        )
        take_pending(session)  # no message: this test is the worker
    leased = [jobs.lease(job_id, f"tests:{job_id}", lease_seconds=30) for job_id in recorded]
    assert all(leased)
    return pm.id, [pair[0] for pair in leased if pair], rail_ids


def _enabled(name: str, card: dict | None = PROVIDER_CARD) -> Enrollment:
    return Enrollment(id=f"enr_{name}", status="enabled", provider_ids={"enrollment": name}, card=card)


def _settle(job: Job, enrollment: Enrollment) -> bool:
    write = enrolled_write(job, enrollment)
    assert write is not None
    return jobs.settle_with(job, write)


def _state(pm_id: str) -> tuple[PaymentMethod, list[PaymentMethodRail], OperationLease | None]:
    with session_scope() as session:
        pm = session.get(PaymentMethod, pm_id)
        rails = list(
            session.execute(
                select(PaymentMethodRail)
                .where(PaymentMethodRail.payment_method_id == pm_id)
                .order_by(PaymentMethodRail.position)
            ).scalars()
        )
        return pm, rails, session.get(OperationLease, pm_id)


def _job(job_id) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def test_the_first_rail_keeps_the_lease_and_the_last_releases_it(database):
    pm_id, (first, second), _ = _payment_method({"type": "card", "display": None})

    assert _settle(first, _enabled("first"))
    pm, rails, lease = _state(pm_id)
    assert lease is not None  # the second rail is still enrolling
    assert (rails[0].status, rails[0].enrollment_id, rails[0].provider_ids) == (
        "enabled",
        "enr_first",
        {"enrollment": "first"},
    )
    assert rails[0].updated_at > BEFORE and pm.updated_at == rails[0].updated_at
    assert (rails[1].status, rails[1].updated_at) == ("pending", BEFORE)
    settled = _job(first.id)
    assert (settled.status, settled.result, settled.lease_owner) == (
        "succeeded",
        {"rail_status": "enabled", "enrollment_id": "enr_first"},
        None,
    )

    assert _settle(second, _enabled("second"))
    pm, rails, lease = _state(pm_id)
    assert lease is None
    assert [rail.status for rail in rails] == ["enabled", "enabled"]
    assert _job(second.id).status == "succeeded"


def test_two_rails_settling_at_once_release_the_lease(database):
    """Both outcomes wait for the payment method's lock while neither has committed, so each one's
    snapshot shows the other rail enrolling: the second to run still sees the first's commit (it
    locks the sibling rails to read them) and releases the lease."""
    pm_id, (first, second), _ = _payment_method({"type": "card"})
    holder = get_engine().connect()
    holder_transaction = holder.begin()
    holder.execute(select(PaymentMethod.id).where(PaymentMethod.id == pm_id).with_for_update())
    done: list[bool] = []
    threads = [
        threading.Thread(target=lambda job=job, name=name: done.append(_settle(job, _enabled(name))))
        for job, name in ((first, "first"), (second, "second"))
    ]
    try:
        for thread in threads:
            thread.start()
        with get_engine().connect() as probe:  # both statements started: each waits for the lock
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                waiting = probe.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                    )
                ).scalar_one()
                probe.rollback()
                if waiting == 2:
                    break
                time.sleep(0.05)
            assert waiting == 2
        holder_transaction.rollback()
        for thread in threads:
            thread.join(10)
    finally:
        holder.close()
    assert done == [True, True]
    _, rails, lease = _state(pm_id)
    assert [rail.status for rail in rails] == ["enabled", "enabled"]
    assert lease is None


@pytest.mark.parametrize(
    "current",
    [
        None,
        {"type": "card", "brand": None, "display": None},
        {"type": "card", "brand": "visa", "last4": None, "display": dict.fromkeys(DISPLAY_FIELDS)},
        {"type": "card", "brand": "mastercard", "display": {"background_color": "#000000", "art_url": None}},
        {"type": "card", "brand": "visa", "last4": "4242", "display": PROVIDER_CARD["display"]},
    ],
)
@pytest.mark.parametrize(
    "provider_card",
    [
        PROVIDER_CARD,
        {"brand": "visa", "last4": None, "display": {"background_color": None, "art_url": "https://a.example/x"}},
        {"last4": "1111"},
        None,
    ],
)
def test_the_card_is_merged_as_merge_card_does(database, current, provider_card):
    pm_id, (job,), (rail_id,) = _payment_method(current, rails=1)
    with session_scope() as session:  # the rail's view is already what the outcome makes it
        session.execute(
            update(PaymentMethodRail)
            .where(PaymentMethodRail.id == rail_id)
            .values(status="enabled", provider_ids={"enrollment": "one"})
        )

    assert _settle(job, _enabled("one", provider_card))

    expected, changed = merge_card(current, provider_card)
    pm, rails, _ = _state(pm_id)
    assert pm.card == expected
    assert (pm.updated_at > BEFORE) is changed  # only a visible change moves it
    assert rails[0].updated_at == BEFORE  # the rail's view did not change


def test_outcomes_the_statement_leaves_to_the_transaction(database):
    """A job that no longer owns its rail, a rail shown pending (its event), a payment method being
    deleted: the statement changes nothing and settles nothing."""
    pm_id, (overtaken, shown), rails = _payment_method({"type": "card"}, rails=2)
    with session_scope() as session:
        session.execute(update(PaymentMethodRail).where(PaymentMethodRail.id == rails[0]).values(job_id=uuid.uuid4()))
        session.execute(update(PaymentMethodRail).where(PaymentMethodRail.id == rails[1]).values(notify=True))
    assert not _settle(overtaken, _enabled("a"))
    assert not _settle(shown, _enabled("b"))

    deleting_id, (deleting,), _ = _payment_method({"type": "card"}, rails=1)
    with session_scope() as session:
        session.execute(
            update(PaymentMethod).where(PaymentMethod.id == deleting_id).values(delete_requested_at=utcnow())
        )
    assert not _settle(deleting, _enabled("c"))

    for job in (overtaken, shown, deleting):
        kept = _job(job.id)
        assert (kept.status, kept.result) == ("running", None)
    for pm in (pm_id, deleting_id):
        _, rows, lease = _state(pm)
        assert {row.status for row in rows} == {"pending"} and lease is not None


def test_a_pending_or_stale_outcome_has_no_one_statement_form(database):
    _, (job,), _ = _payment_method({"type": "card"}, rails=1)
    assert enrolled_write(job, Enrollment(id="enr", status="pending", provider_ids={}, card=None)) is None
    assert enrolled_write(job, Stale("the rail is gone")) is None


def _settle_together(outcomes: list[tuple[Job, Enrollment]]) -> list[bool]:
    writes = [(job, enrolled_write(job, enrollment)) for job, enrollment in outcomes]
    assert all(write is not None for _, write in writes)
    return jobs.settle_together([(job, write) for job, write in writes if write is not None])


OTHER_CARD = {"brand": "visa", "last4": "4242", "expiration_month": 12, "display": {"art_url": "https://b.example/y"}}


@pytest.mark.parametrize(
    "current",
    [
        None,
        {"type": "card", "brand": None, "display": None},
        {"type": "card", "brand": "visa", "last4": "1111", "display": {"background_color": None, "art_url": None}},
    ],
)
@pytest.mark.parametrize("cards", [(PROVIDER_CARD, OTHER_CARD), (None, OTHER_CARD), (OTHER_CARD, None), (None, None)])
def test_two_rails_settled_by_one_statement_release_the_lease_and_merge_as_one_after_the_other(
    database, monkeypatch, current, cards
):
    """Both rails' outcomes as one statement (``enrolled_together``): both rails enabled, both jobs
    succeeded with their results, the lease released, the card what merging the first provider's
    card and then the second's gives; of the two answers exactly one says it released the lease."""
    from infra import wait

    published: list[list] = []
    monkeypatch.setattr(wait, "publish_outcomes", published.append)
    pm_id, (first, second), _ = _payment_method(current)

    assert _settle_together([(first, _enabled("first", cards[0])), (second, _enabled("second", cards[1]))]) == [
        True,
        True,
    ]

    pm, rails, lease = _state(pm_id)
    assert lease is None
    assert [(rail.status, rail.enrollment_id, rail.provider_ids) for rail in rails] == [
        ("enabled", "enr_first", {"enrollment": "first"}),
        ("enabled", "enr_second", {"enrollment": "second"}),
    ]
    expected = merge_card(merge_card(current, cards[0])[0], cards[1])[0]
    assert pm.card == expected
    for job, name in ((first, "first"), (second, "second")):
        settled = _job(job.id)
        assert (settled.status, settled.result, settled.lease_owner) == (
            "succeeded",
            {"rail_status": "enabled", "enrollment_id": f"enr_{name}"},
            None,
        )
    ((one_message),) = published
    assert [job_id for job_id, *_ in one_message] == [first.id, second.id]
    assert sorted(answer["released"] for *_, answer in one_message) == [False, True]


def test_a_joint_outcome_leaves_an_overtaken_rail_to_the_transaction(database):
    """One of the two jobs no longer owns its rail: the statement enables the other rail and settles
    its job only; the overtaken job stays leased (its transaction path follows), its rail pending,
    so the lease is kept; the card is not merged (not every provider's card data applied)."""
    pm_id, (overtaken, kept), rails = _payment_method({"type": "card"})
    with session_scope() as session:  # a job of the same operation took the rail over, still queued
        retry = jobs.record(
            session,
            kind=ENROLL_TASK,
            tenant_id=overtaken.tenant_id,
            subject_type="rail",
            subject_id=str(rails[0]),
            trace_id=None,
        )
        session.flush()
        session.execute(update(PaymentMethodRail).where(PaymentMethodRail.id == rails[0]).values(job_id=retry.id))
        take_pending(session)

    assert _settle_together([(overtaken, _enabled("a")), (kept, _enabled("b"))]) == [False, True]

    pm, rows, lease = _state(pm_id)
    assert [row.status for row in rows] == ["pending", "enabled"]
    assert lease is not None
    assert pm.card == {"type": "card"}
    assert (_job(overtaken.id).status, _job(kept.id).status) == ("running", "succeeded")
    with session_scope() as session:  # settled: the shared database's outbox relay leaves it alone
        session.execute(update(Job).where(Job.id == retry.id).values(status="succeeded"))
