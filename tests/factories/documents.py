"""Builders of document requests shared by the test folders: multipart bodies and uploads."""

from __future__ import annotations

import json

from urllib3 import encode_multipart_formdata


def multipart(document: bytes | None, *, content_type: str = "application/pdf", request=None, extra=None):
    """A multipart/form-data body with the parts ``document`` and ``request``; ``(body, content type)``."""
    fields = []
    if request is not None:
        fields.append(("request", (None, request if isinstance(request, str) else _json(request), "application/json")))
    if document is not None:
        fields.append(("document", ("file.bin", document, content_type)))
    fields += list(extra or [])
    return encode_multipart_formdata(fields)


def _json(value) -> str:
    return json.dumps(value)


def upload(client, document: bytes, **kw):
    """POST /documents with ``document``; the response."""
    body, ct = multipart(document, **kw)
    return client.post("/documents", raw=body, content_type=ct)
