"""invitations, client encryption keys, documents

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, storage.types.UTCDateTime(timezone=True), nullable=nullable)


def _text(name: str, length: int, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sqlmodel.sql.sqltypes.AutoString(length=length), nullable=nullable)


def _tenant_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "tenant_invitations",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        _text("email", 320),
        _text("role", 16),
        _text("status", 16),
        _ts("expires_at"),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        _ts("created_at"),
        sa.Column("modified_by", sa.Uuid(), nullable=True),
        _ts("modified_at", nullable=True),
        _tenant_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tenant_invitations_due", "tenant_invitations", ["status", "expires_at"], unique=False)
    op.create_index(
        "ix_tenant_invitations_list", "tenant_invitations", ["tenant_id", "created_at", "id"], unique=False
    )

    op.create_table(
        "tenant_invitation_links",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("invitation_id", sa.Uuid(), nullable=False),
        sa.Column("token_digest", sa.String(length=64), nullable=False),
        _text("status", 16),
        _ts("created_at"),
        _ts("mailed_at", nullable=True),
        _ts("used_at", nullable=True),
        _tenant_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_digest"),
    )
    op.create_index(
        op.f("ix_tenant_invitation_links_invitation_id"), "tenant_invitation_links", ["invitation_id"], unique=False
    )
    op.create_index(
        op.f("ix_tenant_invitation_links_tenant_id"), "tenant_invitation_links", ["tenant_id"], unique=False
    )

    op.create_table(
        "client_encryption_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("private_key_ct", sa.LargeBinary(), nullable=True),
        _ts("expires_at"),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        _ts("created_at"),
        _ts("deleted_at", nullable=True),
        _ts("destroyed_at", nullable=True),
        _tenant_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        op.f("ix_client_encryption_keys_expires_at"), "client_encryption_keys", ["expires_at"], unique=False
    )
    op.create_index(op.f("ix_client_encryption_keys_tenant_id"), "client_encryption_keys", ["tenant_id"], unique=False)

    op.create_table(
        "documents",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        _text("content_type", 255),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("chunk_size", sa.Integer(), nullable=False),
        sa.Column("chunk_count", sa.Integer(), nullable=False),
        _text("object_key", 1024),
        _text("upload_id", 1024, nullable=True),
        _text("status", 16),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        _ts("created_at"),
        _ts("deleted_at", nullable=True),
        _tenant_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_documents_sweep", "documents", ["status", "created_at"], unique=False)
    op.create_index(op.f("ix_documents_tenant_id"), "documents", ["tenant_id"], unique=False)

    op.create_table(
        "token_activity",
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("month", sa.Date(), nullable=False),
        sa.Column("token_id", sa.String(length=400), nullable=False),
        _tenant_fk(),
        sa.PrimaryKeyConstraint("tenant_id", "month", "token_id"),
    )


def downgrade() -> None:
    op.drop_table("token_activity")
    op.drop_index(op.f("ix_documents_tenant_id"), table_name="documents")
    op.drop_index("ix_documents_sweep", table_name="documents")
    op.drop_table("documents")
    op.drop_index(op.f("ix_client_encryption_keys_tenant_id"), table_name="client_encryption_keys")
    op.drop_index(op.f("ix_client_encryption_keys_expires_at"), table_name="client_encryption_keys")
    op.drop_table("client_encryption_keys")
    op.drop_index(op.f("ix_tenant_invitation_links_tenant_id"), table_name="tenant_invitation_links")
    op.drop_index(op.f("ix_tenant_invitation_links_invitation_id"), table_name="tenant_invitation_links")
    op.drop_table("tenant_invitation_links")
    op.drop_index("ix_tenant_invitations_list", table_name="tenant_invitations")
    op.drop_index("ix_tenant_invitations_due", table_name="tenant_invitations")
    op.drop_table("tenant_invitations")
