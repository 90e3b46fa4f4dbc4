"""wallet-a domains and merchant sessions (spec 001 section 4; SANDBOX.md "Wallet session gateway").

Every provider call and every fetch of a domain's file runs in a worker (``tasks/wallets.py``); the
request records the work, waits up to ``TESSERA_WALLET_WAIT_SECONDS`` and answers with the outcome.

**Domains** (``wallet-a:manage``). A tenant's domains live per environment: ``sandbox`` for test
tenants, ``production`` for production tenants (a domain registered in one is unknown to the other).
Registering a domain records it ``pending`` and a job that fetches
``TESSERA_WALLET_A_DOMAIN_FILE_URL`` (``https://<domain>/.well-known/apple-developer-merchantid-domain-association``)
through the platform's outbound client (SSRF guard, no redirects, bounded time), then registers the
domain with the wallet provider under the tenant id as merchant id, and marks it ``verified``. A file
that cannot be fetched (any non-2xx answer, empty body, connection failure) answers 422 and the
domain is forgotten; a provider that cannot be reached answers 502 (contact support); work still
running after the wait leaves the domain ``pending`` in the answer (it becomes ``verified`` or
disappears). At most :data:`MAX_DOMAINS` per tenant and environment (400). Removing a domain forgets
it at once and tells the provider in a job (retried).

**Sessions** (``wallet-a:session``). Checked in this order, each a 422 distinguished by its detail:
``validation_url`` is not an allowed gateway; it targets the other environment than the tenant's
(the merchant is not enrolled there: the detail names both); the domain is not a verified domain of
the tenant; the certificate configuration for the targeted gateway is missing (production gateways
need the platform's merchant identity certificate, which this deployment does not hold); then the
gateway's own rejection (detail includes its message). 503 when the gateway cannot be reached or
does not answer within the wait. The session object is the gateway's answer, unchanged; it is kept
sealed only until the request reads it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Sequence

from sqlmodel import Session, col, select

from config.settings import get_settings
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra import http, jobs
from infra.errors import Problem, not_found, validation_problem
from providers.wallet_gateway import (
    PRODUCTION_GATEWAY_URL,
    gateway_environment,
    sandbox_gateway_url,
    wallet_gateway_for,
)
from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models import Job, Tenant
from storage.models_wallets import WalletDomain, WalletSession
from storage.states import JobStatus, WalletDomainStatus
from storage.types import utcnow

MAX_DOMAINS = 99
REGISTER_TASK = "wallets.register_domain"
REMOVE_TASK = "wallets.remove_domain"
SESSION_TASK = "wallets.merchant_session"
SESSION_PURPOSE = "wallet-session"
#: A session request row older than this was abandoned by its request (the process died meanwhile).
STALE_SESSION = dt.timedelta(minutes=10)
ENTITY = "wallet-a-domain"
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def environment_of(tenant_type: str) -> str:
    """``sandbox`` for test tenants, ``production`` otherwise (section 4, Hosts)."""
    return "sandbox" if tenant_type == "test" else "production"


def normalize_domain(value: str) -> str | None:
    """``value`` as a lower-case ASCII host name with at least two labels, else None."""
    text = value.strip().rstrip(".").lower()
    try:
        text = text.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    labels = text.split(".")
    if len(text) > 253 or len(labels) < 2 or not all(_LABEL.fullmatch(label) for label in labels):
        return None
    return text


def _domains_view(session: Session, tenant_id: uuid.UUID, environment: str) -> dict:
    rows = session.exec(
        select(WalletDomain)
        .where(WalletDomain.tenant_id == tenant_id, WalletDomain.environment == environment)
        .order_by(col(WalletDomain.created_at), WalletDomain.domain)
    ).all()
    return {"domains": [{"domain": row.domain, "status": row.status} for row in rows]}


def list_domains(session: Session, caller: Caller) -> dict:
    """``GET /wallet-a/domain-registration``: ``{domains: [{domain, status}]}``, oldest first."""
    return _domains_view(session, caller.tenant_id, environment_of(caller.tenant_type))


def _normalized(values: Sequence[str], field: str) -> list[str]:
    out, errors = [], {}
    for index, value in enumerate(values):
        domain = normalize_domain(value)
        if domain is None:
            errors[field if len(values) == 1 and field == "domain" else f"{field}[{index}]"] = [
                "must be a domain name (labels of letters, digits and hyphens)"
            ]
        elif domain not in out:
            out.append(domain)
    if errors:
        raise validation_problem(errors)
    return out


def _forget(session: Session, caller: Caller, row: WalletDomain) -> None:
    session.delete(row)
    jobs.record(
        session,
        kind=REMOVE_TASK,
        tenant_id=caller.tenant_id,
        subject_type="wallet_domain_removal",
        subject_id=row.domain,
        trace_id=caller.trace_id,
    )
    audit.record(session, caller, entity_type=ENTITY, entity_id=row.domain, operation="delete")


def register_domains(
    session: Session, caller: Caller, values: Sequence[str], *, replace: bool, field: str
) -> list[uuid.UUID]:
    """Record the registration of ``values`` (``POST``: add one; ``PUT`` with ``replace``: the set
    becomes exactly ``values``, the others are removed). Returns the ids of the jobs to wait for.
    400 for a malformed domain (keyed ``field`` or ``field[i]``) or more than :data:`MAX_DOMAINS`;
    422 Provider not configured for production tenants."""
    wallet_gateway_for(caller.tenant_type)  # a tenant without a reachable provider learns it first
    wanted = _normalized(values, field)
    environment = environment_of(caller.tenant_type)
    # one registration at a time per tenant: the limit and the set stay exact under concurrent requests
    session.exec(select(Tenant.id).where(Tenant.id == caller.tenant_id).with_for_update()).first()
    rows = {
        row.domain: row
        for row in session.exec(
            select(WalletDomain).where(
                WalletDomain.tenant_id == caller.tenant_id, WalletDomain.environment == environment
            )
        ).all()
    }
    if replace:
        for domain, row in list(rows.items()):
            if domain not in wanted:
                _forget(session, caller, row)
                del rows[domain]
    new = [domain for domain in wanted if domain not in rows]
    if len(rows) + len(new) > MAX_DOMAINS:
        raise validation_problem({field: [f"a tenant can register at most {MAX_DOMAINS} domains"]})
    job_ids = []
    for domain in new:
        row = WalletDomain(tenant_id=caller.tenant_id, environment=environment, domain=domain)
        session.add(row)
        job = jobs.record(
            session,
            kind=REGISTER_TASK,
            tenant_id=caller.tenant_id,
            subject_type="wallet_domain",
            subject_id=str(row.id),
            trace_id=caller.trace_id,
            max_attempts=1,
        )
        job_ids.append(job.id)
        audit.record(session, caller, entity_type=ENTITY, entity_id=domain, operation="create")
    return job_ids


def registration_outcome(session: Session, caller: Caller, job_ids: Sequence[uuid.UUID]) -> dict:
    """The answer after the wait: 422 naming each domain whose file was not available, 502 when the
    provider could not be reached, else ``{domains: [...]}`` (pending ones included)."""
    failures, unreachable = [], False
    for job in session.exec(select(Job).where(col(Job.id).in_(list(job_ids)))).all():
        if job.status == JobStatus.FAILED:
            failures.append((job.last_error or "").split(": ", 1)[-1])
        elif job.status == JobStatus.DEAD:
            unreachable = True
    if failures:
        raise Problem(422, " ".join(failures), title="Domain verification failed")
    if unreachable:
        raise Problem(502, "The wallet provider could not be reached to register the domain; contact support.")
    return list_domains(session, caller)


def deregister_domain(session: Session, caller: Caller, value: str) -> None:
    """``POST /wallet-a/domain-deregistration``: forget the domain (404 when not registered)."""
    domain = _normalized([value], "domain")[0]
    row = session.exec(
        select(WalletDomain).where(
            WalletDomain.tenant_id == caller.tenant_id,
            WalletDomain.environment == environment_of(caller.tenant_type),
            WalletDomain.domain == domain,
        )
    ).first()
    if row is None:
        raise not_found("domain")
    _forget(session, caller, row)


# ---- the worker side of domains ------------------------------------------------------------------


def _domain_row(job: Job) -> tuple[str, str] | None:
    with session_scope() as session:
        row = session.get(WalletDomain, uuid.UUID(job.subject_id))
        return None if row is None else (row.domain, row.environment)


def perform_registration(job: Job) -> bool:
    """Fetch the domain's association file, then register the domain with the provider. Returns
    False when the domain was removed meanwhile. Raises PermanentError ``domain_verification_failed``
    (422) when the file is not available, and the gateway's errors."""
    found = _domain_row(job)
    if found is None:
        return False
    domain, _environment = found
    settings = get_settings()
    url = settings.wallet_a_domain_file_url.replace("{domain}", domain)
    result = http.fetch(
        url,
        timeout_s=settings.webhook_timeout_seconds,
        allow_private=settings.allow_private_destinations,
        ca_certs=settings.wallet_a_domain_ca_certs,
        accept="*/*",
    )
    if result.outcome != "success" or not result.response_body.strip():
        reason = "it is empty" if result.outcome == "success" else (result.error or f"HTTP {result.status_code}")
        raise jobs.PermanentError(
            "domain_verification_failed",
            f"The domain verification file of {domain} is not available "
            f"(/.well-known/apple-developer-merchantid-domain-association: {reason}).",
        )
    gateway = wallet_gateway_for("test" if _environment == "sandbox" else "production", settings)
    gateway.register_domain(str(job.tenant_id), domain, idempotency_key=str(job.id))
    return True


