"""idempotency keys of token creation: ``token_idempotency_keys``

One row per tenant, scope (``tokens`` or ``tokenize``) and key, holding the sealed answer the key
gave; kept at least 24 hours.

Revision ID: 0013_token_idempotency_keys
Revises: 0012_delivery_jobs
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import storage.types

revision: str = '0013_token_idempotency_keys'
down_revision: str | None = '0012_delivery_jobs'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('token_idempotency_keys',
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('answer_ct', sa.LargeBinary(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', 'scope', 'key')
    )
    op.create_index(op.f('ix_token_idempotency_keys_created_at'), 'token_idempotency_keys', ['created_at'],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_token_idempotency_keys_created_at'), table_name='token_idempotency_keys')
    op.drop_table('token_idempotency_keys')
