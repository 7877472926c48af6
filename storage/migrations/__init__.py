"""Alembic migrations of the store; run them with ``storage.migrate`` (no alembic.ini needed)."""
