"""The invitation a person receives: a mail with a plain-text part (the link alone on its line, never
quoted-printable) and an HTML part, linking to a page that shows the tenant and the role and accepts
with a real form, driven in a real headless Chromium; without an SMTP server the log says where the
mail file was written."""

from __future__ import annotations

import logging
import os
import re
from urllib.parse import urlencode

import pytest
import urllib3
from sqlmodel import select

from config.settings import get_settings
from storage.db import session_scope
from storage.models import TenantMember, User
from tests.browser import CHROMIUM, SKIP_REASON, Browser
from tests.helpers import wait_until

pytestmark = pytest.mark.api


def _address() -> str:
    return f"page-{os.urandom(4).hex()}@example.com"


def _invite(tenant, email: str, role: str = "READ_ONLY") -> dict:
    answer = tenant.client.post("/tenants/self/invitations", {"email": email, "role": role})
    assert answer.status == 201, answer
    return answer.json


def test_the_mail_has_a_plain_text_part_with_the_link_alone_on_a_line_and_an_html_part(api, tenant, mailbox):
    email = _address()
    _invite(tenant, email)
    [mail] = mailbox.wait_for(email)
    message = mail.message
    assert message.get_content_type() == "multipart/alternative"
    plain, rich = message.iter_parts()
    assert plain.get_content_type() == "text/plain" and rich.get_content_type() == "text/html"
    for part in (plain, rich):
        assert part["Content-Transfer-Encoding"] in ("7bit", "8bit"), part["Content-Transfer-Encoding"]
    # As sent (not decoded): the link whole on a line of its own, no quoted-printable escapes.
    assert mail.link in plain.get_payload().splitlines() and "=3D" not in plain.get_payload()
    assert mail.link in rich.get_payload().replace("&amp;", "&")
    assert max(len(line) for line in message.as_string().splitlines()) <= 998  # RFC 5322 line limit
    assert mail.link in mail.text.splitlines()
    assert f'href="{mail.link}"' in mail.html.replace("&amp;", "&")
    assert "READ_ONLY" in mail.html and "acme" in mail.html


def test_without_smtp_the_log_says_where_the_mail_file_was_written(api, tenant, caplog):
    caplog.set_level(logging.INFO, logger="tessera.tasks.mail")  # the mail task says where it wrote
    _invite(tenant, _address())

    def written():
        return [r for r in caplog.records if r.getMessage().startswith("invitation mail written to ")]

    [record] = wait_until(written, timeout=30)
    path = record.getMessage().removeprefix("invitation mail written to ")
    assert os.path.isfile(path) and path.startswith(str(get_settings().data_dir / "mail"))


def test_an_unknown_link_answers_a_page_that_says_so(api):
    page = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}  # what a browser sends
    answer = urllib3.request("GET", api.base_url + "/invitations/accept?token=inv_unknown", headers=page, timeout=10)
    assert answer.status == 404
    assert answer.headers["Content-Type"].startswith("text/html")
    assert "not valid" in answer.data.decode()
    assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]
    posted = urllib3.request(
        "POST",
        api.base_url + "/invitations/accept",
        body=urlencode({"token": "inv_unknown"}),
        timeout=10,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert posted.status == 404 and "not valid" in posted.data.decode()
    # the same link asked for JSON (an API client) answers the problem
    api_client = urllib3.request("GET", api.base_url + "/invitations/accept?token=inv_unknown", timeout=10)
    assert api_client.status == 404 and api_client.headers["Content-Type"].startswith("application/problem+json")


@pytest.mark.timeout(180)
@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
def test_a_person_accepts_from_the_page_in_a_browser(api, tenant, mailbox, tmp_path):
    email = _address()
    _invite(tenant, email, role="READ_ONLY")
    [mail] = mailbox.wait_for(email)

    with Browser(tmp_path) as browser:
        browser.open(mail.link)
        shown = browser.text()
        assert "acme" in shown and "READ_ONLY" in shown and email in shown, shown
        assert browser.evaluate("document.querySelector('form').method") == "post"
        assert browser.evaluate("new URL(document.querySelector('form').action).pathname") == "/invitations/accept"
        browser.type_into("#first_name", "Ada")
        browser.type_into("#last_name", "Lovelace")
        browser.click_and_wait("#accept")
        done = browser.text()
        assert re.search(rf"{re.escape(email)} is now a member with the role READ_ONLY", done), done

        browser.open(mail.link)  # the link worked once
        assert "already accepted" in browser.text()

    with session_scope() as session:
        user = session.exec(select(User).where(User.email == email)).one()
        member = session.exec(
            select(TenantMember).where(TenantMember.tenant_id == tenant.id, TenantMember.user_id == user.id)
        ).one()
    assert member.role == "READ_ONLY"
    assert (user.first_name, user.last_name) == ("Ada", "Lovelace")
