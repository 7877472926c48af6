"""Opening the store: engines for SQLite and PostgreSQL, and the transaction helper.

SQLite is the default (one file, WAL journal, a busy timeout so that several writers wait for
each other instead of failing, foreign keys on). PostgreSQL is used when the URL says so, through
psycopg 3. Either way the caller owns the transaction: ``session_scope`` commits on success and
rolls back on any error, so a block of store calls is all or nothing.

A PostgreSQL server that goes away after the engine first reached it (a restart, a fail-over) is
waited for, once per outage, up to the engine's reconnect bound (``storage.reconnect_timeout_s``):
new connections are retried, a transaction whose connection died inside a replayable write
(``replayable``: the step commit) is written again on a new one, and a COMMIT whose answer was
lost is checked first (a write that landed is not applied twice). Past the bound the store is
``StoreUnavailable`` as before, and later calls fail at once until the server answers again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

__all__ = ["RECONNECT_TIMEOUT_S", "ReplayableWrite", "StoreError", "StoreUnavailable", "make_engine", "open_store",
           "reconnect_timeout_s", "redact_url", "replayable", "session_scope", "sqlite_url", "store_file"]

log = logging.getLogger("tidal.storage")

# Connection execution option that makes the SQLite "begin" hook emit BEGIN IMMEDIATE.
_BEGIN_IMMEDIATE = "tidal_begin_immediate"
# Seconds a PostgreSQL connection attempt may take before the store counts as unreachable.
PG_CONNECT_TIMEOUT_S = 10
# Seconds a PostgreSQL store that answered once is waited for when it stops answering (a restart):
# the default of `storage.reconnect_timeout_s`. Below 30 s: a store that stays away is still a
# clear error within half a minute.
RECONNECT_TIMEOUT_S = 20.0
# Pause between two connection attempts while the server is away.
RECONNECT_POLL_S = 0.5
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


class _Outage:
    """One PostgreSQL engine's view of its server's absences: the window (``bound_s`` from the
    first failure) within which a lost server is waited for, shared by every caller of the engine,
    so an outage costs at most ``bound_s`` in all, not per call."""

    def __init__(self, shown: str, bound_s: float) -> None:
        self.shown, self.bound_s = shown, float(bound_s)
        self.reached = False  # a store never reached is bad input, not an outage: no waiting
        self.since: float | None = None
        self._lock = threading.Lock()

    def begin(self, reason: str) -> None:
        with self._lock:
            if self.since is None and self.reached:
                self.since = time.monotonic()
                log.warning("the store at %s is unreachable (%s); waiting up to %.0f s for it to come back "
                            "(storage.reconnect_timeout_s)", self.shown, reason, self.bound_s)

    def wait(self, reason: str) -> bool:
        """Pause before the next attempt; False once the window is over (or there is none)."""
        if not self.reached or self.bound_s <= 0:
            return False
        self.begin(reason)
        since = self.since
        left = (since if since is not None else time.monotonic()) + self.bound_s - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(RECONNECT_POLL_S, left))
        return True

    def end(self) -> None:
        with self._lock:
            self.reached = True
            if self.since is not None:
                log.warning("the store at %s answers again after %.1f s", self.shown, time.monotonic() - self.since)
                self.since = None


_OUTAGES: weakref.WeakKeyDictionary[sa.Engine, _Outage] = weakref.WeakKeyDictionary()


def reconnect_timeout_s(engine: sa.Engine) -> float:
    """How long ``engine`` waits for its PostgreSQL server to come back (0 for SQLite)."""
    outage = _OUTAGES.get(engine)
    return 0.0 if outage is None else outage.bound_s


def _refused(exc: BaseException) -> bool:
    """Whether a failed connection attempt means the server is away (refused, starting up, shutting
    down) rather than that the request is wrong (a bad password, a missing database)."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate is not None:
        return sqlstate.startswith(_UNREACHABLE_SQLSTATES)
    text = str(exc).lower()
    return not any(word in text for word in ("password", "authentication", "does not exist", "no pg_hba"))


