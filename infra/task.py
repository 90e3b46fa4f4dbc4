"""The task base class: the reliability rules every task shares (``ARCHITECTURE.md``)."""

from __future__ import annotations

import os
import socket

from celery import Task


class TesseraTask(Task):
    """Acknowledged late, rejected on worker loss, time-limited; arguments are ids only.

    ``worker_id`` names the lease owner (host, process and task request id).
    """

    acks_late = True
    reject_on_worker_lost = True
    max_retries = 5

    def worker_id(self) -> str:
        """A lease owner name unique to this attempt."""
        return f"{socket.gethostname()}:{os.getpid()}:{self.request.id}"
