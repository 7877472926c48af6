"""A real PostgreSQL that fault tests stop and start again on the same port (``pg_ctl``).

``StoppablePostgres`` wraps one throwaway cluster (``stop``, ``start``, ``restart``): ``initdb`` into a temporary folder, loopback
TCP on a free port, unix socket in that folder, durability off for speed. Under root the server
runs as an unprivileged account (PostgreSQL refuses root), found or made by the storage tests'
helpers (``tests/storage/conftest.py``, loaded here by path). With ``password`` set, TCP clients
must log in with it (scram-sha-256): the security tests use that to check that no password leaks.

``running_postgres()`` is the context manager the fixtures in ``tests/faults/conftest.py`` use.
Importable from the tests in this folder (pytest puts it on ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from cluster.ports import free_port

# The storage tests' PostgreSQL helpers, loaded by path (a second `conftest` module name would
# clash with this folder's).
_spec = importlib.util.spec_from_file_location(
    "tidal_tests_storage_conftest", Path(__file__).resolve().parents[1] / "storage" / "conftest.py")
pgtools = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
if not hasattr(pgtools, "PostgresServer"):
    _spec.loader.exec_module(pgtools)


class StoppablePostgres:
    """A throwaway PostgreSQL cluster that a test can stop and start again on the same port."""

    def __init__(self, bin_dir: Path, account, root: Path, password: str | None = None):
        self.bin_dir, self.root, self.data, self.password = bin_dir, root, root / "data", password
        self.as_user = {} if account is None else {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
        self.port = free_port()
        self.options = " ".join([
            "-c listen_addresses=127.0.0.1", f"-c port={self.port}", f"-c unix_socket_directories={root}",
            "-c fsync=off", "-c full_page_writes=off",
        ])
        self.server = pgtools.PostgresServer(host="127.0.0.1", port=self.port, user="tidal", password=password)

    def pg(self, *args: str) -> None:
        done = subprocess.run([str(self.bin_dir / args[0]), *args[1:]], cwd=self.root, env=self.env,
                              capture_output=True, text=True, timeout=60, **self.as_user)
        if done.returncode != 0:
            log = (self.root / "server.log").read_text() if (self.root / "server.log").exists() else ""
            raise RuntimeError(f"{args[0]} failed ({done.returncode}):\n{done.stderr}\n{log[-2000:]}")

    def init(self) -> None:
        auth = ["--auth=trust"]
        if self.password is not None:  # the superuser's password, read from a file only the server account sees
            pwfile = self.root / "pwfile"
            pwfile.write_text(self.password + "\n")
            if self.as_user:
                os.chown(pwfile, self.as_user["user"], self.as_user["group"])
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        self.pg("initdb", "-D", str(self.data), "-U", "tidal", *auth, "-E", "UTF8", "--no-sync")
        if self.password is not None:
            (self.root / "pwfile").unlink()

    def start(self) -> None:
        self.pg("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", self.options,
                "-w", "-t", "30", "start")

    def stop(self, mode: str = "immediate") -> None:
        """``immediate`` is a crash as far as clients are concerned: connections just drop."""
        self.pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, down_s: float = 0.0, mode: str = "immediate") -> float:
        """Stop (``mode``), stay down ``down_s`` seconds, start again on the same port: a restart
        as clients see it. Returns the seconds the server did not accept connections."""
        import time

        self.stop(mode)
        down = time.monotonic()
        time.sleep(down_s)
        self.start()
        return time.monotonic() - down

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def new_database(self, name: str) -> str:
        """Create database ``name`` (dropping an earlier one of that name); returns its URL."""
        admin = sa.create_engine(self.server.url("postgres").replace("postgresql://", "postgresql+psycopg://"),
                                 isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        finally:
            admin.dispose()
        return self.server.url(name)


@contextmanager
def running_postgres(password: str | None = None) -> Iterator[StoppablePostgres]:
    """A started cluster with the test database created; stopped and deleted afterwards.

    Skips (with the reason) when psycopg or the server binaries are missing.
    """
    pytest.importorskip("psycopg", reason="psycopg 3 is missing (pip install tidal[postgres])")
    bin_dir = pgtools._pg_bin_dir()
    if bin_dir is None:
        pytest.skip(f"PostgreSQL server binaries (initdb, pg_ctl) not found on {pgtools.PG_SEARCH}")
    account = pgtools._unprivileged_account()
    root = Path(tempfile.mkdtemp(prefix="tidal-pg-fault-", dir="/tmp" if account else None))
    if account is not None:
        os.chown(root, account.pw_uid, account.pw_gid)
    pg = StoppablePostgres(bin_dir, account, root, password=password)
    try:
        pg.init()
        pg.start()
        pg.server.create()
        yield pg
    finally:
        if pg.running():
            try:
                pg.stop("fast")
            except Exception:  # noqa: BLE001 - the temp folder goes anyway
                pass
        shutil.rmtree(root, ignore_errors=True)


def committed_steps(url: str) -> int:
    """How many steps the store at ``url`` holds (0 before its tables exist or while it is away)."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"), poolclass=sa.NullPool,
                              connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM steps")).scalar_one()
    except sa.exc.SQLAlchemyError:  # no tables yet, or the server is away
        return 0
    finally:
        engine.dispose()


def rows_per_step(url: str, uid: str, tables: tuple[str, ...]) -> dict[str, dict[int, int]]:
    """Rows per step of run ``uid`` in each of ``tables`` (each committed step must have its own)."""
    from storage import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            run_id = conn.execute(sa.text("SELECT id FROM runs WHERE uid = :u"), {"u": uid}).scalar_one()
            return {table: dict(conn.execute(sa.text(f"SELECT step, count(*) FROM {table} WHERE run_id = :r "
                                                     "GROUP BY step"), {"r": run_id}).all())
                    for table in tables}
    finally:
        engine.dispose()