def _wait_for_server(engine: sa.Engine, outage: _Outage) -> None:
    """Connection attempts of ``engine`` retry while its server is away, within the outage window."""

    @event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        while True:
            try:
                connection = dialect.connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError as exc:
                if _refused(exc) and outage.wait(first_line(exc)):
                    continue
                raise
            outage.end()
            return connection


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


def make_engine(url: str | sa.URL, *, busy_timeout_ms: int = 30_000,
                reconnect_timeout_s: float = RECONNECT_TIMEOUT_S) -> sa.Engine:
    """Open the store at ``url`` and check that it answers.

    ``sqlite:///PATH`` creates PATH's folder and sets WAL, ``busy_timeout_ms`` and foreign keys
    on every connection. ``postgresql://`` (or ``postgres://``) is served by psycopg 3; once it
    answered, a server that goes away is waited for up to ``reconnect_timeout_s`` (0: not at all).
    Raises ``StoreError`` with a one-line reason for a malformed, unsupported or unreachable URL
    (a store that does not answer now is not waited for).
    """
    parsed = _parse_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = _make_sqlite_engine(parsed, busy_timeout_ms)
        else:
            engine = sa.create_engine(
                parsed, pool_pre_ping=True, connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S}
            )
            _OUTAGES[engine] = outage = _Outage(_shown(parsed), reconnect_timeout_s)
            _wait_for_server(engine, outage)
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


def open_store(url: str, *, busy_timeout_ms: int = 30_000, reconnect_timeout_s: float | None = None) -> sa.Engine:
    """``make_engine(url)``, once per URL and busy timeout in this process (later calls, e.g. from
    each task on a worker, reuse it). A malformed or unreachable store raises ``StoreError`` and
    is tried again on the next call. ``reconnect_timeout_s`` sets the engine's reconnect bound
    (a later call without it keeps the bound; a new engine without it gets the default)."""
    key = (str(url), int(busy_timeout_ms))
    if key not in _OPEN:
        _OPEN[key] = make_engine(url, busy_timeout_ms=busy_timeout_ms,
                                 reconnect_timeout_s=RECONNECT_TIMEOUT_S if reconnect_timeout_s is None
                                 else reconnect_timeout_s)
    elif reconnect_timeout_s is not None and _OUTAGES.get(_OPEN[key]) is not None:
        _OUTAGES[_OPEN[key]].bound_s = float(reconnect_timeout_s)
    return _OPEN[key]


# ------------------------------------------------------------------------------- transactions

# session.info keys: the replayable writes of the transaction; whether anything else wrote; whether
# a replayable write is being applied (its own statements do not count as "anything else").
_REPLAYS, _OTHER_WRITES, _REPLAYING = "tidal_replays", "tidal_other_writes", "tidal_replaying"


class ReplayableWrite(Protocol):
    """A write that can be applied again on a new transaction after its connection died, and
    told apart once applied: ``landed`` says whether the store already holds it (after a COMMIT
    whose answer was lost) and raises ``StoreError`` when it holds something else in its place."""

    def apply(self, session: Session) -> Any: ...

    def landed(self, session: Session) -> bool: ...


class _StoreSession(Session):
    """A Session that notes in ``info`` whether anything but a replayable write changed rows."""


@event.listens_for(_StoreSession, "before_flush")
def _note_flush(session: Session, _context: Any, _instances: Any) -> None:
    if not session.info.get(_REPLAYING) and (session.new or session.dirty or session.deleted):
        session.info[_OTHER_WRITES] = True


@event.listens_for(_StoreSession, "do_orm_execute")
def _note_execute(state: Any) -> None:
    statement = state.statement
    reads = state.is_select or (isinstance(statement, sa.TextClause)
                                and statement.text.lstrip().upper().startswith("SELECT"))
    if not reads and not state.session.info.get(_REPLAYING):
        state.session.info[_OTHER_WRITES] = True


@contextmanager
def _replaying(session: Session) -> Iterator[None]:
    session.info[_REPLAYING] = True
    try:
        yield
    finally:
        session.info[_REPLAYING] = False


def _lost(engine: sa.Engine, exc: BaseException) -> bool:
    """Whether ``exc`` means ``engine``'s PostgreSQL server went away."""
    return (engine.dialect.name != "sqlite" and isinstance(exc, sa.exc.DBAPIError)
            and (isinstance(exc, sa.exc.OperationalError) or exc.connection_invalidated) and _unreachable(exc))


