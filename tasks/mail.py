"""Mail (``mail.*`` tasks on the ``mail`` queue): sent after the commit, retried on SMTP failure."""

from __future__ import annotations

import uuid

from config.settings import get_settings
from infra.celery import celery_app
from infra.mail import MailError, send_mail
from infra.task import TesseraTask
from storage.db import session_scope
from storage.models import Webhook


@celery_app.task(name="mail.webhook_disabled", base=TesseraTask, bind=True, max_retries=8)
def webhook_disabled(self, webhook_id: str) -> str:
    """Tell a disabled webhook's ``notify_email`` that it was disabled and why."""
    settings = get_settings()
    with session_scope() as session:
        webhook = session.get(Webhook, uuid.UUID(webhook_id))
        if webhook is None or not webhook.notify_email or webhook.status != "disabled":
            return "nothing to send"
        to, name, url, reason = webhook.notify_email, webhook.name, webhook.url, webhook.disabled_reason
    text = (
        f"Your Tessera webhook '{name}' ({webhook_id}) delivering to {url} was disabled: {reason}.\n\n"
        "Fix the receiver, then enable the webhook again with PUT /webhooks/{id} and status 'enabled'.\n"
    )
    try:
        send_mail(
            to=to,
            subject=f"Webhook '{name}' disabled",
            text=text,
            smtp_url=settings.smtp_url,
            data_dir=settings.data_dir,
            sender=settings.mail_from,
        )
    except MailError as exc:
        if exc.transient:
            raise self.retry(exc=exc, countdown=min(60, 5 * 2**self.request.retries)) from exc
        raise
    return "sent"
