"""tokens fillfactor: ``tokens`` pages filled to 80 %, the rest kept for updates of their rows

A token's update changes ``data_ct`` only (``PATCH /tokens/{id}``, a data key rotation resealing every
value): no indexed column. With room on the row's page PostgreSQL writes the new row version there as
a heap-only tuple (HOT), touching none of the table's indexes; on a full page (fillfactor 100, the
default) the version moves to another page and every index of the table gets an entry, most of an
update's cost. Measured in ``benchmarks/key_rotation.py``: see the README's key rotation figures.

An expand migration (see ``storage/migrations/README.md``): ``ALTER TABLE ... SET (fillfactor)``
takes a SHARE UPDATE EXCLUSIVE lock (reads and writes go on) and rewrites nothing; pages filled
from then on keep the room, pages already full gain it as their rows are updated and pruned.

Revision ID: 0016_tokens_fillfactor
Revises: 0015_jobs_takeable
"""

from collections.abc import Sequence

from alembic import op

revision: str = '0016_tokens_fillfactor'
down_revision: str | None = '0015_jobs_takeable'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Percent of a ``tokens`` page filled by inserts (``storage.models.TOKENS_FILLFACTOR``).
FILLFACTOR = 80


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(f'ALTER TABLE tokens SET (fillfactor = {FILLFACTOR})')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE tokens RESET (fillfactor)')
