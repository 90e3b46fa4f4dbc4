"""The problems answered for network tokens, built from a job's outcome (its status and the ``code``
of its result: the card network's own error code, or this platform's ``provider_not_configured`` /
``tenant_removed``) so a waiting request turns the outcome into its answer in one step.

Spec, core document section 4 "Network tokens" (422 ``card_not_eligible`` / ``network_not_supported``,
422 "Provider not configured", 502 when the network could not be reached).
"""

from __future__ import annotations

from infra.errors import Problem
from providers import ProviderNotConfigured
from providers.card_network import PROVIDER_NAME
from storage.states import JobStatus


class BrokenJob(RuntimeError):
    """A network token job row lacks what every such job is recorded with (its tenant, its subject) or
    vanished while its request waited: a broken invariant, never a client's error (500)."""


#: The 422 problems of provisioning refusals: network code -> (title, detail).
_REFUSALS = {
    "card_not_eligible": (
        "Card not eligible",
        "The card network declined the card: it is not eligible for a network token.",
    ),
    "network_not_supported": ("Network not supported", "The card's network does not issue network tokens."),
}


def _unreachable(consequence: str) -> Problem:
    """The 502 ``network_unavailable``: a dead letter, or a failure the network gave no code for."""
    return Problem(
        502,
        f"The card network could not be reached; {consequence}.",
        title="Card network unavailable",
        extra={"code": "network_unavailable"},
    )


def provisioning_problem(status: str | None, result: dict | None) -> Problem:
    """The problem for a provisioning job that failed for good (``status`` ``failed``) or became a dead
    letter (``dead``): 502 ``network_unavailable`` for a dead letter or a failure without a code, 422
    for a refusal (``card_not_eligible``, ``network_not_supported``, any other code as "Provisioning
    failed"), the 422 "Provider not configured" for ``provider_not_configured``."""
    code = (result or {}).get("code")
    if status == JobStatus.DEAD or code is None:
        return _unreachable("no network token was provisioned")
    if code in _REFUSALS:
        title, detail = _REFUSALS[code]
        return Problem(422, detail, title=title, extra={"code": code})
    if code == "provider_not_configured":
        return ProviderNotConfigured(PROVIDER_NAME)
    return Problem(
        422,
        f"The card network refused to provision a network token ({code}).",
        title="Provisioning failed",
        extra={"code": code},
    )


def removed_problem(code: str | None) -> Problem:
    """The 404 of a network token removed because its provisioning failed with ``code``."""
    code = code or "network_unavailable"
    return Problem(404, f"The network token was removed: its provisioning failed ({code}).", extra={"code": code})


def change_problem(status: str | None, result: dict | None) -> Problem:
    """The problem for a suspend/resume job that failed: 409 ``token_deleted`` (the network deleted it),
    502 ``network_unavailable`` (a dead letter or no code), else 502 naming the network's code."""
    code = (result or {}).get("code")
    if code == "token_deleted":
        return Problem(
            409,
            "The card network has deleted this network token; delete it here too.",
            title="Conflict",
            extra={"code": code},
        )
    if status == JobStatus.DEAD or code is None:
        return _unreachable("nothing was changed")
    return Problem(
        502,
        f"The card network refused the change ({code}); nothing was changed.",
        title="Card network error",
        extra={"code": code},
    )


def not_usable(token_id: object, status: str) -> Problem:
    """The 422 of a network token that cannot be used for transactions (``inactive``, ``suspended``)."""
    return Problem(
        422, f"The network token {token_id} is {status}; it cannot be used.", title="Network token not usable"
    )


def timed_out(title: str) -> Problem:
    """The 504 of a card network call that did not settle within the request's wait."""
    return Problem(
        504, "The card network did not answer in time; retry.", title=title, extra={"code": "network_timeout"}
    )
