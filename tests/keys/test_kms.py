"""AWS KMS for real, through boto3 against moto's KMS server over HTTP (the test run's S3 server): the
test database's keys moved under a KMS key by ``rewrap`` (the master key still accepted meanwhile),
a tenant's data key rotated under KMS, a KMS outage answering 503 with nothing changed, and the way
back to the master key."""

from __future__ import annotations

import socket

import boto3
import pytest

from domain.keys import service
from storage.crypto import get_keyring
from storage.db import session_scope
from tests.conftest import free_port
from tests.helpers import wait_until


@pytest.fixture
def kms_key(s3_server, use_keys, rewrap):
    """A KMS key on moto's server; the platform moved under it, and back to the master key after."""
    client = boto3.client("kms", region_name="us-east-1", endpoint_url=s3_server)
    key_id = client.create_key(Description="tessera rotation test")["KeyMetadata"]["KeyId"]
    use_keys(TESSERA_KMS_KEY_ID=key_id, TESSERA_KMS_ENDPOINT_URL=s3_server)
    yield key_id, s3_server
    use_keys(TESSERA_KMS_KEY_ID=None, TESSERA_KMS_KEY_ID_PREVIOUS=key_id, TESSERA_KMS_ENDPOINT_URL=s3_server)
    rewrap()
    use_keys(TESSERA_KMS_KEY_ID_PREVIOUS=None, TESSERA_KMS_ENDPOINT_URL=None)


def _dead_port() -> str:
    port = free_port()
    with socket.socket() as probe:  # nothing listens there
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    return f"http://127.0.0.1:{port}"


def test_kms_rewrap_rotation_and_outage(tenant, kms_key, use_keys, rewrap):
    key_id, endpoint = kms_key
    c = tenant.client
    token = c.post("/tokens", {"type": "token", "data": {"v": 1}}).json["id"]  # master-wrapped keys serve
    report = rewrap()
    assert report["wrapping"] == "kms" and report["wrapped_by"] == f"kms:{key_id}"

    with session_scope() as session:
        service.start_rotation(session, tenant.id)  # the new version is wrapped by KMS

    def rotated():
        with session_scope() as session:
            return service.tenant_status(session, tenant.id)["rotation"]["status"] == "completed"

    wait_until(rotated, timeout=90, interval=0.2)
    get_keyring().forget(tenant.id)
    assert c.get(f"/tokens/{token}").json["data"] == {"v": 1}

    # KMS away: reads that need an unwrap answer 503 and change nothing
    use_keys(TESSERA_KMS_ENDPOINT_URL=_dead_port())
    answer = c.get(f"/tokens/{token}")
    assert answer.status == 503, answer
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert "key service" in answer.json["detail"]
    use_keys(TESSERA_KMS_ENDPOINT_URL=endpoint)
    assert c.get(f"/tokens/{token}").json["data"] == {"v": 1}
