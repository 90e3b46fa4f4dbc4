"""The proxy's own failures (core document section 7, "Proxy errors").

When the service itself fails a proxy request (bad destination, bad expression, missing right,
transform failure) the body is ``{"proxy_error": {"errors", "title", "status", "detail"}}`` rather than
a bare problem object, so a caller can tell it from a destination's answer (which carries
``<prefix>-PROXY-DESTINATION-STATUS``). Messages never hold detokenized or decrypted values.
"""

from __future__ import annotations

from infra.errors import Problem

INVALID_REQUEST = "Invalid proxy request"
INVALID_EXPRESSION = "Invalid detokenization expression"
FORBIDDEN = "Forbidden"
TRANSFORM_FAILED = "Proxy transform failed"
TRANSFORM_INITIALIZING = "Proxy request transform is initializing"


class ProxyError(Problem):
    """A :class:`~infra.errors.Problem` rendered in the proxy's wrapped form.

    ``status`` is the HTTP status (400 invalid request or expression, 403 missing right, 408
    destination timeout, 503 transform initializing); ``errors`` maps a location (``body``,
    ``headers.Authorization``, ``destination``) to messages.
    """

    def __init__(self, status: int, detail: str, *, title: str, errors: dict[str, list[str]] | None = None):
        super().__init__(status, detail, title=title, errors=errors or {})

    def body(self, instance: str | None = None) -> dict:
        """``{"proxy_error": {"errors": {...}, "title": ..., "status": ..., "detail": ...}}``."""
        return {
            "proxy_error": {
                "errors": dict(self.errors or {}),
                "title": self.title,
                "status": self.status,
                "detail": self.detail,
            }
        }


def invalid_request(detail: str, *, where: str) -> ProxyError:
    """A 400 ``proxy_error`` for a request the proxy refuses (``where`` names the part)."""
    return ProxyError(400, detail, title=INVALID_REQUEST, errors={where: [detail]})


def invalid_expression(detail: str, *, where: str) -> ProxyError:
    """A 400 ``proxy_error`` for an expression that cannot be parsed, resolved or rendered."""
    return ProxyError(400, detail, title=INVALID_EXPRESSION, errors={where: [detail]})


def missing_right(permission: str, *, where: str) -> ProxyError:
    """A 403 ``proxy_error`` naming the permission the caller lacks."""
    detail = f"The API key lacks the permission {permission}."
    return ProxyError(403, detail, title=FORBIDDEN, errors={where: [detail]})
