"""Alembic environment: runs the migrations against the configured database."""

from alembic import context
from sqlmodel import SQLModel

import storage.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from storage.db import make_engine

config = context.config
target_metadata = SQLModel.metadata


def run_migrations() -> None:
    """Run in 'online' mode on the URL that storage.migrate put in the config."""
    url = config.get_main_option("sqlalchemy.url")
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
            # each migration commits on its own: one that builds an index CONCURRENTLY (an autocommit
            # block) commits what came before it anyway, and a failed one leaves the earlier ones applied
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations()
