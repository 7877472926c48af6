"""Alembic revisions of the store, one file each, in a single line of history."""
