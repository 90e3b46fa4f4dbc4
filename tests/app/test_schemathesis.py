"""Property-based run of the OpenAPI description against the live API (schemathesis): with a management
key, generated requests for every operation (a bounded number each) find no server error and no answer
that breaks its documented schema (status, content type, body).

``TESSERA_FUZZ_REQUESTS`` (default: 8 per operation) sets the number of generated requests of the
whole run, spread over the operations; ``benchmarks/fuzz.py`` runs it with 5,000 or more on demand."""

from __future__ import annotations

import math
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.conftest import make_tenant

pytestmark = pytest.mark.fuzz

#: Operations that would end the run's own tenant or key (they are exercised by their own tests).
DESTRUCTIVE = {("DELETE", "/tenants/self"), ("DELETE", "/applications/{id}")}
CHECKS = [schemathesis.checks.not_a_server_error, response_schema_conformance, content_type_conformance]
#: Seconds a generated request may take: operations that wait for their job answer within their
#: documented wait (wallet domains: TESSERA_WALLET_WAIT_SECONDS, 10 s), so the client waits longer.
REQUEST_TIMEOUT = 30


def _operations(api, api_key: str):
    document = api.client().get("/openapi.json").json
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=api.base_url, headers={f"{api.prefix}-API-KEY": api_key})
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) not in DESTRUCTIVE:
            yield operation


def test_no_server_error_and_answers_fit_the_description(api):
    owner = make_tenant(api, name="fuzzed")
    failures, calls = [], []
    operations = list(_operations(api, owner.api_key))
    assert len(operations) > 50
    wanted = int(os.environ.get("TESSERA_FUZZ_REQUESTS", "0"))
    examples = max(8, math.ceil(wanted / len(operations)))
    for _ in range(5):  # more passes of fresh examples until the wanted number went out
        for operation in operations:

            @settings(
                max_examples=examples,
                deadline=None,
                derandomize=not wanted,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def run(case):
                calls.append(case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT).status_code)

            try:
                run()
            except Exception as exc:  # every operation's failure is collected and reported
                failures.append(f"{operation.label}: {str(exc)[:1500]}")
        if len(calls) >= wanted or failures:
            break
    assert not failures, "\n\n".join(failures)
    assert len(calls) >= 2 * len(operations)  # generated requests really went out
    print(f"schemathesis: {len(calls)} requests over {len(operations)} operations")
    assert len(calls) >= wanted
    assert any(status < 300 for status in calls) and any(400 <= status < 500 for status in calls)
