"""Pre-signed URLs signed for ``TESSERA_S3_PUBLIC_ENDPOINT_URL``: the address clients outside the
platform's network use (``docker-compose.yml``: containers call ``http://s3:9000``, clients
``http://localhost:9000``). Here the platform talks to the S3 server as ``127.0.0.1`` and signs for
``localhost``: a client uploads through the URL, and the platform reads the object back."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

import pytest
import urllib3

from config.settings import reload_settings
from storage import s3


@pytest.fixture
def public_endpoint(s3_server, monkeypatch):
    public = s3_server.replace("127.0.0.1", "localhost")
    monkeypatch.setenv("TESSERA_S3_PUBLIC_ENDPOINT_URL", public)
    reload_settings()
    s3.reset_client()
    yield public
    monkeypatch.undo()
    reload_settings()
    s3.reset_client()


def test_presigned_urls_are_signed_for_the_public_endpoint(s3_server, public_endpoint):
    key = f"public/{uuid.uuid4()}.csv"
    put_url = s3.presigned_url("PUT", key, expires_in=300)
    assert urlsplit(put_url).netloc == urlsplit(public_endpoint).netloc
    answer = urllib3.request("PUT", put_url, body=b"token\nabc\n", headers={"Content-Type": "text/csv"}, timeout=30)
    assert answer.status == 200, answer.data  # the signature holds for the host the client used
    stored = s3.get_client().get_object(Bucket=s3.bucket(), Key=key)["Body"].read()
    assert stored == b"token\nabc\n"
    get_url = s3.presigned_url("GET", key, expires_in=300)
    assert urlsplit(get_url).netloc == urlsplit(public_endpoint).netloc
    assert urllib3.request("GET", get_url, timeout=30).data == stored
    # The internal client still talks to the endpoint the platform uses.
    assert s3.get_client().meta.endpoint_url == s3_server


def test_without_a_public_endpoint_urls_use_the_platform_endpoint(s3_server):
    s3.reset_client()
    url = s3.presigned_url("GET", "any/key", expires_in=60)
    assert urlsplit(url).netloc == urlsplit(s3_server).netloc
