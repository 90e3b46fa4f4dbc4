"""The public shapes of the proxy package (core document section 2, Proxy)."""

from __future__ import annotations

from typing import Any

from storage.models_proxy import Proxy


def proxy_view(proxy: Proxy, configuration: dict[str, str], *, key: str | None = None) -> dict:
    """The proxy object: ``id, tenant_id, name, destination_url, request_transforms,
    response_transforms, configuration, require_auth, application ({id} or null), created_by,
    created_at, modified_by, modified_at``, plus ``key`` when just created; ``configuration`` is the
    proxy's configuration opened (:func:`domain.proxy.service.configuration_of`)."""
    view: dict[str, Any] = {
        "id": proxy.id,
        "tenant_id": proxy.tenant_id,
        "name": proxy.name,
        "destination_url": proxy.destination_url,
        "request_transforms": list(proxy.request_transforms or []),
        "response_transforms": list(proxy.response_transforms or []),
        "configuration": configuration,
        "require_auth": proxy.require_auth,
        "application": {"id": proxy.application_id} if proxy.application_id else None,
        "created_by": proxy.created_by,
        "created_at": proxy.created_at,
        "modified_by": proxy.modified_by,
        "modified_at": proxy.modified_at,
    }
    if key is not None:
        view["key"] = key
    return view
