"""Documents: multipart upload streamed and encrypted into S3 (moto), metadata, download, delete, the size
cap and the per-application rate limit (core document section 4: Documents; section 8)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import pytest
import urllib3
from sqlmodel import select

from domain.documents import service as documents
from storage import s3
from storage.db import session_scope
from storage.models import AuditLog, Job
from storage.models_documents import Document
from tests.documents.conftest import SMALL_DOCUMENT_MAX_BYTES, SMALL_DOCUMENTS_PER_MINUTE
from tests.factories.documents import multipart, upload
from tests.helpers import assert_problem, in_one_minute_window, wait_until

pytestmark = pytest.mark.api

MiB = 1024 * 1024


def _objects(tenant) -> list[str]:
    answer = s3.get_client().list_objects_v2(Bucket=s3.bucket(), Prefix=f"documents/{tenant.id}/")
    return [o["Key"] for o in answer.get("Contents", [])]


def _uploads_in_progress(tenant) -> list[str]:
    answer = s3.get_client().list_multipart_uploads(Bucket=s3.bucket(), Prefix=f"documents/{tenant.id}/")
    return [u["Key"] for u in answer.get("Uploads", [])]


def _rows(tenant) -> list[Document]:
    with session_scope() as session:
        return session.exec(select(Document).where(Document.tenant_id == tenant.id)).all()


def test_upload_read_download_delete(tenant):
    content = b"%PDF-1.7 hello document " + os.urandom(3000)
    created = upload(tenant.client, content, request={"metadata": {"kind": "passport", "customer": "c-1"}})
    assert created.status == 201, created
    doc = created.json
    assert set(doc) == {"id", "tenant_id", "metadata", "content_type", "created_by", "created_at"}
    assert doc["tenant_id"] == str(tenant.id)
    assert doc["metadata"] == {"kind": "passport", "customer": "c-1"}
    assert doc["content_type"] == "application/pdf"
    assert doc["created_by"] == str(tenant.application_id)

    assert tenant.client.get(f"/documents/{doc['id']}").json == doc
    data = tenant.client.get(f"/documents/{doc['id']}/data")
    assert data.status == 200, data
    assert data.raw == content
    assert data.headers["Content-Type"] == "application/pdf"
    assert data.headers["Content-Length"] == str(len(content))
    assert data.headers["X-Content-Type-Options"] == "nosniff"
    assert data.headers.get("TS-TRACE-ID")

    # stored encrypted: the object holds sealed chunks, not the content
    [key] = _objects(tenant)
    assert key == f"documents/{tenant.id}/{doc['id']}"
    stored = s3.get_client().get_object(Bucket=s3.bucket(), Key=key)["Body"].read()
    assert len(stored) == len(content) + documents.SEAL_OVERHEAD
    assert b"hello document" not in stored

    assert tenant.client.delete(f"/documents/{doc['id']}").status == 204
    assert_problem(tenant.client.get(f"/documents/{doc['id']}"), 404)
    assert_problem(tenant.client.get(f"/documents/{doc['id']}/data"), 404)
    assert_problem(tenant.client.delete(f"/documents/{doc['id']}"), 404)
    wait_until(lambda: _objects(tenant) == [] and _rows(tenant) == [], timeout=20)  # purged by the worker
    # the purge is a recorded job of its own, completed once the object and the row are gone
    wait_until(lambda: _purge_jobs(doc["id"]) == [("succeeded", {"purged": True})], timeout=20)

    with session_scope() as session:
        operations = session.exec(
            select(AuditLog.operation).where(AuditLog.entity_type == "document", AuditLog.entity_id == doc["id"])
        ).all()
    assert sorted(operations) == ["create", "delete", "read", "read"]


def test_defaults_without_request_part(tenant):
    body, ct = multipart(b"plain bytes", content_type="text/plain; charset=utf-8")
    answer = tenant.client.post("/documents", raw=body, content_type=ct)
    assert answer.status == 201, answer
    assert answer.json["metadata"] == {}
    assert answer.json["content_type"] == "text/plain; charset=utf-8"
    data = tenant.client.get(f"/documents/{answer.json['id']}/data")
    assert data.raw == b"plain bytes"
    assert data.headers["Content-Type"] == "text/plain; charset=utf-8"


def test_a_20_mb_document_round_trips_in_chunks_past_the_1_mib_body_cap(tenant):
    """The api's client_max_size is 1 MiB; the document route reads the multipart stream itself."""
    content = os.urandom(20 * 1000 * 1000)
    answer = upload(tenant.client, content, content_type="application/octet-stream")
    assert answer.status == 201, answer
    [row] = _rows(tenant)
    assert row.size == len(content)
    assert row.chunk_count == -(-len(content) // documents.CHUNK_SIZE) == 20
    assert row.status == "ready" and row.upload_id is None
    assert _uploads_in_progress(tenant) == []
    head = s3.get_client().head_object(Bucket=s3.bucket(), Key=row.object_key)
    assert head["ContentLength"] == len(content) + row.chunk_count * documents.SEAL_OVERHEAD
    assert head["ServerSideEncryption"] == "AES256"

    data = tenant.client.get(f"/documents/{answer.json['id']}/data")
    assert data.status == 200
    assert hashlib.sha256(data.raw).digest() == hashlib.sha256(content).digest()


def test_chunks_cannot_be_reordered(tenant):
    content = os.urandom(2 * documents.CHUNK_SIZE + 10)
    doc = upload(tenant.client, content).json
    [row] = _rows(tenant)
    client = s3.get_client()
    stored = client.get_object(Bucket=s3.bucket(), Key=row.object_key)["Body"].read()
    sealed = documents.CHUNK_SIZE + documents.SEAL_OVERHEAD
    swapped = stored[sealed : 2 * sealed] + stored[:sealed] + stored[2 * sealed :]
    client.put_object(Bucket=s3.bucket(), Key=row.object_key, Body=swapped)
    assert_problem(tenant.client.get(f"/documents/{doc['id']}/data"), 500)


@pytest.mark.parametrize(
    ("parts", "field"),
    [
        ({"document": None, "request": {"metadata": {}}}, "document"),
        ({"document": b"x", "request": "{not json"}, "request"),
        ({"document": b"x", "request": {"metadata": {"k": 1}}}, "request.metadata.k"),
        ({"document": b"x", "request": {"metadata": {}, "extra": True}}, "request.extra"),
        ({"document": b"x", "request": {"metadata": {"k" * 256: "v"}}}, "request.metadata." + "k" * 256 + ".[key]"),
        ({"document": b""}, "document"),
        ({"document": b"x", "extra": [("other", (None, "v"))]}, "other"),
        ({"document": b"x", "content_type": "not a type"}, "document"),
    ],
)
def test_invalid_uploads_leave_nothing_behind(tenant, parts, field):
    body, ct = multipart(
        parts["document"],
        request=parts.get("request"),
        extra=parts.get("extra"),
        content_type=parts.get("content_type", "application/pdf"),
    )
    answer = assert_problem(tenant.client.post("/documents", raw=body, content_type=ct), 400)
    assert field in answer["errors"], answer
    assert _rows(tenant) == []
    assert _objects(tenant) == [] and _uploads_in_progress(tenant) == []


def test_request_part_after_the_document_is_validated_too(tenant):
    fields = [("document", ("f.bin", os.urandom(6 * documents.CHUNK_SIZE), "application/pdf"))]
    fields.append(("request", (None, json.dumps({"metadata": {"k": ["no"]}}), "application/json")))
    body, ct = urllib3.encode_multipart_formdata(fields)
    answer = assert_problem(tenant.client.post("/documents", raw=body, content_type=ct), 400)
    assert "request.metadata.k" in answer["errors"]
    assert _rows(tenant) == []
    assert _objects(tenant) == [] and _uploads_in_progress(tenant) == []


def test_not_multipart_is_415(tenant):
    assert_problem(tenant.client.post("/documents", {"document": "x"}), 415)


def test_permissions_and_tenant_isolation(tenant, other_tenant, limited):
    doc = upload(tenant.client, b"secret").json
    path = f"/documents/{doc['id']}"
    for client in (other_tenant.client,):
        assert_problem(client.get(path), 404)
        assert_problem(client.get(f"{path}/data"), 404)
        assert_problem(client.delete(path), 404)
    assert_problem(tenant.client.get("/documents/not-a-uuid"), 404)

    reader = limited(tenant, ["document:read"])
    assert reader.get(path).status == 200
    assert_problem(reader.get(f"{path}/data"), 403)
    assert_problem(upload(reader, b"x"), 403)
    assert_problem(reader.delete(path), 403)
    revealer = limited(tenant, ["document:reveal"])
    assert revealer.get(f"{path}/data").raw == b"secret"
    assert_problem(revealer.get(path), 403)
    assert upload(limited(tenant, ["document:create"]), b"y").status == 201
    assert limited(tenant, ["document:delete"]).delete(path).status == 204


# ---- limits (a second api with a 2 MiB cap and 3 requests per minute) ----------------------------


def _small(small_limits_api, tenant):
    return small_limits_api.client(tenant.api_key)


def test_too_large_is_413_with_a_content_length(small_limits_api, tenant):
    client = _small(small_limits_api, tenant)
    answer = upload(client, os.urandom(SMALL_DOCUMENT_MAX_BYTES + 200 * 1024))
    body = assert_problem(answer, 413)
    assert str(SMALL_DOCUMENT_MAX_BYTES) in body["detail"]
    assert _rows(tenant) == []


def test_too_large_is_413_while_streaming(small_limits_api, tenant):
    """Chunked transfer (no Content-Length): the cap is met part-way through the stream."""
    body, ct = multipart(os.urandom(SMALL_DOCUMENT_MAX_BYTES + 1))

    def pieces():
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    http = urllib3.PoolManager(retries=False)
    answer = http.request(
        "POST",
        f"{small_limits_api.base_url}/documents",
        body=pieces(),
        chunked=True,
        headers={"Content-Type": ct, "TS-API-KEY": tenant.api_key},
    )
    assert answer.status == 413, answer.data
    assert str(SMALL_DOCUMENT_MAX_BYTES) in json.loads(answer.data)["detail"]
    assert _rows(tenant) == []
    assert _objects(tenant) == [] and _uploads_in_progress(tenant) == []
    # exactly the cap is fine
    assert upload(_small(small_limits_api, tenant), os.urandom(SMALL_DOCUMENT_MAX_BYTES)).status == 201


def test_the_documents_api_is_rate_limited_per_application(small_limits_api, tenant, limited):
    in_one_minute_window(5)
    client = _small(small_limits_api, tenant)
    doc = upload(client, b"one").json
    assert client.get(f"/documents/{doc['id']}").status == 200
    assert client.get(f"/documents/{doc['id']}/data").status == 200
    refused = client.get(f"/documents/{doc['id']}")
    limited_answer = assert_problem(refused, 429)
    assert 0 < int(refused.headers["Retry-After"]) <= 60
    assert_problem(upload(client, b"two"), 429)  # every Documents endpoint shares the budget
    assert "3 requests per minute" in limited_answer["detail"]
    # another application of the same tenant has its own budget
    other_app = small_limits_api.client(limited(tenant, ["document:read"]).api_key)
    assert other_app.get(f"/documents/{doc['id']}").status == 200
    assert SMALL_DOCUMENTS_PER_MINUTE == 3


def _purge_jobs(document_id: str) -> list[tuple[str, dict | None]]:
    with session_scope() as session:
        return [
            tuple(row)
            for row in session.exec(
                select(Job.status, Job.result).where(
                    Job.kind == documents.PURGE_TASK, Job.subject_type == "document", Job.subject_id == document_id
                )
            ).all()
        ]


def test_abandoned_uploads_and_deleted_documents_are_swept(tenant):
    doc = upload(tenant.client, b"to be swept").json
    stale_id = uuid.uuid4()
    with session_scope() as session:
        row = session.get(Document, uuid.UUID(doc["id"]))
        row.status = "deleted"  # deleted, but its purge message was lost
        session.add(row)
        stale = Document(
            id=stale_id,
            tenant_id=tenant.id,
            content_type="application/pdf",
            chunk_size=documents.CHUNK_SIZE,
            object_key=documents.object_key(tenant.id, stale_id),
            status="uploading",
        )
        stale.created_at = stale.created_at.replace(year=stale.created_at.year - 1)
        session.add(stale)
    upload_id = s3.get_client().create_multipart_upload(Bucket=s3.bucket(), Key=stale.object_key)["UploadId"]
    with session_scope() as session:
        session.get(Document, stale_id).upload_id = upload_id
    assert len(_objects(tenant)) == 1 and len(_uploads_in_progress(tenant)) == 1

    from tasks import documents as document_tasks

    document_tasks.sweep_documents.delay()
    wait_until(lambda: _rows(tenant) == [], timeout=20)
    assert _objects(tenant) == [] and _uploads_in_progress(tenant) == []
