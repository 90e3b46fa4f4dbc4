"""wallet tokens, merchant keys and domains

Revision ID: 0010_wallets
Revises: 0009_reactors
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = "0010_wallets"
down_revision: str | None = "0009_reactors"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "wallet_merchant_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("wallet", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("public_key_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("merchant_id", sa.String(length=255), nullable=True),
        sa.Column("certificate_pem", sa.String(length=16384), nullable=True),
        sa.Column("private_key_ct", sa.LargeBinary(), nullable=False),
        sa.Column("expires_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_wallet_merchant_keys_tenant_id", "wallet_merchant_keys", ["tenant_id"], unique=False)
    op.create_index("ix_wallet_merchant_keys_list", "wallet_merchant_keys",
                    ["tenant_id", "wallet", "created_at", "id"], unique=False)
    op.create_table(
        "wallet_tokens",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("wallet", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("type", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("ingest_source", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("transaction_id", sa.String(length=255), nullable=False),
        sa.Column("payment_data_type", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
        sa.Column("device_manufacturer_identifier", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("fingerprint", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("card", sa.JSON(), nullable=False),
        sa.Column("data_ct", sa.LargeBinary(), nullable=False),
        sa.Column("cryptogram_ct", sa.LargeBinary(), nullable=True),
        sa.Column("cryptogram_expires_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("eci_indicator", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True),
        sa.Column("expires_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_by", sa.Uuid(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("modified_by", sa.Uuid(), nullable=True),
        sa.Column("modified_at", storage.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "wallet", "transaction_id", name="uq_wallet_tokens_transaction"),
    )
    op.create_index("ix_wallet_tokens_tenant_id", "wallet_tokens", ["tenant_id"], unique=False)
    op.create_table(
        "wallet_domains",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("environment", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("domain", sa.String(length=253), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "environment", "domain", name="uq_wallet_domains"),
    )
    op.create_index("ix_wallet_domains_tenant_id", "wallet_domains", ["tenant_id"], unique=False)
    op.create_table(
        "wallet_sessions",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant_id", sa.Uuid(), nullable=False),
        sa.Column("validation_url", sa.String(length=2048), nullable=False),
        sa.Column("display_name", sa.String(length=255), nullable=False),
        sa.Column("domain", sa.String(length=253), nullable=False),
        sa.Column("merchant_registration_id", sa.String(length=255), nullable=True),
        sa.Column("session_ct", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", storage.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_wallet_sessions_tenant_id", "wallet_sessions", ["tenant_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_wallet_sessions_tenant_id", table_name="wallet_sessions")
    op.drop_table("wallet_sessions")
    op.drop_index("ix_wallet_domains_tenant_id", table_name="wallet_domains")
    op.drop_table("wallet_domains")
    op.drop_index("ix_wallet_tokens_tenant_id", table_name="wallet_tokens")
    op.drop_table("wallet_tokens")
    op.drop_index("ix_wallet_merchant_keys_list", table_name="wallet_merchant_keys")
    op.drop_index("ix_wallet_merchant_keys_tenant_id", table_name="wallet_merchant_keys")
    op.drop_table("wallet_merchant_keys")
