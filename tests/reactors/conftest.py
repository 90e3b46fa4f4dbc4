"""A reactor runtime on real Node.js 22 (the wheel's), under a folder of the test run."""

from __future__ import annotations

import itertools
import uuid

import pytest

from domain.reactors.runtime import Reactor, ReactorRuntime, Runtime

_ids = itertools.count()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """Scans against no advisory at all unless a test gives its own file (npm audit is tested apart)."""
    rt = ReactorRuntime(tmp_path_factory.mktemp("reactors"))
    yield rt
    rt.close()


def reactor(code: str, **runtime: object) -> Reactor:
    """A reactor of its own id with ``code`` on a node22 runtime (``runtime`` overrides fields)."""
    return Reactor(f"{next(_ids)}-{uuid.uuid4()}", code, Runtime(image="node22", **runtime))
