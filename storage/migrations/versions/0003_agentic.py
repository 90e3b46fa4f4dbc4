"""agentic payment methods, rails, provider errors, idempotency, leases, agents

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('agentic_agents',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=False),
    sa.Column('enrollment_ids', sa.JSON(), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('instance_details', sa.JSON(), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_agentic_agents_tenant', 'agentic_agents', ['tenant_id', 'created_at'], unique=False)
    op.create_table('agentic_idempotency_records',
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('scope', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('owner', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('expires_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('resource_id', sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('problem', sa.JSON(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('completed_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', 'scope', 'key')
    )
    op.create_table('agentic_operation_leases',
    sa.Column('resource_id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('operation', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('owner', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('acquired_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('expires_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('resource_id')
    )
    op.create_index('ix_agentic_operation_leases_expiry', 'agentic_operation_leases', ['expires_at'], unique=False)
    op.create_table('agentic_payment_methods',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('source', sa.JSON(), nullable=False),
    sa.Column('token_id', sa.String(length=400), nullable=False),
    sa.Column('consumer', sa.JSON(), nullable=False),
    sa.Column('consumer_id', sa.String(length=64), nullable=False),
    sa.Column('card', sa.JSON(), nullable=True),
    sa.Column('agent_id', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('idempotency_key', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('delete_requested_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('deleted_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name='uq_agentic_payment_methods_idempotency_key')
    )
    op.create_index('ix_agentic_payment_methods_consumer', 'agentic_payment_methods', ['tenant_id', 'consumer_id', 'created_at'], unique=False)
    op.create_index('ix_agentic_payment_methods_list', 'agentic_payment_methods', ['tenant_id', 'created_at', 'id'], unique=False)
    op.create_table('agentic_provider_errors',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('code', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('title', sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
    sa.Column('detail', sqlmodel.sql.sqltypes.AutoString(length=500), nullable=False),
    sa.Column('provider', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('operation', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('rail', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('provider_code', sqlmodel.sql.sqltypes.AutoString(length=100), nullable=True),
    sa.Column('provider_correlation_id', sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True),
    sa.Column('payment_method_id', sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True),
    sa.Column('allowance_id', sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True),
    sa.Column('payment_credential_id', sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True),
    sa.Column('occurred_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_agentic_provider_errors_occurred', 'agentic_provider_errors', ['occurred_at'], unique=False)
    op.create_index('ix_agentic_provider_errors_payment_method', 'agentic_provider_errors', ['tenant_id', 'payment_method_id', 'occurred_at', 'id'], unique=False)
    op.create_table('agentic_payment_method_rails',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('payment_method_id', sa.String(length=40), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('rail', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('provider', sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('error_code', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('provider_ids', sa.JSON(), nullable=False),
    sa.Column('enrollment_id', sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
    sa.Column('enrollment_removed_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('attempt', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('job_id', sa.Uuid(), nullable=True),
    sa.Column('operation_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('notify', sa.Boolean(), nullable=False),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['payment_method_id'], ['agentic_payment_methods.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('payment_method_id', 'rail', 'provider', name='uq_agentic_rails_pair')
    )
    op.create_index('ix_agentic_rails_payment_method', 'agentic_payment_method_rails', ['payment_method_id', 'position'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_agentic_rails_payment_method', table_name='agentic_payment_method_rails')
    op.drop_table('agentic_payment_method_rails')
    op.drop_index('ix_agentic_provider_errors_payment_method', table_name='agentic_provider_errors')
    op.drop_index('ix_agentic_provider_errors_occurred', table_name='agentic_provider_errors')
    op.drop_table('agentic_provider_errors')
    op.drop_index('ix_agentic_payment_methods_list', table_name='agentic_payment_methods')
    op.drop_index('ix_agentic_payment_methods_consumer', table_name='agentic_payment_methods')
    op.drop_table('agentic_payment_methods')
    op.drop_index('ix_agentic_operation_leases_expiry', table_name='agentic_operation_leases')
    op.drop_table('agentic_operation_leases')
    op.drop_table('agentic_idempotency_records')
    op.drop_index('ix_agentic_agents_tenant', table_name='agentic_agents')
    op.drop_table('agentic_agents')
