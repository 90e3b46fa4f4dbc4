"""The key check: the wrapping key a database's keys are under, recorded in the database itself.

``key_checks`` holds one row: ``wrapped_by`` names the wrapping key (``master:<key check value>`` or
``kms:<key id>``) and ``check_value`` is a constant wrapped by it. Every role that opens sealed data
(api, worker, beat, ``tessera dev``, the CLI's tenant commands) calls :func:`require` before it
serves: a process whose key does not open the check (a new master key over old data, a KMS key of
another deployment) refuses to start with one line naming the setting, and ``/readyz`` fails, rather
than answering 500 on every read. During a rotation the previous key still passes (it is in
``TESSERA_MASTER_KEY_PREVIOUS`` / ``TESSERA_KMS_KEY_ID_PREVIOUS``); ``tessera keys rewrap`` moves the
check under the current key when every data key is.

The first process to start on a database records the check, after opening one stored data key (so a
database made before the check existed is not claimed by the wrong key); rows of that time name no
wrapping key and are then named by the key that opened them.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlmodel import Session, col

from storage.crypto import DecryptionError, Keyring, KeyUnavailable, MasterKeyMissing, Wrapper, get_keyring
from storage.db import session_scope
from storage.models import KeyCheck, TenantDataKey, TenantIndexKey
from storage.sql import insert_if_absent
from storage.types import utcnow

#: The constant the check wraps, and the tenant id its wrapping is bound to (no tenant's).
CHECK_PLAINTEXT = b"tessera key check v1"
CHECK_TENANT = uuid.UUID(int=0)
OK, MISMATCH = "ok", "mismatch"


class KeyCheckFailed(RuntimeError):
    """This process's keys do not open the database's keys; the message is one line naming the
    setting to fix."""


class DatabaseUnavailable(KeyCheckFailed):
    """The key check could not be made because the database did not answer (refused or closed the
    connection: not started yet, restarting); it may answer a moment later."""


def _setting(wrapped_by: str) -> str:
    return "TESSERA_KMS_KEY_ID" if wrapped_by.startswith("kms:") else "TESSERA_MASTER_KEY"


def _record(session: Session, wrapper: Wrapper) -> None:
    wrapped, _ = wrapper.wrap(CHECK_PLAINTEXT, CHECK_TENANT)
    insert_if_absent(
        session,
        KeyCheck,
        {
            "id": 1,
            "wrapping": wrapper.name,
            "wrapped_by": wrapper.wrapped_by,
            "check_value": wrapped,
            "updated_at": utcnow(),
        },
    )


def _adopt_unnamed(session: Session, keyring: Keyring) -> None:
    """A database from before keys were named: open one stored key (refusing the wrong key) and
    name every unnamed row of that kind by the key that opened it (one master key was all there was)."""
    models: tuple[type[TenantDataKey] | type[TenantIndexKey], ...] = (TenantDataKey, TenantIndexKey)
    for model in models:
        row = (
            session.execute(
                select(model).where(col(model.wrapped_by).is_(None), col(model.wrapped_key).is_not(None)).limit(1)
            )
            .scalars()
            .first()
        )
        if row is None:
            continue
        try:
            _, opener = keyring.unwrap(row.tenant_id, row.wrapped_key, row.wrapping, row.kms_key_id, None)
        except DecryptionError:
            raise KeyCheckFailed(
                f"{_setting(keyring.current.wrapped_by)} does not open the data keys already in this database: set "
                "the key the database was made with"
            ) from None
        session.execute(
            update(model)
            .where(col(model.wrapped_by).is_(None), col(model.wrapping) == opener.name)
            .values(wrapped_by=opener.wrapped_by)
        )


def _refuse_foreign_keys(session: Session, keyring: Keyring) -> None:
    """Before the first check is recorded: every stored key must be under a wrapping key this process
    accepts (a database whose check row is missing is not claimed by a key that opens none of its data)."""
    for model in (TenantDataKey, TenantIndexKey):
        names = session.execute(
            select(col(model.wrapped_by))
            .where(col(model.wrapped_by).is_not(None), col(model.wrapped_key).is_not(None))
            .distinct()
        ).scalars()
        foreign = sorted(name for name in names if name not in keyring.accepted)
        if foreign:
            raise KeyCheckFailed(
                f"{_setting(foreign[0])} does not open the data keys already in this database (they are under "
                f"{foreign[0]}): set the key the database was made with"
            )


def verify(session: Session, keyring: Keyring | None = None) -> str:
    """Check this process's keys against the database (recording the check on first use): ``ok``.

    Raises :class:`KeyCheckFailed` (one line naming the setting) when they do not open it, and
    :class:`~storage.crypto.KeyUnavailable` when KMS cannot be reached."""
    keyring = keyring or get_keyring()
    try:
        current = keyring.current
    except MasterKeyMissing as exc:
        raise KeyCheckFailed(str(exc)) from None
    except ValueError as exc:
        raise KeyCheckFailed(str(exc)) from None
    row = session.get(KeyCheck, 1)
    if row is None:
        _adopt_unnamed(session, keyring)
        _refuse_foreign_keys(session, keyring)
        _record(session, current)
        session.flush()
        row = session.get(KeyCheck, 1, populate_existing=True)
        assert row is not None
    wrapper = keyring.accepted.get(row.wrapped_by)
    if wrapper is None:
        setting = _setting(row.wrapped_by)
        raise KeyCheckFailed(
            f"{setting} does not open this database's keys (they are under {row.wrapped_by}, this process has "
            f"{current.wrapped_by}): set the key the database was made with, or add it to {setting}_PREVIOUS "
            "while `tessera keys rewrap` runs"
        )
    try:
        opened = wrapper.unwrap(row.check_value, CHECK_TENANT, None)
    except DecryptionError:
        opened = b""
    if opened != CHECK_PLAINTEXT:
        raise KeyCheckFailed(f"{_setting(row.wrapped_by)} does not open this database's key check")
    return OK


def status(session: Session, keyring: Keyring | None = None) -> str:
    """``ok`` or ``mismatch`` (never raises for a wrong key; KMS outages still raise
    :class:`~storage.crypto.KeyUnavailable`)."""
    try:
        return verify(session, keyring)
    except KeyCheckFailed:
        return MISMATCH


def move_to_current(session: Session, keyring: Keyring | None = None) -> None:
    """Wrap the check under the current key (after every data key was rewrapped under it)."""
    keyring = keyring or get_keyring()
    current = keyring.current
    wrapped, _ = current.wrap(CHECK_PLAINTEXT, CHECK_TENANT)
    session.execute(
        update(KeyCheck)
        .where(col(KeyCheck.id) == 1)
        .values(wrapping=current.name, wrapped_by=current.wrapped_by, check_value=wrapped, updated_at=utcnow())
    )


def require() -> None:
    """:func:`verify` in a unit of work of its own; raises :class:`KeyCheckFailed` with one line
    (also when the database cannot be read or KMS cannot be reached: nothing can be opened then),
    :class:`DatabaseUnavailable` when the database did not answer at all."""
    try:
        with session_scope() as session:
            verify(session)
    except KeyUnavailable as exc:
        raise KeyCheckFailed(f"the key check cannot be made: {exc} (TESSERA_KMS_KEY_ID)") from None
    except SQLAlchemyError as exc:
        failed = DatabaseUnavailable if isinstance(exc, OperationalError) else KeyCheckFailed
        raise failed(
            f"the key check cannot be made: the database did not answer ({type(exc).__name__}); "
            "is it migrated (tessera migrate)?"
        ) from None
