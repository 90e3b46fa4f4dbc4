"""Sending mail.

:func:`send_mail` either talks SMTP (when an ``smtp_url`` is configured) or,
for development installs without a mail server, drops the message as an
``.eml`` file into ``<data_dir>/mail``.

SMTP URL forms::

    smtp://[user:pass@]host[:port]                  plain (port 25)
    smtp://[user:pass@]host[:port]?starttls=true    STARTTLS (port 25 unless given)
    smtps://[user:pass@]host[:port]                 implicit TLS (port 465)

User name and password are percent-decoded. TLS always verifies the server
certificate against the system trust store.
"""

from __future__ import annotations

import email.utils
import os
import pathlib
import secrets
import smtplib
import socket
import ssl
import tempfile
from datetime import UTC, datetime
from email.message import EmailMessage
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["SMTP_TIMEOUT_S", "MailError", "send_mail"]

SMTP_TIMEOUT_S = 10.0
_DEFAULT_PORTS = {"smtp": 25, "smtps": 465}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class MailError(Exception):
    """Sending a message failed.

    Attributes:
        transient: ``True`` if a later retry may succeed (connection refused
            or reset, timeouts, SMTP 4xx replies); ``False`` for permanent
            failures (SMTP 5xx replies, authentication rejected, TLS
            certificate not trusted, invalid ``smtp_url``).
        smtp_code: the SMTP reply code involved, if any, else ``None``.

    The message is short and never contains the SMTP password or the body.
    """

    def __init__(self, message: str, *, transient: bool, smtp_code: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.smtp_code = smtp_code


def _check_header(name: str, value: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str")
    if "\r" in value or "\n" in value or "\x00" in value:
        raise ValueError(f"{name} must not contain line breaks")


def _cte(body: str) -> str:
    """The transfer encoding of a part: ``7bit`` for ASCII, ``8bit`` otherwise. Never
    quoted-printable, whose soft line breaks cut long links in two for anyone reading the raw mail
    (lines stay far below RFC 5322's 998 characters)."""
    return "7bit" if body.isascii() else "8bit"


def _build_message(*, to: str, subject: str, text: str, sender: str, html: str | None = None) -> EmailMessage:
    for name, value in (("to", to), ("subject", subject), ("sender", sender)):
        _check_header(name, value)
    if not to.strip() or not sender.strip():
        raise ValueError("to and sender must not be empty")
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = subject
    msg["Date"] = email.utils.format_datetime(datetime.now(UTC))
    _name, addr = email.utils.parseaddr(sender)
    domain = addr.rpartition("@")[2] or None
    msg["Message-ID"] = email.utils.make_msgid(domain=domain)
    msg.set_content(text, cte=_cte(text))
    if html is not None:
        msg.add_alternative(html, subtype="html", cte=_cte(html))
    return msg


def _parse_smtp_url(smtp_url: str) -> tuple[str, str, int, bool, str | None, str | None]:
    """Return (scheme, host, port, starttls, user, password) or raise MailError."""
    try:
        parts = urlsplit(smtp_url)
        port = parts.port
    except ValueError:
        raise MailError("invalid smtp_url", transient=False) from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise MailError("smtp_url scheme must be smtp or smtps", transient=False)
    if not parts.hostname:
        raise MailError("smtp_url has no host", transient=False)
    query = parse_qs(parts.query, keep_blank_values=True)
    starttls_values = [v.lower() for v in query.get("starttls", [])]
    starttls = False
    for value in starttls_values:
        if value in _TRUE:
            starttls = True
        elif value not in _FALSE:
            raise MailError("smtp_url starttls must be true or false", transient=False)
    if starttls and scheme == "smtps":
        raise MailError("starttls cannot be combined with smtps", transient=False)
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return scheme, parts.hostname, port or _DEFAULT_PORTS[scheme], starttls, user, password


def _classify(exc: BaseException) -> MailError:
    """Map an smtplib/socket/ssl exception to a MailError (no secrets in text)."""
    if isinstance(exc, MailError):
        return exc
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _msg in exc.recipients.values()]
        code = max(codes) if codes else None
        # Permanent only if every recipient was permanently refused.
        transient = any(400 <= c < 500 for c in codes) or code is None
        return MailError(f"recipient refused (SMTP {code})", transient=transient, smtp_code=code)
    if isinstance(exc, smtplib.SMTPAuthenticationError):
        code = exc.smtp_code
        return MailError(
            f"SMTP authentication failed ({code})",
            transient=400 <= code < 500,
            smtp_code=code,
        )
    if isinstance(exc, smtplib.SMTPResponseException):
        # SMTPSenderRefused, SMTPDataError, SMTPConnectError, SMTPHeloError, ...
        code = exc.smtp_code
        transient = not (500 <= code < 600)
        kind = type(exc).__name__.removeprefix("SMTP")
        return MailError(f"SMTP {code} ({kind})", transient=transient, smtp_code=code)
    if isinstance(exc, smtplib.SMTPNotSupportedError):
        return MailError(f"SMTP server does not support: {exc}", transient=False)
    if isinstance(exc, smtplib.SMTPServerDisconnected):
        return MailError("SMTP server disconnected unexpectedly", transient=True)
    if isinstance(exc, smtplib.SMTPException):
        return MailError(f"SMTP error ({type(exc).__name__})", transient=True)
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or "certificate verify failed"
        return MailError(f"SMTP TLS certificate verification failed: {detail}", transient=False)
    if isinstance(exc, ssl.CertificateError):
        return MailError("SMTP TLS certificate does not match the host", transient=False)
    if isinstance(exc, ssl.SSLError):
        return MailError("SMTP TLS handshake failed", transient=True)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return MailError("SMTP connection timed out", transient=True)
    if isinstance(exc, ConnectionRefusedError):
        return MailError("SMTP connection refused", transient=True)
    if isinstance(exc, socket.gaierror):
        return MailError("SMTP host name could not be resolved", transient=True)
    if isinstance(exc, OSError):
        return MailError(f"SMTP connection failed ({type(exc).__name__})", transient=True)
    return MailError(f"SMTP failure ({type(exc).__name__})", transient=True)


def _send_smtp(msg: EmailMessage, smtp_url: str) -> None:
    scheme, host, port, starttls, user, password = _parse_smtp_url(smtp_url)
    context = ssl.create_default_context()
    client: smtplib.SMTP
    try:
        if scheme == "smtps":
            client = smtplib.SMTP_SSL(
                host,
                port,
                timeout=SMTP_TIMEOUT_S,
                context=context,
                local_hostname=socket.gethostname() or "localhost",
            )
        else:
            client = smtplib.SMTP(
                host,
                port,
                timeout=SMTP_TIMEOUT_S,
                local_hostname=socket.gethostname() or "localhost",
            )
        try:
            client.ehlo()
            if starttls:
                client.starttls(context=context)
                client.ehlo()
            if user is not None:
                client.login(user, password or "")
            client.send_message(msg)
        finally:
            try:
                client.quit()
            except (smtplib.SMTPException, OSError):
                client.close()
    except Exception as exc:
        raise _classify(exc) from exc


def _write_eml(msg: EmailMessage, data_dir: pathlib.Path) -> pathlib.Path:
    mail_dir = pathlib.Path(data_dir) / "mail"
    mail_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    final = mail_dir / f"{stamp}-{secrets.token_hex(6)}.eml"
    fd, tmp_name = tempfile.mkstemp(dir=mail_dir, prefix=".tmp-", suffix=".eml.part")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(msg.as_bytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise
    return final


def send_mail(
    *,
    to: str,
    subject: str,
    text: str,
    smtp_url: str | None,
    data_dir: pathlib.Path,
    sender: str,
    html: str | None = None,
) -> pathlib.Path | None:
    """Send one message, or store it as an ``.eml`` file; returns the file's path (``None`` when
    sent over SMTP).

    The message gets ``From`` (``sender``), ``To``, ``Subject``, ``Date``
    (UTC, RFC 5322) and a fresh ``Message-ID`` (domain taken from
    ``sender``); ``text`` is the UTF-8 body, and with ``html`` the message is
    ``multipart/alternative`` with the plain-text part first. Parts are sent
    7bit (ASCII) or 8bit, never quoted-printable, so a link stays whole on its
    line.

    With ``smtp_url`` set, it is sent over SMTP (see the module docstring for
    URL forms; connect/read timeouts are 10 s). With ``smtp_url`` ``None``
    (development), it is written to ``data_dir / "mail" /
    "<UTC yyyymmddThhmmssffffffZ>-<random hex>.eml"`` (directory created if
    missing; written to a temporary file, fsynced, then renamed, so readers
    never see partial files; mode 0600).

    Args:
        to: recipient address (one address, e.g. ``"a@example.com"`` or
            ``"Ann <a@example.com>"``).
        subject: subject line (no line breaks).
        text: plain-text body.
        html: the HTML version of the same body, or ``None`` for a plain-text
            message.
        smtp_url: ``smtp://``/``smtps://`` URL, or ``None`` for the file
            fallback.
        data_dir: the installation's data directory (used only when
            ``smtp_url`` is ``None``).
        sender: ``From`` address.

    Raises:
        MailError: SMTP sending failed or ``smtp_url`` is invalid; see
            :attr:`MailError.transient` to decide whether to retry.
        ValueError: ``to``, ``subject`` or ``sender`` contain line breaks or
            are empty (programming/input error, not worth retrying).
        OSError: the ``.eml`` file could not be written (fallback mode).
    """
    msg = _build_message(to=to, subject=subject, text=text, sender=sender, html=html)
    if smtp_url is None:
        return _write_eml(msg, data_dir)
    _send_smtp(msg, smtp_url)
    return None