def apply_registration(session: Session, job: Job, registered: bool) -> dict:
    """Mark the domain verified."""
    row = session.get(WalletDomain, uuid.UUID(job.subject_id))
    if registered and row is not None:
        row.status = WalletDomainStatus.VERIFIED
        session.add(row)
    return {}


def registration_failed(session: Session, job: Job) -> None:
    """Forget a domain that could not be registered."""
    row = session.get(WalletDomain, uuid.UUID(job.subject_id))
    if row is not None and row.status == WalletDomainStatus.PENDING:
        session.delete(row)


def perform_removal(job: Job) -> None:
    """Tell the provider that domain ``job.subject_id`` was removed, in the environment of the job's
    tenant (a tenant's type never changes, so it is the environment the domain was registered in)."""
    with session_scope() as session:
        tenant_type = session.exec(select(Tenant.type).where(Tenant.id == job.tenant_id)).one()
    if job.subject_id is None:
        raise ValueError(f"domain removal job {job.id} names no domain")
    gateway = wallet_gateway_for(tenant_type)
    gateway.remove_domain(str(job.tenant_id), job.subject_id, idempotency_key=str(job.id))


# ---- merchant sessions ---------------------------------------------------------------------------


def start_session(
    session: Session,
    caller: Caller,
    *,
    display_name: str,
    domain: str,
    validation_url: str | None,
    merchant_registration_id: str | None,
) -> tuple[uuid.UUID, uuid.UUID]:
    """``POST /wallet-a/session``: the checks of the module docstring, then the recorded request and
    its job; returns ``(session row id, job id)``."""
    environment = environment_of(caller.tenant_type)
    default = sandbox_gateway_url() if environment == "sandbox" else PRODUCTION_GATEWAY_URL
    url = validation_url or default
    targeted = gateway_environment(url)
    if targeted is None:
        raise Problem(422, "validation_url is not an allowed gateway of the wallet provider.", title="Session refused")
    if targeted != environment:
        raise Problem(
            422,
            f"The merchant is not enrolled in the {targeted} environment that validation_url "
            f"targets; this tenant works with the {environment} environment.",
            title="Session refused",
        )
    name = normalize_domain(domain)
    if (
        name is None
        or not session.exec(
            select(WalletDomain).where(
                WalletDomain.tenant_id == caller.tenant_id,
                WalletDomain.environment == environment,
                WalletDomain.domain == name,
                WalletDomain.status == WalletDomainStatus.VERIFIED,
            )
        ).first()
    ):
        raise Problem(
            422,
            f"The domain {domain[:253]} is not registered for this tenant in the {environment} "
            "environment; register it with POST /wallet-a/domain-registration.",
            title="Session refused",
        )
    if environment == "production":
        raise Problem(
            422,
            "The certificate configuration for the production gateway is missing: this deployment "
            "holds no merchant identity certificate.",
            title="Session refused",
        )
    # requests whose process died before reading their answer leave rows: cleared here, lazily
    stale = utcnow() - STALE_SESSION
    for old in session.exec(
        select(WalletSession).where(WalletSession.tenant_id == caller.tenant_id, WalletSession.created_at < stale)
    ).all():
        session.delete(old)
    row = WalletSession(
        tenant_id=caller.tenant_id,
        validation_url=url,
        display_name=display_name,
        domain=name,
        merchant_registration_id=merchant_registration_id,
    )
    session.add(row)
    job = jobs.record(
        session,
        kind=SESSION_TASK,
        tenant_id=caller.tenant_id,
        subject_type="wallet_session",
        subject_id=str(row.id),
        trace_id=caller.trace_id,
        max_attempts=1,
    )
    return row.id, job.id


