"""Opening the store: engines for SQLite and PostgreSQL, and the transaction helper.

SQLite is the default (one file, WAL journal, a busy timeout so that several writers wait for
each other instead of failing, foreign keys on). PostgreSQL is used when the URL says so, through
psycopg 3. Either way the caller owns the transaction: ``session_scope`` commits on success and
rolls back on any error, so a block of store calls is all or nothing.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

__all__ = ["StoreError", "StoreUnavailable", "make_engine", "open_store", "redact_url", "session_scope", "sqlite_url",
           "store_file"]

# Connection execution option that makes the SQLite "begin" hook emit BEGIN IMMEDIATE.
_BEGIN_IMMEDIATE = "tidal_begin_immediate"
# Seconds a PostgreSQL connection attempt may take before the store counts as unreachable.
PG_CONNECT_TIMEOUT_S = 10
# open_store's engines: one per (URL, busy timeout) per process.
_OPEN: dict[tuple[str, int], sa.Engine] = {}
# The busy timeout each SQLite engine was made with, for error messages.
_BUSY_TIMEOUT_MS: weakref.WeakKeyDictionary[sa.Engine, int] = weakref.WeakKeyDictionary()


class StoreError(RuntimeError):
    """The store refused or could not do something; the message is one line, fit for a CLI."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class StoreUnavailable(StoreError):
    """The store's server cannot be reached (stopped, restarting, network gone): nothing is wrong
    with the request, and the same call succeeds once the server is back. ``url`` is the store's
    URL with any password hidden; ``reason`` is the driver's one-line explanation."""

    def __init__(self, message: str, *, url: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.url, self.reason = url, reason

    def __reduce__(self):  # keyword-only fields survive pickling (Ray workers, Prefect results)
        return (_rebuild_unavailable, (str(self), self.url, self.reason))


def _rebuild_unavailable(message: str, url: str, reason: str) -> StoreUnavailable:
    return StoreUnavailable(message, url=url, reason=reason)


# SQLSTATEs of a server that went away or is not accepting connections: class 08 (connection
# exception) and 57P01-57P03 (admin shutdown, crash shutdown, cannot connect now).
_UNREACHABLE_SQLSTATES = ("08", "57P01", "57P02", "57P03")


def _unreachable(exc: sa.exc.DBAPIError) -> bool:
    """Whether a PostgreSQL error means the server cannot be reached (rather than a refused request).

    psycopg reports a refused or dropped connection as an ``OperationalError`` with no SQLSTATE
    (the server never answered) or one of the connection SQLSTATEs; SQLAlchemy flags errors it
    recognises as disconnects with ``connection_invalidated``.
    """
    if exc.connection_invalidated:
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(_UNREACHABLE_SQLSTATES)


def redact_url(url: str | sa.URL) -> str:
    """``url`` with its password replaced by ``***``: what messages, logs and stored copies show.

    Works on the text itself rather than a parse, so the URL comes back otherwise unchanged, and
    a password with an unescaped ``@`` or ``/`` is still hidden whole (everything between
    ``user:`` and the last ``@``). A URL without a password comes back as it was.
    """
    if isinstance(url, sa.URL):
        return url.render_as_string(hide_password=True)
    text = str(url)
    scheme, sep, rest = text.partition("://")
    found = re.match(r"(?P<user>[^:/@]*):(?P<password>.*)@(?P<host>[^@]*)$", rest, re.DOTALL) if sep else None
    if found is None:
        return text
    return f"{scheme}://{found['user']}:***@{found['host']}"


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text (driver errors span several lines)."""
    orig = getattr(exc, "orig", None) or exc
    for line in str(orig).splitlines():
        if line.strip():
            return line.strip()
    return type(orig).__name__


def sqlite_url(path: str | Path) -> str:
    """The SQLAlchemy URL of a SQLite file at ``path`` (``~`` expanded, made absolute)."""
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def _parse_url(url: str | sa.URL) -> sa.URL:
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        raise StoreError(f"not a database URL: {str(url)!r}") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise StoreError(
            f"unsupported store backend {backend!r} in {_shown(parsed)}; "
            "use sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return parsed


def _shown(url: sa.URL) -> str:
    return url.render_as_string(hide_password=True)


def _sqlite_file(url: sa.URL) -> Path | None:
    """The file behind a SQLite URL, or None for an in-memory or URI-style database."""
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or url.query.get("uri"):
        return None
    return Path(database).expanduser()


def store_file(url: str | sa.URL) -> Path | None:
    """The file a SQLite store URL names (``~`` expanded), or None for PostgreSQL and for an
    in-memory or URI-style SQLite database. Raises ``StoreError`` for a malformed or unsupported
    URL, with the same one-line message as ``make_engine``. Opens nothing."""
    parsed = _parse_url(url)
    return _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None


def _make_sqlite_engine(url: sa.URL, busy_timeout_ms: int) -> sa.Engine:
    path = _sqlite_file(url)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise StoreError(f"cannot create the store's folder {path.parent}: {reason}") from exc
        url = url.set(database=str(path))
    # The pool hands one connection to one thread at a time, so sharing across threads is safe.
    engine = sa.create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy emit BEGIN itself (see _begin): the sqlite3 module's own transaction
        # handling skips BEGIN before SELECT and cannot say BEGIN IMMEDIATE.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: sa.Connection) -> None:
        immediate = connection.get_execution_options().get(_BEGIN_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    _BUSY_TIMEOUT_MS[engine] = int(busy_timeout_ms)
    return engine


def make_engine(url: str | sa.URL, *, busy_timeout_ms: int = 30_000) -> sa.Engine:
    """Open the store at ``url`` and check that it answers.

    ``sqlite:///PATH`` creates PATH's folder and sets WAL, ``busy_timeout_ms`` and foreign keys
    on every connection. ``postgresql://`` (or ``postgres://``) is served by psycopg 3.
    Raises ``StoreError`` with a one-line reason for a malformed, unsupported or unreachable URL.
    """
    parsed = _parse_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = _make_sqlite_engine(parsed, busy_timeout_ms)
        else:
            engine = sa.create_engine(
                parsed, pool_pre_ping=True, connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S}
            )
    except (ImportError, sa.exc.NoSuchModuleError) as exc:
        raise StoreError(
            f"no driver for {_shown(parsed)} ({first_line(exc)}); install tidal[postgres]"
        ) from exc
    try:
        with engine.connect():
            pass
    except sa.exc.SQLAlchemyError as exc:
        engine.dispose()
        raise StoreError(f"cannot open the store at {_shown(parsed)}: {first_line(exc)}") from exc
    return engine


def open_store(url: str, *, busy_timeout_ms: int = 30_000) -> sa.Engine:
    """``make_engine(url)``, once per URL and busy timeout in this process (later calls, e.g. from
    each task on a worker, reuse it). A malformed or unreachable store raises ``StoreError`` and
    is tried again on the next call."""
    key = (str(url), int(busy_timeout_ms))
    if key not in _OPEN:
        _OPEN[key] = make_engine(url, busy_timeout_ms=busy_timeout_ms)
    return _OPEN[key]


@contextmanager
def session_scope(engine: sa.Engine, *, immediate: bool = False) -> Iterator[Session]:
    """One transaction: commit if the block succeeds, roll back if it raises.

    ``immediate=True`` takes SQLite's write lock at the start (BEGIN IMMEDIATE), waiting up to the
    busy timeout for other writers; use it for read-modify-write blocks, where a plain BEGIN can
    fail when the read lock cannot be upgraded. On PostgreSQL it changes nothing (row locks and
    unique keys already keep concurrent writers apart). A lock that stays busy past the timeout
    surfaces as ``StoreError``, a PostgreSQL server that cannot be reached as ``StoreUnavailable``;
    other errors propagate unchanged after the rollback.
    """
    session = Session(engine, expire_on_commit=False)
    try:
        if immediate and engine.dialect.name == "sqlite":
            session.connection(execution_options={_BEGIN_IMMEDIATE: True})
        yield session
        session.commit()
    except sa.exc.OperationalError as exc:
        _rollback_quietly(session)
        if engine.dialect.name != "sqlite" and _unreachable(exc):
            shown, reason = _shown(engine.url), first_line(exc)
            raise StoreUnavailable(f"the store at {shown} is unreachable: {reason}", url=shown,
                                   reason=reason) from exc
        raise StoreError(_operational_message(engine, exc)) from exc
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _rollback_quietly(session: Session) -> None:
    """Roll back after a failed block; on a connection that is already gone this fails too, and
    the first error is the one worth reporting."""
    try:
        session.rollback()
    except sa.exc.SQLAlchemyError:
        pass


def _operational_message(engine: sa.Engine, exc: sa.exc.OperationalError) -> str:
    reason = first_line(exc)
    if engine.dialect.name == "sqlite" and "locked" in reason:
        timeout_ms = _BUSY_TIMEOUT_MS.get(engine, "?")
        return (
            f"the store at {_shown(engine.url)} is locked by another writer (waited up to the "
            f"busy timeout of {timeout_ms} ms; a read-then-write block needs immediate=True): "
            f"{reason}"
        )
    return f"the store at {_shown(engine.url)} failed: {reason}"
