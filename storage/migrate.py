"""Running the Alembic migrations from code (``tessera migrate``, ``tessera dev``, the tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from config.settings import get_settings

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at this package's migrations and at ``url`` (default: settings)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url or get_settings().effective_database_url)
    return config


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Bring the database at ``url`` up to ``revision``."""
    command.upgrade(alembic_config(url), revision)


def check(url: str | None = None) -> None:
    """Raise ``alembic.util.CommandError`` when the models and the migrations disagree."""
    command.check(alembic_config(url))
