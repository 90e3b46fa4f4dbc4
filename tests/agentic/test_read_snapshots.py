"""The reads of a payment method and of an allowance (GET and list) see the row and its rails as of
one moment: an outcome that commits between the read's statements (the row, then its rails) is seen
whole or not at all, never a rail already changed beside the row's earlier ``updated_at``.

The outcome is committed on another connection from inside the read, right after its first
statement on the parent table (an ``after_cursor_execute`` hook), which is the interleaving a worker's
commit makes by chance under load."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Connection, event, update
from sqlmodel import Session

from domain.agentic import allowances as allowance_reads
from domain.agentic import service as payment_method_reads
from domain.tenancy.auth import authenticate
from domain.tenancy.caller import Caller
from storage.db import get_engine, session_scope
from storage.models_agentic import PaymentMethod, PaymentMethodRail
from storage.models_allowances import Allowance, AllowanceRail
from tests.factories.agentic import AMEX, created
from tests.factories.allowances import allowance

pytestmark = pytest.mark.api


@contextlib.contextmanager
def _committed_after_first_read(session: Session, table: str, write: Callable[[Connection], None]) -> Iterator[list]:
    """While in the block, ``write`` commits on another connection right after ``session``'s first
    ``SELECT`` naming ``table`` (once); the list yielded holds True once it has."""
    engine, done = session.get_bind(), []

    def after(connection, _cursor, statement: str, *_args) -> None:
        if done or connection is not session.connection():
            return
        if statement.lstrip().upper().startswith("SELECT") and f"FROM {table}" in statement:
            done.append(True)
            with get_engine().begin() as other:
                write(other)

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield done
    finally:
        event.remove(engine, "after_cursor_execute", after)


def _caller(api_key: str) -> Caller:
    with session_scope() as session:
        caller = authenticate(session, api_key)
    assert caller is not None
    return caller


def _touch(table, row_id: str, rails, parent_column) -> Callable[[str], Callable[[Connection], None]]:
    """status -> a committed outcome: every rail of ``row_id`` set to that status, the row's
    ``updated_at`` moved."""

    def outcome(status: str) -> Callable[[Connection], None]:
        def write(other: Connection) -> None:
            other.execute(update(rails).where(parent_column == row_id).values(status=status))
            other.execute(update(table).where(table.c.id == row_id).values(updated_at=dt.datetime.now(dt.UTC)))

        return write

    return outcome


def _pm_reads(tenant, caller):
    """A new payment method (one rail, enabled): its tables, its GET and its list's view of it."""
    row_id = created(tenant.client, AMEX)["id"]
    rails = PaymentMethodRail.__table__

    def listed(session):
        page = payment_method_reads.list_payment_methods(
            session, caller, size=100, after=None, consumer_id=None, status="all"
        )[0]
        return next(view for view in page if view["id"] == row_id)

    def read(session):
        return payment_method_reads.read_payment_method(session, caller, row_id)

    write = _touch(PaymentMethod.__table__, row_id, rails, rails.c.payment_method_id)
    return "agentic_payment_methods", write, read, listed, ("error", "pending")


def _allowance_reads(tenant, caller):
    """A new allowance (one rail, active): its tables, its GET and its list's view of it."""
    row_id = allowance(tenant.client, AMEX)["id"]
    rails = AllowanceRail.__table__

    def listed(session):
        page = allowance_reads.list_allowances(
            session, caller, size=100, after=None, payment_method_id=None, status=None
        )[0]
        return next(view for view in page if view["id"] == row_id)

    def read(session):
        return allowance_reads.read_allowance(session, caller, row_id)

    write = _touch(Allowance.__table__, row_id, rails, rails.c.allowance_id)
    return "agentic_allowances", write, read, listed, ("inactive", "error")


@pytest.mark.parametrize("reads", [_pm_reads, _allowance_reads], ids=["payment method", "allowance"])
def test_a_read_and_a_list_see_the_rails_as_of_one_moment(tenant, reads):
    table, write, read, listed, statuses = reads(tenant, _caller(tenant.api_key))
    for status, seen_by in zip(statuses, (read, listed), strict=True):
        with session_scope() as session:
            before = read(session)
        with session_scope() as session, _committed_after_first_read(session, table, write(status)) as done:
            seen = seen_by(session)
        assert done == [True]
        assert [r["status"] for r in seen["rails"]] == [r["status"] for r in before["rails"]] != [status]
        assert seen["updated_at"] == before["updated_at"]
        with session_scope() as session:
            after = read(session)
        assert [r["status"] for r in after["rails"]] == [status] and after["updated_at"] > before["updated_at"]
