"""wallet-a domains and merchant sessions over real HTTP: the association file fetched over HTTPS
from a loopback server, the sandbox session gateway reached by a real worker."""

from __future__ import annotations

import os

import pytest
import urllib3
from sqlmodel import func, select

from storage.db import session_scope
from storage.models_wallets import WalletSession
from tests.conftest import make_tenant
from tests.wallets.conftest import DomainFiles

SANDBOX_GATEWAY = os.environ["TESSERA_SANDBOX_URL"] + "/wallet-gateway/sandbox/paymentservices/paymentSession"


def unique(prefix: str = "shop") -> str:
    return f"{prefix}-{os.urandom(4).hex()}.example.com"


@pytest.fixture
def served(domain_files: DomainFiles):
    """``served()``: a new domain whose association file the loopback server answers."""

    def make(prefix: str = "shop") -> str:
        domain = unique(prefix)
        domain_files.served[domain] = b"7B227073704964223A2246...association"
        return domain

    return make


def test_a_domain_with_its_file_is_verified_and_listed(tenant, served, domain_files, limited):
    domain = served()
    answer = tenant.client.post("/wallet-a/domain-registration", {"domain": domain.upper() + "."})
    assert answer.status == 200, answer
    assert answer.json == {"domains": [{"domain": domain, "status": "verified"}]}
    assert domain in domain_files.requests
    assert tenant.client.get("/wallet-a/domain-registration").json == answer.json
    again = tenant.client.post("/wallet-a/domain-registration", {"domain": domain})
    assert again.json == answer.json
    assert limited(tenant, ["wallet-a:session"]).get("/wallet-a/domain-registration").status == 403


def test_a_domain_without_its_file_is_refused_and_not_kept(tenant, domain_files):
    domain = unique("nofile")
    answer = tenant.client.post("/wallet-a/domain-registration", {"domain": domain})
    assert answer.status == 422, answer
    assert domain in answer.json["detail"] and "not available" in answer.json["detail"]
    assert tenant.client.get("/wallet-a/domain-registration").json == {"domains": []}


def test_malformed_domains_are_refused(tenant):
    answer = tenant.client.post("/wallet-a/domain-registration", {"domain": "not a domain"})
    assert answer.status == 400 and "domain" in answer.json["errors"]
    answer = tenant.client.put("/wallet-a/domain-registration", {"domains": ["ok.example.com", "-bad-.com"]})
    assert answer.status == 400 and "domains[1]" in answer.json["errors"]


def test_put_replaces_the_set_and_deregistration_forgets(tenant, served):
    first, second, third = served(), served(), served()
    assert tenant.client.put("/wallet-a/domain-registration", {"domains": [first, second]}).status == 200
    answer = tenant.client.put("/wallet-a/domain-registration", {"domains": [second, third]})
    assert answer.status == 200, answer
    assert sorted(d["domain"] for d in answer.json["domains"]) == sorted([second, third])
    assert tenant.client.post("/wallet-a/domain-deregistration", {"domain": second}).status == 204
    assert tenant.client.post("/wallet-a/domain-deregistration", {"domain": second}).status == 404
    assert [d["domain"] for d in tenant.client.get("/wallet-a/domain-registration").json["domains"]] == [third]


def test_at_most_99_domains(tenant):
    too_many = [f"d{n}.example.com" for n in range(100)]
    answer = tenant.client.put("/wallet-a/domain-registration", {"domains": too_many})
    assert answer.status == 400, answer
    assert tenant.client.get("/wallet-a/domain-registration").json == {"domains": []}


def test_domains_of_a_production_tenant_need_a_configured_provider(api):
    production = make_tenant(api, type="production", name="live")
    answer = production.client.post("/wallet-a/domain-registration", {"domain": unique()})
    assert answer.status == 422 and answer.json["title"] == "Provider not configured"


# ---- sessions ------------------------------------------------------------------------------------


@pytest.fixture
def registered(tenant, served) -> str:
    domain = served()
    assert tenant.client.post("/wallet-a/domain-registration", {"domain": domain}).status == 200
    return domain


