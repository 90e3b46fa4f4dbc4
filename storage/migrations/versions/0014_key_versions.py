"""key versions: versioned tenant data keys, the non-rotating derivation key, the key check, key rotations

``tenant_data_keys`` gets a ``version`` (part of its primary key), a ``state`` (active, retiring,
destroyed), ``wrapped_by`` (the wrapping key: ``master:<key check>`` or ``kms:<key id>``) and
``destroyed_at``; its ``wrapped_key`` may be NULL (destroyed). Every existing key becomes version 1,
active. ``tenant_index_keys`` holds each tenant's derivation key for fingerprints, search indexes and
invitation links: for existing tenants, a copy of their version 1 data key, from which those were
derived, so they keep matching. ``key_checks`` records the wrapping key in use; ``key_rotations``
the tenants' rotations; ``documents.key_version`` the version a document's content is sealed with.

Revision ID: 0014_key_versions
Revises: 0013_token_idempotency_keys
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import storage.types

revision: str = '0014_key_versions'
down_revision: str | None = '0013_token_idempotency_keys'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _versioned_table(name: str) -> None:
    op.create_table(name,
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('state', sa.String(length=16), server_default='active', nullable=False),
    sa.Column('wrapped_key', sa.LargeBinary(), nullable=True),
    sa.Column('wrapping', sa.String(length=16), nullable=False),
    sa.Column('kms_key_id', sa.String(length=2048), nullable=True),
    sa.Column('wrapped_by', sa.String(length=2100), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('destroyed_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', 'version')
    )


def upgrade() -> None:
    _versioned_table('tenant_data_keys_versioned')
    op.execute(
        "INSERT INTO tenant_data_keys_versioned (tenant_id, version, state, wrapped_key, wrapping, kms_key_id, "
        "wrapped_by, created_at) SELECT tenant_id, 1, 'active', wrapped_key, wrapping, kms_key_id, "
        "CASE WHEN wrapping = 'kms' THEN 'kms:' || kms_key_id END, created_at FROM tenant_data_keys"
    )
    op.create_table('tenant_index_keys',
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('wrapped_key', sa.LargeBinary(), nullable=False),
    sa.Column('wrapping', sa.String(length=16), nullable=False),
    sa.Column('kms_key_id', sa.String(length=2048), nullable=True),
    sa.Column('wrapped_by', sa.String(length=2100), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id')
    )
    op.execute(
        "INSERT INTO tenant_index_keys (tenant_id, wrapped_key, wrapping, kms_key_id, wrapped_by, created_at) "
        "SELECT tenant_id, wrapped_key, wrapping, kms_key_id, CASE WHEN wrapping = 'kms' THEN 'kms:' || kms_key_id END, "
        "created_at FROM tenant_data_keys"
    )
    op.drop_table('tenant_data_keys')
    op.rename_table('tenant_data_keys_versioned', 'tenant_data_keys')
    op.create_table('key_checks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('wrapping', sa.String(length=16), nullable=False),
    sa.Column('wrapped_by', sa.String(length=2100), nullable=False),
    sa.Column('check_value', sa.LargeBinary(), nullable=False),
    sa.Column('updated_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('key_rotations',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('done', sa.Integer(), nullable=False),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Uuid(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('completed_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_key_rotations_tenant_id'), 'key_rotations', ['tenant_id'], unique=False)
    with op.batch_alter_table('documents', schema=None) as batch_op:
        batch_op.add_column(sa.Column('key_version', sa.Integer(), server_default='1', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('documents', schema=None) as batch_op:
        batch_op.drop_column('key_version')
    op.drop_index(op.f('ix_key_rotations_tenant_id'), table_name='key_rotations')
    op.drop_table('key_rotations')
    op.drop_table('key_checks')
    op.create_table('tenant_data_keys_flat',
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('wrapped_key', sa.LargeBinary(), nullable=False),
    sa.Column('wrapping', sa.String(length=16), nullable=False),
    sa.Column('kms_key_id', sa.String(length=2048), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id')
    )
    # Only version 1 keys can be kept: values sealed under later versions are unreadable afterwards.
    op.execute(
        "INSERT INTO tenant_data_keys_flat (tenant_id, wrapped_key, wrapping, kms_key_id, created_at) "
        "SELECT tenant_id, wrapped_key, wrapping, kms_key_id, created_at FROM tenant_data_keys "
        "WHERE version = 1 AND wrapped_key IS NOT NULL"
    )
    op.drop_table('tenant_index_keys')
    op.drop_table('tenant_data_keys')
    op.rename_table('tenant_data_keys_flat', 'tenant_data_keys')
