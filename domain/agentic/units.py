"""Keyed operations' own transactions: a create or a mint commits on its own so that a failing
commit (its answer lost: the outcome cannot be told) is told apart from a failure before it
(nothing was written); the routes settle the operation's idempotency record accordingly
(``app/routes/agentic_common.py``, spec 001 section 8, Idempotency).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from sqlmodel import Session

from storage.db import get_engine

P = ParamSpec("P")
T = TypeVar("T")


class OutcomeUnknown(Exception):
    """The commit of a create raised: it may or may not have been applied."""


def commit(session: Session) -> None:
    """Commit a create's transaction (a seam: the tests make it lose its answer)."""
    session.commit()


def commit_unit(fn: Callable[Concatenate[Session, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn(session, *args, **kwargs)`` in its own transaction, telling apart a failure before
    the commit (re-raised: nothing was written) from a failing commit (:class:`OutcomeUnknown`)."""
    session = Session(get_engine(), expire_on_commit=False)
    try:
        try:
            result = fn(session, *args, **kwargs)
            session.flush()
        except BaseException:
            session.rollback()
            raise
        try:
            commit(session)
        except Exception as exc:
            raise OutcomeUnknown(str(exc)) from exc
        return result
    finally:
        session.close()
