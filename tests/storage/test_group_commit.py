"""Group commit (``storage.db.GroupCommit``): units of work arriving together share one statement and
one commit; when one of them fails, each runs again alone and answers for itself. Real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import event, func, select, text
from sqlalchemy.exc import IntegrityError

from domain.tenancy import audit
from domain.tenancy.caller import Caller
from storage.db import GroupCommit, Rows, get_autocommit_engine, on_commit, session_scope, stage_rows
from storage.models import AuditLog

pytestmark = pytest.mark.api


def _caller(tenant) -> Caller:
    return Caller(
        tenant_id=tenant.id, tenant_type="test", application_id=None, application_type=None, permissions=frozenset()
    )


def _log_unit(session, caller: Caller, entity_id: str, *, fail: bool = False, row_id: uuid.UUID | None = None):
    """Stage one log row about ``entity_id``; answer the id of the transaction it ran in."""
    rows = Rows()
    audit.stage(rows, caller, entity_type="token", entity_id=entity_id, operation="read")
    if row_id is not None:
        next(iter(rows.tables.values()))[0]["id"] = row_id
    stage_rows(session, rows)
    if fail:
        raise ValueError("this unit of work fails")
    return session.execute(text("SELECT txid_current()")).scalar()


def _logged(tenant, entity_ids: list[str]) -> list[str]:
    with session_scope() as session:
        return sorted(
            session.execute(
                select(AuditLog.entity_id).where(AuditLog.tenant_id == tenant.id, AuditLog.entity_id.in_(entity_ids))
            ).scalars()
        )


def _run_together(units: list[tuple]) -> list:
    """Submit every unit at once to one GroupCommit (a 50 ms window, so they form one group)."""
    executor = ThreadPoolExecutor(4)

    async def main():
        group = GroupCommit(executor, window=0.05)
        return await asyncio.gather(*(group.run(*unit[0], **unit[1]) for unit in units), return_exceptions=True)

    try:
        return asyncio.run(main())
    finally:
        executor.shutdown()


def test_units_arriving_together_share_one_transaction(tenant):
    caller = _caller(tenant)
    ids = [f"group-{n}-{uuid.uuid4()}" for n in range(5)]
    transactions = _run_together([((_log_unit, caller, entity_id), {}) for entity_id in ids])
    assert len(set(transactions)) == 1  # one transaction, one commit
    assert _logged(tenant, ids) == sorted(ids)


def test_units_that_only_stage_rows_are_written_by_one_statement_that_is_its_own_transaction(tenant):
    """When no unit of the group sent a statement (their reads were cached), the group's rows go out
    in one statement in autocommit mode (no BEGIN, no COMMIT), and what waits for the commit runs."""
    caller = _caller(tenant)
    ids = [f"alone-{n}-{uuid.uuid4()}" for n in range(4)]
    fired: list[str] = []

    def stage_unit(session, entity_id: str):
        rows = Rows()
        audit.stage(rows, caller, entity_type="token", entity_id=entity_id, operation="read")
        stage_rows(session, rows)
        on_commit(session, lambda: fired.append(entity_id))
        return entity_id

    sent: list[tuple[str, bool]] = []

    def record(connection, _cursor, statement, _parameters, _context, _many):
        sent.append((statement, connection.connection.dbapi_connection.autocommit))

    engine = get_autocommit_engine()  # where one-statement transactions run
    assert engine is not None
    event.listen(engine, "before_cursor_execute", record)
    try:
        answers = _run_together([((stage_unit, entity_id), {}) for entity_id in ids])
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert answers == ids
    assert len(sent) == 1 and "INSERT INTO" in sent[0][0] and sent[0][1] is True
    assert sorted(fired) == sorted(ids)
    assert _logged(tenant, ids) == sorted(ids)


def test_a_failing_unit_does_not_take_the_others_down(tenant):
    caller = _caller(tenant)
    ids = [f"group-{n}-{uuid.uuid4()}" for n in range(4)]
    outcomes = _run_together([((_log_unit, caller, entity_id), {"fail": n == 2}) for n, entity_id in enumerate(ids)])
    assert isinstance(outcomes[2], ValueError)
    assert all(isinstance(o, int) for n, o in enumerate(outcomes) if n != 2)
    assert len({o for n, o in enumerate(outcomes) if n != 2}) == 3  # each ran again alone
    assert _logged(tenant, ids) == sorted(ids[:2] + ids[3:])  # the failed one wrote nothing


def test_a_conflict_in_the_shared_statement_is_answered_by_the_unit_that_caused_it(tenant):
    caller = _caller(tenant)
    taken = uuid.uuid4()
    ids = [f"group-{n}-{uuid.uuid4()}" for n in range(3)]
    outcomes = _run_together(
        [
            ((_log_unit, caller, ids[0]), {"row_id": taken}),
            ((_log_unit, caller, ids[1]), {}),
            ((_log_unit, caller, ids[2]), {"row_id": taken}),
        ]
    )
    assert isinstance(outcomes[2], IntegrityError)
    assert isinstance(outcomes[0], int) and isinstance(outcomes[1], int)
    assert _logged(tenant, ids) == sorted(ids[:2])
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(AuditLog).where(AuditLog.id == taken)) == 1


def test_what_arrives_while_a_group_runs_forms_the_next_group_once_it_ends(tenant):
    """One group at a time (the default): units submitted while a group runs wait for it to end and
    then share one transaction; no two units ever run at once."""
    caller = _caller(tenant)
    executor = ThreadPoolExecutor(4)
    running, overlaps = [0], []

    def unit(session, entity_id: str, *, hold: float = 0.0):
        running[0] += 1
        overlaps.append(running[0])
        try:
            time.sleep(hold)
            return _log_unit(session, caller, entity_id)
        finally:
            running[0] -= 1

    ids = [f"next-{n}-{uuid.uuid4()}" for n in range(4)]

    async def main():
        group = GroupCommit(executor, window=0.001)
        first = asyncio.ensure_future(group.run(unit, ids[0], hold=0.3))
        await asyncio.sleep(0.1)  # the first group holds its transaction
        later = [group.run(unit, entity_id) for entity_id in ids[1:]]
        return await asyncio.gather(first, *later)

    try:
        transactions = asyncio.run(main())
    finally:
        executor.shutdown()
    assert max(overlaps) == 1
    assert len(set(transactions[1:])) == 1 and transactions[0] not in transactions[1:]
    assert _logged(tenant, ids) == sorted(ids)


@pytest.mark.parametrize("window", [0.0, 0.001])
def test_a_unit_alone_answers_its_result_or_its_error(tenant, window):
    caller = _caller(tenant)
    executor = ThreadPoolExecutor(2)

    async def main():
        group = GroupCommit(executor, window=window)
        ok = await group.run(_log_unit, caller, f"alone-{uuid.uuid4()}")
        with pytest.raises(ValueError):
            await group.run(_log_unit, caller, f"alone-{uuid.uuid4()}", fail=True)
        return ok

    try:
        assert isinstance(asyncio.run(main()), int)
    finally:
        executor.shutdown()
