"""jobs takeable: the partial index ``ix_jobs_takeable`` on ``jobs (kind, tenant_id, due_at)``

Its rows are the jobs a worker may still take (``storage.states.JOB_TAKEABLE``: queued, running with a
lease that may have expired): the fair pick of the next job of a kind per tenant (``infra.fairness``)
reads them by kind, groups them by tenant and takes a tenant's oldest due one.

An expand migration (see ``storage/migrations/README.md``): the index is built CONCURRENTLY, outside
the migration's transaction, so the previous release keeps reading and writing ``jobs`` meanwhile. A
build that fails or is interrupted leaves an INVALID index of that name behind: drop it
(``DROP INDEX CONCURRENTLY ix_jobs_takeable``) and run ``tessera migrate`` again.

Revision ID: 0015_jobs_takeable
Revises: 0014_key_versions
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015_jobs_takeable'
down_revision: str | None = '0014_key_versions'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The rows of the index, as ``storage.models`` writes them (the values of ``JOB_TAKEABLE`` when written).
TAKEABLE = "status IN ('queued', 'running')"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index('ix_jobs_takeable', 'jobs', ['kind', 'tenant_id', 'due_at'], unique=False,
                        postgresql_concurrently=True, postgresql_where=sa.text(TAKEABLE),
                        sqlite_where=sa.text(TAKEABLE))


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index('ix_jobs_takeable', table_name='jobs', postgresql_concurrently=True,
                      postgresql_where=sa.text(TAKEABLE), sqlite_where=sa.text(TAKEABLE))
