"""Persistence: SQLModel tables, the session factory, Alembic migrations and encryption at rest."""
