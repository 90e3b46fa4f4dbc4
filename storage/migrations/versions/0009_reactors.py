"""reactors and their invocations

Revision ID: 0009_reactors
Revises: 0007_proxies
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types

revision: str = '0009_reactors'
down_revision: str | None = '0007_proxies'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('reactors',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
    sa.Column('state', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('code', sa.Text(), nullable=False),
    sa.Column('runtime', sa.JSON(), nullable=False),
    sa.Column('configuration_ct', sa.LargeBinary(), nullable=True),
    sa.Column('requested', sa.JSON(), nullable=True),
    sa.Column('requested_configuration_ct', sa.LargeBinary(), nullable=True),
    sa.Column('build_job_id', sa.Uuid(), nullable=True),
    sa.Column('deployed_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('modified_by', sa.Uuid(), nullable=True),
    sa.Column('modified_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('reactors', schema=None) as batch_op:
        batch_op.create_index('ix_reactors_list', ['tenant_id', 'created_at', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_reactors_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('reactor_runs',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('reactor_id', sa.Uuid(), nullable=True),
    sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('program', sa.JSON(), nullable=True),
    sa.Column('caller', sa.JSON(), nullable=False),
    sa.Column('job_id', sa.Uuid(), nullable=True),
    sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
    sa.Column('request_ct', sa.LargeBinary(), nullable=False),
    sa.Column('result_ct', sa.LargeBinary(), nullable=True),
    sa.Column('error_status', sa.Integer(), nullable=True),
    sa.Column('trace_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('created_at', storage.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('completed_at', storage.types.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['reactor_id'], ['reactors.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('reactor_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_reactor_runs_reactor_id'), ['reactor_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_reactor_runs_tenant_id'), ['tenant_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('reactor_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_reactor_runs_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_reactor_runs_reactor_id'))

    op.drop_table('reactor_runs')
    with op.batch_alter_table('reactors', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_reactors_tenant_id'))
        batch_op.drop_index('ix_reactors_list')

    op.drop_table('reactors')