def session_outcome(session: Session, caller: Caller, row_id: uuid.UUID, job_id: uuid.UUID) -> dict:
    """The session object once the job succeeded (the row is deleted: read once); 422 with the
    provider's rejection; 503 when the gateway was unreachable or slower than the wait."""
    row = session.get(WalletSession, row_id)
    job = session.get(Job, job_id)
    if row is not None:
        session.delete(row)
    if job is not None and job.status == JobStatus.SUCCEEDED and row is not None and row.session_ct is not None:
        audit.record(session, caller, entity_type="wallet-a-session", entity_id=row_id, operation="create")
        return json.loads(
            get_keyring().decrypt(session, caller.tenant_id, SESSION_PURPOSE, str(row_id), row.session_ct)
        )
    if job is not None and job.status == JobStatus.FAILED:
        message = (job.last_error or "").split(": ", 1)[-1]
        raise Problem(422, f"The wallet provider rejected the request: {message}", title="Session refused")
    raise Problem(503, "The wallet session service is unavailable; try again.")


def perform_session(job: Job) -> dict | None:
    """Ask the gateway for a merchant session (None when the request was abandoned)."""
    with session_scope() as session:
        row = session.get(WalletSession, uuid.UUID(job.subject_id))
        if row is None:
            return None
        url, body = (
            row.validation_url,
            {
                "merchantIdentifier": str(job.tenant_id),
                "displayName": row.display_name,
                "initiative": "web",
                "initiativeContext": row.domain,
            },
        )
        if row.merchant_registration_id:
            body["merchantRegistrationId"] = row.merchant_registration_id
    return wallet_gateway_for("test").payment_session(url, body)


def apply_session(session: Session, job: Job, answer: dict | None) -> dict:
    """Seal the session object on its request row (if the request still waits)."""
    row = session.get(WalletSession, uuid.UUID(job.subject_id))
    if answer is not None and row is not None:
        row.session_ct = get_keyring().encrypt(
            session, row.tenant_id, SESSION_PURPOSE, str(row.id), json.dumps(answer).encode()
        )
        session.add(row)
    return {}
