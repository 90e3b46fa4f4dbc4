"""Fixtures of the key tests: switching the process's wrapping keys, waiting for a rewrap, and the
test run's master key replaced by a new one for a test."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Iterator

import pytest

from config.settings import reload_settings
from domain.keys import service
from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models import KeyCheck
from tests.helpers import wait_until

#: Sets (a string) or removes (None) ``TESSERA_*`` variables and reloads the settings and the keyring.
UseKeys = Callable[..., None]
#: Starts a rewrap and waits until it ended; its :func:`domain.keys.service.status` report.
Rewrap = Callable[..., dict]


def _use_keys(**env: str | None) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    reload_settings()
    get_keyring.cache_clear()


def _rewrap(timeout: float = 180.0) -> dict:
    with session_scope() as session:
        service.start_rewrap(session)

    def settled() -> dict | bool:
        with session_scope() as session:
            report = service.status(session)
            check = session.get(KeyCheck, 1)
            moved = check is not None and check.wrapped_by == get_keyring().current.wrapped_by
        return report["data_keys_under_previous"] == 0 and report["key_check"] == "ok" and moved and report

    return wait_until(settled, timeout=timeout, interval=0.2)


@pytest.fixture
def use_keys() -> UseKeys:
    """:data:`UseKeys`: e.g. ``use_keys(TESSERA_MASTER_KEY=new, TESSERA_MASTER_KEY_PREVIOUS=None)``."""
    return _use_keys


@pytest.fixture
def rewrap() -> Rewrap:
    """:data:`Rewrap`: start ``keys.rewrap`` and wait until every wrapped key and the key check are
    under the current wrapping key (``rewrap(timeout=seconds)``)."""
    return _rewrap


@pytest.fixture
def new_master_key(use_keys: UseKeys, rewrap: Rewrap) -> Iterator[tuple[Callable[[str, str | None], None], str, str]]:
    """The test run's master key replaced by a new one, the old one previous; restored (and the keys
    rewrapped back) afterwards. Yields ``(use(current, previous), old, new)``."""
    old = os.environ["TESSERA_MASTER_KEY"]
    new = base64.b64encode(os.urandom(32)).decode()

    def use(current: str, previous: str | None) -> None:
        use_keys(TESSERA_MASTER_KEY=current, TESSERA_MASTER_KEY_PREVIOUS=previous)

    use(new, old)
    yield use, old, new
    use(old, new)
    rewrap()
    use(old, None)