def replayable(session: Session, write: ReplayableWrite) -> Any:
    """Apply ``write`` in ``session``'s transaction (a store function's writes, e.g. one step's
    rows) so that a PostgreSQL server lost meanwhile does not lose it: the transaction is rolled
    back, and once the server answers again (within the engine's reconnect bound) the session's
    replayable writes are applied again on a new transaction. ``session_scope`` does the same for
    a lost COMMIT. Only when nothing else in the transaction wrote: a block with other writes fails
    as ``StoreUnavailable`` (its caller cannot be replayed)."""
    if session.new or session.dirty or session.deleted:  # pending rows of the caller's own: not replayable
        session.info[_OTHER_WRITES] = True
    writes = session.info.setdefault(_REPLAYS, [])
    writes.append(write)
    engine = session.get_bind()
    again = False
    while True:
        try:
            with _replaying(session):
                if again:  # a new transaction: what the lost one had written before this write, first
                    for earlier in writes[:-1]:
                        earlier.apply(session)
                return write.apply(session)
        except sa.exc.DBAPIError as exc:
            outage = _OUTAGES.get(engine)
            if outage is None or not _lost(engine, exc) or session.info.get(_OTHER_WRITES):
                raise
            _rollback_quietly(session)
            if not outage.wait(first_line(exc)):
                raise
            again = True


def _replay_commit(engine: sa.Engine, writes: list[ReplayableWrite], first: BaseException) -> None:
    """Commit ``writes`` again after a COMMIT whose answer was lost: on a new transaction, each
    write that has not landed is applied (one that has is not: no write twice). Waits for the
    server within the outage window; past it, the original error."""
    outage = _OUTAGES[engine]
    exc: BaseException = first
    while outage.wait(first_line(exc)):
        session = _StoreSession(engine, expire_on_commit=False)
        try:
            with _replaying(session):
                for write in writes:
                    if not write.landed(session):
                        write.apply(session)
            session.commit()
            return
        except sa.exc.DBAPIError as again:
            _rollback_quietly(session)
            if not _lost(engine, again):
                raise
            exc = again
        finally:
            session.close()
    raise exc


@contextmanager
def session_scope(engine: sa.Engine, *, immediate: bool = False) -> Iterator[Session]:
    """One transaction: commit if the block succeeds, roll back if it raises.

    ``immediate=True`` takes SQLite's write lock at the start (BEGIN IMMEDIATE), waiting up to the
    busy timeout for other writers; use it for read-modify-write blocks, where a plain BEGIN can
    fail when the read lock cannot be upgraded. On PostgreSQL it changes nothing (row locks and
    unique keys already keep concurrent writers apart). A lock that stays busy past the timeout
    surfaces as ``StoreError``, a PostgreSQL server that cannot be reached (past the engine's
    reconnect bound) as ``StoreUnavailable``; other errors propagate unchanged after the rollback.

    On PostgreSQL a COMMIT whose connection died is not given up at once: a block that only read
    has nothing to commit (its answers stand), and a block whose writes are all replayable
    (``replayable``: the step commit) is committed again once the server answers, each write
    checked first so that one that landed is not applied twice.
    """
    session = _StoreSession(engine, expire_on_commit=False)
    committing = False
    try:
        if immediate and engine.dialect.name == "sqlite":
            session.connection(execution_options={_BEGIN_IMMEDIATE: True})
        yield session
        committing = True
        session.commit()
    except sa.exc.OperationalError as exc:
        _rollback_quietly(session)
        if engine.dialect.name != "sqlite" and _unreachable(exc):
            if committing and _OUTAGES.get(engine) is not None:
                writes = session.info.get(_REPLAYS) or []
                if not writes and not session.info.get(_OTHER_WRITES):
                    return  # the block only read: its answers stand, there is nothing to commit
                if writes and not session.info.get(_OTHER_WRITES):
                    try:
                        _replay_commit(engine, writes, exc)
                        return
                    except sa.exc.OperationalError as last:
                        if not _unreachable(last):
                            raise StoreError(_operational_message(engine, last)) from last
                        exc = last
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
