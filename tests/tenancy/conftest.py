"""Fixtures of the tenancy tests: a real SMTP server on loopback (aiosmtpd) that the platform's worker
sends invitation mails to, and the helpers that read what it received.

The worker reads ``TESSERA_SMTP_URL`` and ``TESSERA_PUBLIC_BASE_URL`` from the process settings when a
mail task runs, so :func:`mailbox` points them at the SMTP server and at the test api for the length
of one test and puts them back afterwards (other tests expect the mail file sink).
"""

from __future__ import annotations

import email
import email.policy
import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

import pytest
from aiosmtpd.controller import Controller

from tests.conftest import free_port

LINK = re.compile(r"https?://\S+/invitations/accept\?token=[A-Za-z0-9_-]+")


@dataclass
class Mail:
    """One message the SMTP sink accepted."""

    mail_from: str
    rcpt_tos: list[str]
    message: email.message.EmailMessage

    @property
    def to(self) -> str:
        return str(self.message["To"])

    @property
    def text(self) -> str:
        """The plain-text part."""
        return self.message.get_body(("plain",)).get_content()

    @property
    def html(self) -> str:
        """The HTML part."""
        return self.message.get_body(("html",)).get_content()

    @property
    def link(self) -> str:
        found = LINK.findall(self.text)
        assert len(found) == 1, self.text
        return found[0]

    @property
    def token(self) -> str:
        return parse_qs(urlsplit(self.link).query)["token"][0]


@dataclass
class _Handler:
    messages: list[Mail] = field(default_factory=list)
    #: address -> how many more DATA commands to refuse with a transient 451
    refuse: dict[str, int] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def handle_DATA(self, server, session, envelope):
        with self.lock:
            for address in envelope.rcpt_tos:
                if self.refuse.get(address, 0) > 0:
                    self.refuse[address] -= 1
                    self.refused.append(address)
                    return "451 4.3.0 Try again later"
            message = email.message_from_bytes(envelope.content, policy=email.policy.default)
            self.messages.append(Mail(envelope.mail_from, list(envelope.rcpt_tos), message))
        return "250 Message accepted"


class SmtpSink:
    """A real SMTP server (aiosmtpd ``Controller``) on loopback that keeps every message."""

    def __init__(self, port: int):
        self.port = port
        self.handler = _Handler()
        self._controller = Controller(self.handler, hostname="127.0.0.1", port=port)

    def start(self) -> SmtpSink:
        self._controller.start()
        return self

    def stop(self) -> None:
        self._controller.stop()


@dataclass
class Mailbox:
    """The sink as one test sees it."""

    sink: SmtpSink

    def mails_to(self, address: str) -> list[Mail]:
        with self.sink.handler.lock:
            return [m for m in self.sink.handler.messages if address in m.rcpt_tos]

    def wait_for(self, address: str, count: int = 1, timeout: float = 20.0) -> list[Mail]:
        """Wait until ``count`` mails to ``address`` arrived; return them (oldest first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mails = self.mails_to(address)
            if len(mails) >= count:
                return mails
            time.sleep(0.05)
        raise AssertionError(f"{count} mail(s) to {address} not received within {timeout} s: {self.mails_to(address)}")

    def refuse(self, address: str, times: int) -> None:
        """Answer the next ``times`` messages to ``address`` with a transient 451."""
        with self.sink.handler.lock:
            self.sink.handler.refuse[address] = times

    def refused(self, address: str) -> int:
        with self.sink.handler.lock:
            return self.sink.handler.refused.count(address)


@pytest.fixture(scope="session")
def smtp_sink():
    """aiosmtpd's ``Controller`` on a free loopback port, collecting every message."""
    sink = SmtpSink(free_port()).start()
    yield sink
    sink.stop()


@pytest.fixture
def mailbox(api, smtp_sink, monkeypatch):
    """The platform's mail goes to ``smtp_sink`` and invitation links point at the test api (this test only)."""
    from config.settings import reload_settings

    monkeypatch.setenv("TESSERA_SMTP_URL", f"smtp://127.0.0.1:{smtp_sink.port}")
    monkeypatch.setenv("TESSERA_PUBLIC_BASE_URL", api.base_url)
    reload_settings()
    yield Mailbox(smtp_sink)
    monkeypatch.undo()
    reload_settings()
