"""The account updater's exceptions (S3 and card network failures are ``infra.jobs.PermanentError`` /
``TransientError``: they decide whether a step is retried)."""

from __future__ import annotations


class RequestFileError(Exception):
    """A request file that cannot be processed: not UTF-8 CSV text, or over the size limit (second
    document, section 4 "Account updater jobs"). The message is shown in the job's ``errors``."""
