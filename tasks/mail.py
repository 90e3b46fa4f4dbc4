"""Mail (``mail.*`` tasks on the ``mail`` queue): every mail is a recorded job (``infra/jobs.py``),
sent after the commit that recorded it, re-sent by the outbox relay if its message is lost, retried
with backoff on transient SMTP failures, a dead letter after ``max_attempts`` (replayable with
``tessera jobs replay``).

* ``mail.invitation`` (subject: the invitation link): the invitation mail
  (:func:`domain.tenancy.invitations.mail_of_job`).
* ``mail.webhook_disabled`` (subject: the webhook): tells a disabled webhook's ``notify_email`` that it
  was disabled and why (:func:`domain.webhooks.deliveries.disabled_notice`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Protocol

from sqlmodel import Session

from config.settings import get_settings
from domain.tenancy import invitations
from domain.webhooks import deliveries as webhooks
from infra.celery import celery_app
from infra.jobs import PermanentError, TransientError
from infra.mail import SMTP_TIMEOUT_S, MailError, send_mail
from infra.task import JobTask
from storage.models import Job

log = logging.getLogger("tessera.tasks.mail")


class _Mail(Protocol):
    to: str
    subject: str
    text: str


class MailJob(JobTask):
    """Send the mail :meth:`compose` builds (None: nothing to send, the job succeeds with
    ``{"sent": false}``); :meth:`sent` notes it in the completing transaction."""

    abstract = True
    lease_seconds = SMTP_TIMEOUT_S * 3 + 30
    #: What the mail is, in log lines (``invitation mail written to <path>``).
    label = "mail"

    def compose(self, session: Session, job: Job) -> _Mail | None:
        """The mail to send now."""
        raise NotImplementedError

    def sent(self, session: Session, job: Job) -> None:
        """Note that the mail went out (default: nothing)."""

    def perform(self, job: Job, inputs: dict[str, Any]) -> bool:
        """Send the mail: SMTP failures become :class:`TransientError` or :class:`PermanentError`."""
        settings = get_settings()
        with self.session_scope() as session:
            mail = self.compose(session, job)
        if mail is None:
            return False
        try:
            written = send_mail(
                to=mail.to,
                subject=mail.subject,
                text=mail.text,
                html=getattr(mail, "html", None),
                smtp_url=settings.smtp_url,
                data_dir=settings.data_dir,
                sender=settings.mail_from,
            )
        except MailError as exc:
            if exc.transient:
                raise TransientError(str(exc)) from exc
            raise PermanentError("MAIL_REFUSED", str(exc)) from exc
        except ValueError as exc:  # an address that cannot be put in a header: not worth retrying
            raise PermanentError("MAIL_ADDRESS", str(exc)) from exc
        if written is not None:  # the embedded default: say where the message is, for a person to open
            log.info("%s written to %s", self.label, written, extra={"path": str(written)})
        else:
            log.info("%s sent", self.label, extra={"smtp": (settings.smtp_url or "").rsplit("@", 1)[-1]})
        return True

    def apply(self, session: Session, job: Job, outcome: bool) -> dict:
        if outcome:
            self.sent(session, job)
        return {"sent": outcome}


class InvitationMail(MailJob):
    """The invitation mail of one link."""

    name = invitations.MAIL_TASK
    label = "invitation mail"

    def compose(self, session, job):
        return invitations.mail_of_job(session, job, get_settings())

    def sent(self, session, job):
        invitations.mark_mailed(session, job)


class WebhookDisabledMail(MailJob):
    """The notice that a webhook was disabled."""

    name = webhooks.NOTIFY_TASK
    label = "webhook-disabled notice"

    def compose(self, session, job):
        return webhooks.disabled_notice(session, uuid.UUID(job.subject_id))


celery_app.register_task(InvitationMail())
celery_app.register_task(WebhookDisabledMail())