def test_a_session_for_a_registered_domain(tenant, registered, limited):
    client = limited(tenant, ["wallet-a:session"])
    answer = client.post("/wallet-a/session", {"display_name": "Tessera Shop", "domain": registered})
    assert answer.status == 200, answer
    session = answer.json
    assert session["merchantIdentifier"] == str(tenant.id) and session["domainName"] == registered
    assert session["displayName"] == "Tessera Shop" and session["merchantSessionIdentifier"]
    explicit = client.post(
        "/wallet-a/session", {"display_name": "Tessera Shop", "domain": registered, "validation_url": SANDBOX_GATEWAY}
    )
    assert explicit.status == 200
    with session_scope() as db:
        left = db.exec(select(func.count()).select_from(WalletSession).where(WalletSession.tenant_id == tenant.id))
        assert left.one() == 0  # read once
    assert (
        limited(tenant, ["wallet-a:manage"])
        .post("/wallet-a/session", {"display_name": "x", "domain": registered})
        .status
        == 403
    )


def test_session_refusals_are_distinguished_by_detail(tenant, registered):
    post = tenant.client.post
    unknown = post("/wallet-a/session", {"display_name": "Shop", "domain": unique()})
    assert unknown.status == 422 and "not registered" in unknown.json["detail"]
    not_allowed = post(
        "/wallet-a/session",
        {"display_name": "Shop", "domain": registered, "validation_url": "https://evil.example.com/paymentSession"},
    )
    assert not_allowed.status == 422 and "not an allowed gateway" in not_allowed.json["detail"]
    other_env = post(
        "/wallet-a/session",
        {
            "display_name": "Shop",
            "domain": registered,
            "validation_url": "https://apple-pay-gateway.apple.com/paymentservices/paymentSession",
        },
    )
    assert other_env.status == 422
    assert "production" in other_env.json["detail"] and "sandbox" in other_env.json["detail"]
    too_long = post("/wallet-a/session", {"display_name": "x" * 65, "domain": registered})
    assert too_long.status == 400 and "display_name" in too_long.json["errors"]
    unicode_ok = post("/wallet-a/session", {"display_name": "é" * 64, "domain": registered})
    assert unicode_ok.status == 200, unicode_ok


def test_the_gateway_rejection_and_unavailability(tenant, registered):
    down = tenant.client.post("/wallet-a/session", {"display_name": "SANDBOX-UNAVAILABLE", "domain": registered})
    assert down.status == 503, down
    # the provider forgets the domain while the platform still lists it: the provider's own rejection
    urllib3.request(
        "POST",
        os.environ["TESSERA_SANDBOX_URL"] + "/wallet-gateway/sandbox/domains/remove",
        json={"merchant_id": str(tenant.id), "domain": registered},
    )
    refused = tenant.client.post("/wallet-a/session", {"display_name": "Shop", "domain": registered})
    assert refused.status == 422, refused
    assert refused.json["detail"].startswith("The wallet provider rejected the request: ")
    assert f"not registered for domain={registered}" in refused.json["detail"]


def test_concurrent_registrations_of_one_tenant_all_land(tenant, served):
    from concurrent.futures import ThreadPoolExecutor

    names = [served() for _ in range(4)]
    twice = served()
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(
            pool.map(
                lambda d: tenant.client.post("/wallet-a/domain-registration", {"domain": d}), [*names, twice, twice]
            )
        )
    assert [a.status for a in answers] == [200] * 6, answers
    listed = tenant.client.get("/wallet-a/domain-registration").json["domains"]
    assert sorted(d["domain"] for d in listed) == sorted([*names, twice])


def test_abandoned_session_requests_are_cleared(tenant, registered):
    import datetime as dt

    from storage.types import utcnow

    with session_scope() as db:
        db.add(
            WalletSession(
                tenant_id=tenant.id,
                validation_url=SANDBOX_GATEWAY,
                display_name="Shop",
                domain=registered,
                session_ct=b"sealed",
                created_at=utcnow() - dt.timedelta(hours=1),
            )
        )
    assert tenant.client.post("/wallet-a/session", {"display_name": "Shop", "domain": registered}).status == 200
    with session_scope() as db:
        left = db.exec(select(func.count()).select_from(WalletSession).where(WalletSession.tenant_id == tenant.id))
        assert left.one() == 0
