"""webhook deliveries become jobs: the work of a delivery is the ``webhooks.deliver`` job with its id

Every delivery gets a ``jobs`` row with the same id (status: pending -> queued, or running while its
lease is live; succeeded; failed), holding what the delivery held of its work (attempts, ``due_at``,
``enqueued_at``, the lease, the last error). ``webhook_deliveries`` keeps what the delivery is, its id
becomes a foreign key to ``jobs.id`` (``ON DELETE CASCADE``), and a partial index on ``jobs`` serves
the per-tenant fairness checks of the deliveries still to deliver.

Revision ID: 0012_delivery_jobs
Revises: 0011_allowances
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

import storage.types
from config.settings import get_settings

revision: str = '0012_delivery_jobs'
down_revision: str | None = '0011_allowances'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KIND = 'webhooks.deliver'
WAITING = "kind = 'webhooks.deliver' AND status IN ('queued', 'running')"
FK_NAME = 'fk_webhook_deliveries_job'
_TS = storage.types.UTCDateTime(timezone=True)

jobs = sa.table(
    'jobs',
    sa.column('id', sa.Uuid()), sa.column('tenant_id', sa.Uuid()), sa.column('kind', sa.String()),
    sa.column('subject_type', sa.String()), sa.column('subject_id', sa.String()),
    sa.column('subject_number', sa.Integer()), sa.column('operation_id', sa.String()),
    sa.column('status', sa.String()), sa.column('attempts', sa.Integer()), sa.column('max_attempts', sa.Integer()),
    sa.column('due_at', _TS), sa.column('enqueued_at', _TS), sa.column('lease_owner', sa.String()),
    sa.column('lease_expires_at', _TS), sa.column('last_error', sa.String()), sa.column('result', sa.JSON()),
    sa.column('trace_id', sa.String()), sa.column('created_at', _TS), sa.column('updated_at', _TS),
)
deliveries = sa.table(
    'webhook_deliveries',
    sa.column('id', sa.Uuid()), sa.column('tenant_id', sa.Uuid()), sa.column('webhook_id', sa.Uuid()),
    sa.column('event_id', sa.Uuid()), sa.column('status', sa.String()), sa.column('attempts', sa.Integer()),
    sa.column('due_at', _TS), sa.column('enqueued_at', _TS), sa.column('lease_owner', sa.String()),
    sa.column('lease_expires_at', _TS), sa.column('last_error', sa.String()), sa.column('created_at', _TS),
    sa.column('completed_at', _TS),
)
events = sa.table('events', sa.column('id', sa.Uuid()), sa.column('trace_id', sa.String()))
MOVED = ('status', 'attempts', 'due_at', 'enqueued_at', 'lease_owner', 'lease_expires_at', 'last_error')


def _uuid_text(column, dialect: str):
    """A UUID column as its canonical text (SQLite stores 32 hex digits)."""
    if dialect == 'postgresql':
        return sa.cast(column, sa.Text)
    parts = [sa.func.substr(column, start, length) for start, length in ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))]
    text = parts[0]
    for part in parts[1:]:
        text = text + '-' + part
    return sa.func.lower(text)


class _KeepAttempts:
    """SQLite: a table rebuilt by a batch operation is dropped first, and dropping it deletes the rows
    referencing it (``webhook_attempts``, ``ON DELETE CASCADE``; foreign keys are enforced and the
    pragma cannot change inside the migration's transaction): they are kept aside and put back."""

    def __enter__(self):
        self.sqlite = op.get_bind().dialect.name == 'sqlite'
        if self.sqlite:
            op.execute('CREATE TEMPORARY TABLE keep_webhook_attempts AS SELECT * FROM webhook_attempts')
        return self

    def __exit__(self, *exc_info):
        if self.sqlite and exc_info[0] is None:
            op.execute('INSERT OR IGNORE INTO webhook_attempts SELECT * FROM keep_webhook_attempts')
            op.execute('DROP TABLE keep_webhook_attempts')


def upgrade() -> None:
    connection = op.get_bind()
    dialect = connection.dialect.name
    now = storage.types.utcnow()
    d = deliveries.c
    status = sa.case(
        (sa.and_(d.status == 'pending', d.lease_expires_at > sa.bindparam('now', now, type_=_TS)), 'running'),
        (d.status == 'pending', 'queued'),
        else_=d.status,
    )
    chosen = sa.select(
        d.id, d.tenant_id, sa.literal(KIND), sa.literal('webhook'), _uuid_text(d.webhook_id, dialect),
        sa.null(), sa.null(), status, d.attempts, sa.literal(len(get_settings().webhook_retry_delays) + 1),
        d.due_at, d.enqueued_at, d.lease_owner, d.lease_expires_at, d.last_error, sa.null(), events.c.trace_id,
        d.created_at, sa.func.coalesce(d.completed_at, d.created_at),
    ).select_from(deliveries.join(events, events.c.id == d.event_id))
    connection.execute(sa.insert(jobs).from_select([c.name for c in jobs.columns], chosen))
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries')
    with _KeepAttempts(), op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        for name in MOVED:
            batch_op.drop_column(name)
        batch_op.create_foreign_key(FK_NAME, 'jobs', ['id'], ['id'], ondelete='CASCADE')
    op.create_index('ix_jobs_deliveries_waiting', 'jobs', ['tenant_id', 'due_at'], unique=False,
                    postgresql_where=sa.text(WAITING), sqlite_where=sa.text(WAITING))


def downgrade() -> None:
    connection = op.get_bind()
    op.drop_index('ix_jobs_deliveries_waiting', table_name='jobs',
                  postgresql_where=sa.text(WAITING), sqlite_where=sa.text(WAITING))

    def of_job(expression):
        return sa.select(expression).where(jobs.c.id == deliveries.c.id).scalar_subquery()

    status = sa.case(
        (jobs.c.status.in_(('queued', 'running')), 'pending'), (jobs.c.status == 'succeeded', 'succeeded'),
        else_='failed',
    )
    with _KeepAttempts():
        with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
            batch_op.drop_constraint(FK_NAME, type_='foreignkey')
            batch_op.add_column(sa.Column('status', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True))
            batch_op.add_column(sa.Column('attempts', sa.Integer(), nullable=True))
            batch_op.add_column(sa.Column('due_at', _TS, nullable=True))
            batch_op.add_column(sa.Column('enqueued_at', _TS, nullable=True))
            batch_op.add_column(sa.Column('lease_owner', sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
            batch_op.add_column(sa.Column('lease_expires_at', _TS, nullable=True))
            batch_op.add_column(sa.Column('last_error', sqlmodel.sql.sqltypes.AutoString(length=500), nullable=True))
        connection.execute(sa.update(deliveries).values(
            status=of_job(status), attempts=of_job(jobs.c.attempts), due_at=of_job(jobs.c.due_at),
            enqueued_at=of_job(jobs.c.enqueued_at), lease_owner=of_job(jobs.c.lease_owner),
            lease_expires_at=of_job(jobs.c.lease_expires_at),
            last_error=of_job(sa.func.substr(jobs.c.last_error, 1, 500)),
        ))
        with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
            batch_op.alter_column('status', existing_type=sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False)
            batch_op.alter_column('attempts', existing_type=sa.Integer(), nullable=False)
            batch_op.alter_column('due_at', existing_type=_TS, nullable=False)
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['status', 'due_at'], unique=False)
    connection.execute(sa.delete(jobs).where(jobs.c.kind == KIND))
