"""network tokens and token intents

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
import sqlmodel  # noqa: F401
from alembic import op  # noqa: F401

import storage.types  # noqa: F401

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "network_tokens",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("data_ct", sa.LargeBinary(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.Column("card", sa.JSON(), nullable=False),
        sa.Column("source_ct", sa.LargeBinary(), nullable=True),
        sa.Column("par", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("network_reference", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
        sa.Column("token_id", sa.String(length=400), nullable=True),
        sa.Column("token_intent_id", sa.Uuid(), nullable=True),
        sa.Column("merchant_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("pending_job_id", sa.Uuid(), nullable=True),
        sa.Column("announced", sa.Boolean(), nullable=False),
        sa.Column("card_art", sa.JSON(), nullable=True),
        sa.Column("card_art_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("modified_by", sa.Uuid(), nullable=True),
        sa.Column("modified_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_network_tokens_intent", "network_tokens", ["tenant_id", "token_intent_id"], unique=False)
    op.create_index("ix_network_tokens_par", "network_tokens", ["tenant_id", "par"], unique=False)
    op.create_index(op.f("ix_network_tokens_tenant_id"), "network_tokens", ["tenant_id"], unique=False)
    op.create_table(
        "token_intents",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("type", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("data_ct", sa.LargeBinary(), nullable=False),
        sa.Column("fingerprint", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("token_id", sa.String(length=400), nullable=True),
        sa.Column("converted_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("cvc_expires_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_token_intents_cvc_expires_at"), "token_intents", ["cvc_expires_at"], unique=False)
    op.create_index(op.f("ix_token_intents_expires_at"), "token_intents", ["expires_at"], unique=False)
    op.create_index(op.f("ix_token_intents_tenant_id"), "token_intents", ["tenant_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_token_intents_tenant_id"), table_name="token_intents")
    op.drop_index(op.f("ix_token_intents_expires_at"), table_name="token_intents")
    op.drop_index(op.f("ix_token_intents_cvc_expires_at"), table_name="token_intents")
    op.drop_table("token_intents")
    op.drop_index(op.f("ix_network_tokens_tenant_id"), table_name="network_tokens")
    op.drop_index("ix_network_tokens_par", table_name="network_tokens")
    op.drop_index("ix_network_tokens_intent", table_name="network_tokens")
    op.drop_table("network_tokens")
