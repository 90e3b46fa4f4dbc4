"""pre-configured proxies

Revision ID: 0007_proxies
Revises: 0006_job_subjects
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = "0007_proxies"
down_revision: str | None = "0006_job_subjects"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "proxies",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("destination_url", sa.String(length=2048), nullable=False),
        sa.Column("request_transforms", sa.JSON(), nullable=False),
        sa.Column("response_transforms", sa.JSON(), nullable=False),
        sa.Column("configuration_ct", sa.LargeBinary(), nullable=True),
        sa.Column("require_auth", sa.Boolean(), nullable=False),
        sa.Column("application_id", sa.Uuid(), nullable=True),
        sa.Column("key_digest", sa.String(length=64), nullable=False),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("modified_by", sa.Uuid(), nullable=True),
        sa.Column("modified_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["application_id"], ["applications.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_digest"),
    )
    op.create_index("ix_proxies_tenant_id", "proxies", ["tenant_id"], unique=False)
    op.create_index("ix_proxies_list", "proxies", ["tenant_id", "created_at", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_proxies_list", table_name="proxies")
    op.drop_index("ix_proxies_tenant_id", table_name="proxies")
    op.drop_table("proxies")
