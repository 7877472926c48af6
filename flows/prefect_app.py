"""The Prefect server application Tidal runs for its own temporary servers: Prefect's app with
every SQLite write transaction begun ``IMMEDIATE``.

Owns ``create_app`` (a uvicorn factory) and ``server_command``. Prefect's SQLite setup begins
most write transactions ``DEFERRED``; under WAL, a deferred transaction that reads and then
writes while the event pipeline writes fails at once with ``database is locked`` (the busy
timeout does not apply to that upgrade). The API answers 503 and the client sleeps a fixed 2 s
before its retry: the step-transition stalls measured in ``benchmarks/bench_prefect_stalls.py``.
Begun ``IMMEDIATE``, the transaction waits for the write lock (busy timeout) instead. Why and
what was measured: docs/benchmarks.md, "Prefect's SQLite stalls".
Must not: change anything for PostgreSQL, or for a Prefect server the user runs themselves.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

FACTORY = "flows.prefect_app:create_app"
IMMEDIATE_ENV = "TIDAL_PREFECT_SQLITE_IMMEDIATE"  # "0": Prefect's own begin modes (the benchmark's before)
RETRY_LOG_ENV = "TIDAL_PREFECT_503_LOG"  # a file: one line per 503 answered (the benchmark counts them)


def begin_immediate() -> bool:
    """Make Prefect's SQLite configuration begin its deferred transactions ``IMMEDIATE``.

    Returns False (and changes nothing) when this Prefect has no such hook, so a Prefect upgrade
    degrades to Prefect's own behaviour rather than to a broken server.
    """
    try:
        from prefect.server.database import configurations
    except ImportError:
        return False
    sqlite = getattr(configurations, "AioSqliteConfiguration", None)
    mode = getattr(configurations, "SQLITE_BEGIN_MODE", None)
    original = getattr(sqlite, "begin_sqlite_stmt", None)
    if sqlite is None or mode is None or original is None:
        return False
    if getattr(original, "tidal_immediate", False):
        return True

    def begin_sqlite_stmt(self: Any, conn: Any) -> None:
        if mode.get() == "DEFERRED":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            original(self, conn)

    begin_sqlite_stmt.tidal_immediate = True  # type: ignore[attr-defined]
    sqlite.begin_sqlite_stmt = begin_sqlite_stmt
    return True


def create_app(*args: Any, **kwargs: Any) -> Any:
    """uvicorn ``--factory`` entry: Prefect's ``create_app`` after ``begin_immediate()``."""
    if os.environ.get(IMMEDIATE_ENV, "1") != "0":
        begin_immediate()
    from prefect.server.api.server import create_app as prefect_create_app

    app = prefect_create_app(*args, **kwargs)
    if os.environ.get(RETRY_LOG_ENV):
        return _log_503s(app, os.environ[RETRY_LOG_ENV])
    return app


def _log_503s(app: Any, path: str) -> Any:
    """``app`` wrapped so that every 503 it answers appends ``METHOD PATH`` to ``path``."""

    async def logged(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def sending(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 503:
                with open(path, "a", encoding="utf-8") as out:
                    out.write(f"{scope.get('method')} {scope.get('path')}\n")
            await send(message)

        await app(scope, receive, sending)

    return logged


def server_command(port: int, *, factory: str = FACTORY, host: str = "127.0.0.1") -> list[str]:
    """The command line of a Prefect API server (no UI) on ``host:port`` served by ``factory``:
    on uvloop and httptools when installed (Tidal depends on both; they cut the server's CPU per
    API call by about a fifth here), else asyncio's loop and h11."""
    return [sys.executable, "-m", "uvicorn", "--factory", factory, "--host", host, "--port", str(port),
            "--log-level", "error", "--lifespan", "on",
            "--loop", "uvloop" if _importable("uvloop") else "asyncio",
            "--http", "httptools" if _importable("httptools") else "h11"]


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
