"""Tests for infra.mail against a real aiosmtpd server and the file fallback."""

from __future__ import annotations

import email
import email.policy
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

from infra.mail import MailError, send_mail

pytestmark = pytest.mark.unit

SENDER = "Tessera <noreply@tessera.example>"


class CollectingHandler:
    """Collects accepted messages; scripted refusals by recipient local part."""

    def __init__(self) -> None:
        self.messages: list[dict[str, object]] = []
        self.lock = threading.Lock()

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.startswith("nobody@"):
            return "550 5.1.1 no such user"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        if any(r.startswith("later@") for r in envelope.rcpt_tos):
            return "451 4.3.0 try again later"
        with self.lock:
            self.messages.append(
                {
                    "mail_from": envelope.mail_from,
                    "rcpt_tos": list(envelope.rcpt_tos),
                    "content": envelope.content,
                    "login": getattr(session, "auth_data", None),
                }
            )
        return "250 Message accepted"


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _authenticator(server, session, envelope, mechanism, auth_data):
    ok = isinstance(auth_data, LoginPassword) and (auth_data.login, auth_data.password) == (
        b"mailer",
        b"p@ss:word",
    )
    return AuthResult(success=ok, handled=False)


@pytest.fixture
def smtp_server() -> Iterator[tuple[Controller, CollectingHandler]]:
    handler = CollectingHandler()
    controller = Controller(
        handler,
        hostname="127.0.0.1",
        port=_free_port(),
        authenticator=_authenticator,
        auth_require_tls=False,
    )
    controller.start()
    try:
        yield controller, handler
    finally:
        controller.stop()


def _url(controller: Controller, userinfo: str = "", query: str = "") -> str:
    return f"smtp://{userinfo}{controller.hostname}:{controller.port}{query}"


def test_send_over_smtp(smtp_server: tuple[Controller, CollectingHandler], tmp_path: Path) -> None:
    controller, handler = smtp_server
    send_mail(
        to="alice@example.com",
        subject="Verify your email — Tessera",
        text="Hello Alice,\nclick here.\n",
        smtp_url=_url(controller),
        data_dir=tmp_path,
        sender=SENDER,
    )
    [msg] = handler.messages
    assert msg["rcpt_tos"] == ["alice@example.com"]
    assert msg["mail_from"] == "noreply@tessera.example"
    parsed = email.message_from_bytes(msg["content"], policy=email.policy.default)  # type: ignore[arg-type]
    assert parsed["Subject"] == "Verify your email — Tessera"
    assert parsed["To"] == "alice@example.com"
    assert parsed["From"] == SENDER
    assert parsed["Message-ID"].endswith("@tessera.example>")
    assert parsed["Date"]
    assert parsed.get_content().replace("\r\n", "\n") == "Hello Alice,\nclick here.\n"
    assert not (tmp_path / "mail").exists()


def test_send_with_login(smtp_server: tuple[Controller, CollectingHandler], tmp_path: Path) -> None:
    controller, handler = smtp_server
    send_mail(
        to="bob@example.com",
        subject="hi",
        text="body",
        smtp_url=_url(controller, "mailer:p%40ss%3Aword@"),
        data_dir=tmp_path,
        sender=SENDER,
    )
    assert [m["rcpt_tos"] for m in handler.messages] == [["bob@example.com"]]


def test_bad_login_is_permanent(smtp_server: tuple[Controller, CollectingHandler], tmp_path: Path) -> None:
    controller, handler = smtp_server
    with pytest.raises(MailError) as info:
        send_mail(
            to="bob@example.com",
            subject="hi",
            text="body",
            smtp_url=_url(controller, "mailer:wrong-password@"),
            data_dir=tmp_path,
            sender=SENDER,
        )
    assert info.value.transient is False
    assert info.value.smtp_code == 535
    assert "wrong-password" not in str(info.value)
    assert handler.messages == []


def test_5xx_recipient_refused_is_permanent(smtp_server: tuple[Controller, CollectingHandler], tmp_path: Path) -> None:
    controller, _handler = smtp_server
    with pytest.raises(MailError) as info:
        send_mail(
            to="nobody@example.com",
            subject="s",
            text="t",
            smtp_url=_url(controller),
            data_dir=tmp_path,
            sender=SENDER,
        )
    assert info.value.transient is False
    assert info.value.smtp_code == 550


def test_4xx_is_transient(smtp_server: tuple[Controller, CollectingHandler], tmp_path: Path) -> None:
    controller, _handler = smtp_server
    with pytest.raises(MailError) as info:
        send_mail(
            to="later@example.com",
            subject="s",
            text="t",
            smtp_url=_url(controller),
            data_dir=tmp_path,
            sender=SENDER,
        )
    assert info.value.transient is True
    assert info.value.smtp_code == 451


def test_starttls_not_offered_is_permanent(smtp_server: tuple[Controller, CollectingHandler], tmp_path: Path) -> None:
    controller, handler = smtp_server
    with pytest.raises(MailError) as info:
        send_mail(
            to="alice@example.com",
            subject="s",
            text="t",
            smtp_url=_url(controller, query="?starttls=true"),
            data_dir=tmp_path,
            sender=SENDER,
        )
    assert info.value.transient is False
    assert handler.messages == []


def test_refused_port_is_transient(tmp_path: Path) -> None:
    with pytest.raises(MailError) as info:
        send_mail(
            to="alice@example.com",
            subject="s",
            text="t",
            smtp_url=f"smtp://127.0.0.1:{_free_port()}",
            data_dir=tmp_path,
            sender=SENDER,
        )
    assert info.value.transient is True
    assert info.value.smtp_code is None
    assert isinstance(info.value, Exception)


@pytest.mark.parametrize("url", ["http://127.0.0.1:25", "smtp://", "smtp://h:notaport", "smtp://h?starttls=maybe"])
def test_invalid_smtp_url_is_permanent(url: str, tmp_path: Path) -> None:
    with pytest.raises(MailError) as info:
        send_mail(to="a@example.com", subject="s", text="t", smtp_url=url, data_dir=tmp_path, sender=SENDER)
    assert info.value.transient is False


def test_dev_fallback_writes_parseable_eml(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"  # does not exist yet
    for i in range(3):
        send_mail(
            to="dev@example.com",
            subject=f"Reset your password #{i}",
            text=f"Token link {i}: https://tessera.local/reset?t=abc\n",
            smtp_url=None,
            data_dir=data_dir,
            sender=SENDER,
        )
    files = sorted((data_dir / "mail").iterdir())
    assert [f.suffix for f in files] == [".eml"] * 3  # no temp files left behind
    assert len({f.name for f in files}) == 3
    subjects = []
    for f in files:
        parsed = email.message_from_bytes(f.read_bytes(), policy=email.policy.default)
        assert parsed["To"] == "dev@example.com"
        assert parsed["From"] == SENDER
        assert parsed["Message-ID"] and parsed["Date"]
        subjects.append(parsed["Subject"])
    # Sorting by file name sorts by creation time.
    assert subjects == [f"Reset your password #{i}" for i in range(3)]


def test_header_injection_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        send_mail(
            to="a@example.com",
            subject="hi\r\nBcc: victim@example.com",
            text="t",
            smtp_url=None,
            data_dir=tmp_path,
            sender=SENDER,
        )
    assert not (tmp_path / "mail").exists() or not any((tmp_path / "mail").iterdir())
