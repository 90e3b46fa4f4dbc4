"""typed job subjects: subject_type, subject_number and operation_id beside subject_id

Composite subjects written before (``<account updater job id>:<chunk number>``, ``<payment method
id>/<operation id>``) are split into their columns; every job gets the type of what it works on.

Revision ID: 0006_job_subjects
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0006_job_subjects"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The subject type of each job kind recorded before this revision.
SUBJECT_TYPES = {
    "network_tokens.provision": "network_token",
    "network_tokens.suspend": "network_token",
    "network_tokens.resume": "network_token",
    "network_tokens.card_art": "network_token",
    "network_tokens.cryptogram": "network_token",
    "network_tokens.delete": "network_reference",
    "agentic.enroll_rail": "rail",
    "agentic.poll_rail": "rail",
    "agentic.delete_payment_method": "payment_method",
    "account_updater.prepare": "account_updater_job",
    "account_updater.process_chunk": "account_updater_job",
    "account_updater.finish": "account_updater_job",
    "mail.invitation": "invitation_link",
}


def upgrade() -> None:
    op.add_column("jobs", sa.Column("subject_type", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True))
    op.add_column("jobs", sa.Column("subject_number", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("operation_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    jobs = sa.table(
        "jobs",
        sa.column("kind", sa.String),
        sa.column("subject_type", sa.String),
        sa.column("subject_id", sa.String),
        sa.column("subject_number", sa.Integer),
        sa.column("operation_id", sa.String),
    )
    connection = op.get_bind()
    for kind, subject_type in SUBJECT_TYPES.items():
        connection.execute(sa.update(jobs).where(jobs.c.kind == kind).values(subject_type=subject_type))
    chunks = connection.execute(
        sa.select(jobs.c.subject_id).where(jobs.c.kind == "account_updater.process_chunk").distinct()
    ).scalars()
    for subject in list(chunks):
        job_id, _, number = (subject or "").rpartition(":")
        if job_id and number.isdigit():
            connection.execute(
                sa.update(jobs).where(jobs.c.kind == "account_updater.process_chunk", jobs.c.subject_id == subject)
                .values(subject_id=job_id, subject_number=int(number))
            )
    deletes = connection.execute(
        sa.select(jobs.c.subject_id).where(jobs.c.kind == "agentic.delete_payment_method").distinct()
    ).scalars()
    for subject in list(deletes):
        pm_id, _, operation = (subject or "").partition("/")
        if operation:
            connection.execute(
                sa.update(jobs).where(jobs.c.kind == "agentic.delete_payment_method", jobs.c.subject_id == subject)
                .values(subject_id=pm_id, operation_id=operation)
            )
    op.drop_index("ix_jobs_subject", table_name="jobs")
    op.create_index("ix_jobs_subject", "jobs", ["subject_type", "subject_id", "subject_number"], unique=False)


def downgrade() -> None:
    jobs = sa.table(
        "jobs",
        sa.column("subject_id", sa.String),
        sa.column("subject_number", sa.Integer),
        sa.column("operation_id", sa.String),
    )
    connection = op.get_bind()
    connection.execute(
        sa.update(jobs).where(jobs.c.subject_number.is_not(None))
        .values(subject_id=jobs.c.subject_id + ":" + sa.cast(jobs.c.subject_number, sa.String))
    )
    connection.execute(
        sa.update(jobs).where(jobs.c.operation_id.is_not(None))
        .values(subject_id=jobs.c.subject_id + "/" + jobs.c.operation_id)
    )
    op.drop_index("ix_jobs_subject", table_name="jobs")
    op.create_index("ix_jobs_subject", "jobs", ["subject_id"], unique=False)
    op.drop_column("jobs", "operation_id")
    op.drop_column("jobs", "subject_number")
    op.drop_column("jobs", "subject_type")
