"""Running the store's Alembic migrations from code (no alembic.ini).

Owns: ``migrate`` (one transaction; BEGIN IMMEDIATE on SQLite, a transaction-scoped advisory lock
on PostgreSQL, so that several drivers starting at once on a new store migrate it one after the
other and the later ones find it at head), ``downgrade`` and the revisions.
Must not: ``create_all`` (the migrations own the schema). Adding a revision: ``docs/storage.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError

from storage.engine import _BEGIN_IMMEDIATE, StoreError, first_line, make_engine

__all__ = ["MIGRATIONS_DIR", "alembic_config", "current_revision", "downgrade", "head_revision",
           "migrate"]

MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
MIGRATION_LOCK = 0x7469_6461_6C5F_6D67
"""The PostgreSQL advisory lock key a migration holds until its transaction ends ("tidal_mg")."""


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic config pointing at ``storage/migrations``, bound to ``connection`` if given."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The single head revision; Alembic raises if the history has forked into several."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise StoreError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


@contextmanager
def _engine(engine_or_url: sa.Engine | str | sa.URL) -> Iterator[sa.Engine]:
    if isinstance(engine_or_url, sa.Engine):
        yield engine_or_url
        return
    engine = make_engine(engine_or_url)
    try:
        yield engine
    finally:
        engine.dispose()


def _run(engine_or_url: sa.Engine | str | sa.URL, verb: str, revision: str) -> None:
    with _engine(engine_or_url) as engine:
        try:
            with engine.connect() as connection:
                connection.execution_options(**{_BEGIN_IMMEDIATE: True})
                with connection.begin():
                    if connection.dialect.name == "postgresql":  # concurrent first runs: one migrates, the rest wait
                        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
                    config = alembic_config(connection)
                    if verb == "upgrade":
                        command.upgrade(config, revision)
                    else:
                        command.downgrade(config, revision)
        except CommandError as exc:
            hint = " (was it written by a newer Tidal?)" if "locate revision" in str(exc) else ""
            raise StoreError(
                f"cannot {verb} the store to {revision!r}: {first_line(exc)}{hint}"
            ) from exc
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"cannot {verb} the store to {revision!r}: {first_line(exc)}") from exc


def migrate(engine_or_url: sa.Engine | str | sa.URL, revision: str = "head") -> None:
    """Upgrade the store's schema to ``revision`` (default: the latest). Idempotent."""
    _run(engine_or_url, "upgrade", revision)


def downgrade(engine_or_url: sa.Engine | str | sa.URL, revision: str) -> None:
    """Downgrade the store's schema to ``revision``; ``"base"`` drops every table (tests only)."""
    _run(engine_or_url, "downgrade", revision)


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the store's schema is at, or None for an empty database."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
