"""account updater jobs

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "account_updater_jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("request_key", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=False),
        sa.Column("result_key", sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True),
        sa.Column("request_etag", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
        sa.Column("request_bytes", sa.Integer(), nullable=True),
        sa.Column("columns", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=False),
        sa.Column("rows_total", sa.Integer(), nullable=True),
        sa.Column("rows_done", sa.Integer(), nullable=False),
        sa.Column("chunks_total", sa.Integer(), nullable=True),
        sa.Column("chunks_done", sa.Integer(), nullable=False),
        sa.Column("id_seed", sa.String(length=32), nullable=False),
        sa.Column("trace_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("checked_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("completed_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("modified_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_account_updater_jobs_list", "account_updater_jobs", ["tenant_id", "created_at", "id"], unique=False
    )
    op.create_index("ix_account_updater_jobs_status", "account_updater_jobs", ["status", "expires_at"], unique=False)
    op.create_table(
        "account_updater_chunks",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("start_byte", sa.Integer(), nullable=False),
        sa.Column("end_byte", sa.Integer(), nullable=False),
        sa.Column("first_row", sa.Integer(), nullable=False),
        sa.Column("row_count", sa.Integer(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("result_rows", sa.Integer(), nullable=False),
        sa.Column("new_tokens", sa.Integer(), nullable=False),
        sa.Column("done_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["account_updater_jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "number"),
    )


def downgrade() -> None:
    op.drop_table("account_updater_chunks")
    op.drop_index("ix_account_updater_jobs_status", table_name="account_updater_jobs")
    op.drop_index("ix_account_updater_jobs_list", table_name="account_updater_jobs")
    op.drop_table("account_updater_jobs")
