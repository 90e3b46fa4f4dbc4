"""The pause of a rotation's sweep (:class:`domain.keys.sweeps.Throttle`): none while no other session
of the database was seen at work, a quarter of the time for a while after one was, a pause holding
every writer of the sweep; and the look at the database's other sessions it relies on
(:func:`storage.db.others_at_work`), against the real PostgreSQL."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

from domain.keys.sweeps import BUSY_HOLD_SECONDS, BUSY_SHARE, MAX_PAUSE_SECONDS, ROTATION_SESSIONS, Throttle
from storage.db import get_engine, name_transaction, others_at_work, session_scope


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_no_pause_while_no_one_else_was_seen_at_work():
    clock = Clock()
    throttle = Throttle(clock)
    throttle.observe(0)
    assert not throttle.busy
    assert throttle.pause_after(0.10) == 0.0
    assert throttle.paused == 0.0


@pytest.mark.unit
def test_others_at_work_give_the_rotation_a_quarter_of_the_time_for_a_while():
    clock = Clock()
    throttle = Throttle(clock)
    throttle.observe(2)
    assert throttle.busy
    assert throttle.pause_after(0.02) == pytest.approx(0.02 * (1 / BUSY_SHARE - 1))  # 0.06 s: a quarter
    assert throttle.pause_after(1.0) == MAX_PAUSE_SECONDS  # the longest pause
    clock.now += BUSY_HOLD_SECONDS - 0.01
    throttle.observe(0)  # no one seen now, but someone was less than the hold ago
    assert throttle.pause_after(0.02) > 0
    clock.now += 0.02
    assert not throttle.busy
    assert throttle.pause_after(0.02) == 0.0


@pytest.mark.unit
def test_a_pause_holds_every_writer_and_pauses_add_up():
    throttle = Throttle()
    throttle.observe(1)
    throttle.pause_after(0.04)  # 0.12 s
    throttle.pause_after(0.04)  # and 0.12 s more
    began = time.monotonic()
    waited: list[float] = []
    writers = [threading.Thread(target=lambda: (throttle.wait(), waited.append(time.monotonic()))) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(5)
    assert len(waited) == 2
    assert all(at - began >= 0.22 for at in waited)
    assert throttle.paused == pytest.approx(0.24, abs=0.01)


def _running_statement(name: str | None, started: threading.Event) -> None:
    """Run a one-second ``pg_sleep`` in a transaction named ``name`` (when given)."""
    with session_scope() as session:
        if name:
            name_transaction(session, name)
        started.set()
        session.execute(text("SELECT pg_sleep(1)"))


@pytest.mark.parametrize(("name", "left_out"), [(None, 0), (ROTATION_SESSIONS, 1)])
def test_others_at_work_counts_the_statements_of_other_sessions_but_the_rotation_own(name, left_out):
    if get_engine().dialect.name != "postgresql":
        pytest.skip("pg_stat_activity is PostgreSQL's")
    started = threading.Event()
    other = threading.Thread(target=_running_statement, args=(name, started), daemon=True)
    other.start()
    try:
        assert started.wait(10)
        time.sleep(0.3)  # the other session is in its pg_sleep
        with session_scope() as session:  # one snapshot of pg_stat_activity per transaction
            counted = others_at_work(session, ROTATION_SESSIONS)
            every_one = others_at_work(session, "no such name")
    finally:
        other.join(10)
    assert every_one >= 1
    assert every_one - counted == left_out


def test_a_named_transaction_names_its_connection_until_it_ends():
    if get_engine().dialect.name != "postgresql":
        pytest.skip("application_name is PostgreSQL's")
    with session_scope() as session:
        name_transaction(session, ROTATION_SESSIONS)
        assert session.execute(text("SELECT current_setting('application_name')")).scalar_one() == ROTATION_SESSIONS
    with session_scope() as session:  # SET LOCAL: the pooled connection's next transaction is unnamed
        assert session.execute(text("SELECT current_setting('application_name')")).scalar_one() != ROTATION_SESSIONS
