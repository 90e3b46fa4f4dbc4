"""agentic allowances, their rails and payment credentials

Revision ID: 0011_allowances
Revises: 0010_wallets
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = '0011_allowances'
down_revision: str | None = '0010_wallets'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('agentic_allowances',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('payment_method_id', sa.String(length=40), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=24), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('amount', sa.Numeric(precision=19, scale=4), nullable=False),
    sa.Column('amount_available', sa.Numeric(precision=19, scale=4), nullable=False),
    sa.Column('amount_reserved', sa.Numeric(precision=19, scale=4), nullable=False),
    sa.Column('amount_spent', sa.Numeric(precision=19, scale=4), nullable=False),
    sa.Column('reserved_by', sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True),
    sa.Column('description', sqlmodel.sql.sqltypes.AutoString(length=1000), nullable=True),
    sa.Column('expires_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('idempotency_key', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('operation', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
    sa.Column('pending_update', sa.JSON(), nullable=True),
    sa.Column('delete_requested_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.CheckConstraint('amount > 0 AND amount_available >= 0 AND amount_reserved >= 0 AND amount_spent >= 0',
                       name='ck_agentic_allowances_non_negative'),
    sa.CheckConstraint('amount_available + amount_reserved + amount_spent = amount',
                       name='ck_agentic_allowances_balance'),
    sa.ForeignKeyConstraint(['payment_method_id'], ['agentic_payment_methods.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name='uq_agentic_allowances_idempotency_key')
    )
    with op.batch_alter_table('agentic_allowances', schema=None) as batch_op:
        batch_op.create_index('ix_agentic_allowances_list', ['tenant_id', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_agentic_allowances_payment_method', ['payment_method_id', 'status'], unique=False)
        batch_op.create_index('ix_agentic_allowances_reserved', ['amount_reserved'], unique=False)

    op.create_table('agentic_allowance_rails',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('allowance_id', sa.String(length=40), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('rail', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('provider', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('error_code', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('provider_ids', sa.JSON(), nullable=False),
    sa.Column('enrollment_id', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('provider_allowance_id', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('verification', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
    sa.Column('otp_sealed', sa.LargeBinary(), nullable=True),
    sa.Column('cancelled_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('job_id', sa.Uuid(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['allowance_id'], ['agentic_allowances.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('allowance_id', 'rail', 'provider', name='uq_agentic_allowance_rails_pair')
    )
    with op.batch_alter_table('agentic_allowance_rails', schema=None) as batch_op:
        batch_op.create_index('ix_agentic_allowance_rails_allowance', ['allowance_id', 'position'], unique=False)

    op.create_table('agentic_payment_credentials',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('allowance_id', sa.String(length=40), nullable=False),
    sa.Column('rail', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('provider', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('format', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('amount', sa.Numeric(precision=19, scale=4), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('mpp', sa.JSON(), nullable=True),
    sa.Column('provider_credential_id', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('sealed', sa.LargeBinary(), nullable=True),
    sa.Column('job_id', sa.Uuid(), nullable=True),
    sa.Column('expires_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.CheckConstraint('amount > 0', name='ck_agentic_payment_credentials_amount'),
    sa.ForeignKeyConstraint(['allowance_id'], ['agentic_allowances.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('agentic_payment_credentials', schema=None) as batch_op:
        batch_op.create_index('ix_agentic_payment_credentials_allowance', ['allowance_id', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('agentic_payment_credentials', schema=None) as batch_op:
        batch_op.drop_index('ix_agentic_payment_credentials_allowance')

    op.drop_table('agentic_payment_credentials')
    with op.batch_alter_table('agentic_allowance_rails', schema=None) as batch_op:
        batch_op.drop_index('ix_agentic_allowance_rails_allowance')

    op.drop_table('agentic_allowance_rails')
    with op.batch_alter_table('agentic_allowances', schema=None) as batch_op:
        batch_op.drop_index('ix_agentic_allowances_reserved')
        batch_op.drop_index('ix_agentic_allowances_payment_method')
        batch_op.drop_index('ix_agentic_allowances_list')

    op.drop_table('agentic_allowances')
