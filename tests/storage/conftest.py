"""Store fixtures: a real SQLite file per test and a real PostgreSQL started for the session.

The PostgreSQL server is a throwaway cluster: ``initdb`` into a temporary folder, ``pg_ctl start``
on a free loopback port with its unix socket in that folder, one test database whose schema is
emptied before each test, stopped and deleted at the end. PostgreSQL refuses to run as root, so
under root (CI) the server runs as an unprivileged account: ``postgres`` if it exists, else
``nobody``, else one created with ``useradd``. The PostgreSQL tests skip only when the server
binaries are not installed."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from cluster.ports import free_port
from storage import make_engine, migrate, sqlite_url

BACKENDS = ["sqlite", "postgresql"]
PG_SEARCH = "PATH or /usr/lib/postgresql/*/bin"
PG_FALLBACK_USER = "tidal-pg"


def _pg_bin_dir() -> Path | None:
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name)
    for bin_dir in reversed(versions):
        if (bin_dir / "initdb").exists() and (bin_dir / "pg_ctl").exists():
            return bin_dir
    return None


def _unprivileged_account() -> pwd.struct_passwd | None:
    """Who runs the server: ourselves unless we are root (initdb and postgres refuse root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
    try:
        return pwd.getpwnam(PG_FALLBACK_USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.fail("running as root with no postgres/nobody account and no useradd to make one")
    subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_FALLBACK_USER],
        check=True, capture_output=True,
    )
    return pwd.getpwnam(PG_FALLBACK_USER)


@dataclass
class PostgresServer:
    """A running throwaway cluster with one test database, emptied on demand."""

    host: str
    port: int
    user: str
    database: str = "tidal_test"
    password: str | None = None
    """Set when the cluster asks TCP clients for a password (it then goes into every URL)."""

    def url(self, database: str | None = None) -> str:
        login = self.user if self.password is None else f"{self.user}:{self.password}"
        return f"postgresql://{login}@{self.host}:{self.port}/{database or self.database}"

    def _admin(self, database: str) -> sa.Engine:
        url = self.url(database).replace("postgresql://", "postgresql+psycopg://")
        return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)

    def create(self) -> None:
        admin = self._admin("postgres")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{self.database}"')
        admin.dispose()

    def empty_database(self) -> str:
        """The test database's URL, with every table of earlier tests gone.

        Emptying the schema is ~20x faster than CREATE DATABASE; connections that an earlier
        test left open are ended first so that nothing holds a lock on the old tables.
        """
        admin = self._admin(self.database)
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            conn.exec_driver_sql("DROP SCHEMA public CASCADE")
            conn.exec_driver_sql("CREATE SCHEMA public")
        admin.dispose()
        return self.url()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    pytest.importorskip("psycopg", reason="psycopg 3 is missing (pip install tidal[postgres])")
    bin_dir = _pg_bin_dir()
    if bin_dir is None:
        pytest.skip(f"PostgreSQL server binaries (initdb, pg_ctl) not found on {PG_SEARCH}")
    account = _unprivileged_account()
    # Under /tmp when another account runs the server: it must be able to reach the folder.
    root = Path(tempfile.mkdtemp(prefix="tidal-pg-", dir="/tmp" if account else None))
    as_user: dict = {}
    if account is not None:
        os.chown(root, account.pw_uid, account.pw_gid)
        as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}

    def pg(*args: str) -> None:
        done = subprocess.run(
            [str(bin_dir / args[0]), *args[1:]], cwd=root, env=env, capture_output=True,
            text=True, **as_user,
        )
        if done.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise RuntimeError(f"{args[0]} failed ({done.returncode}):\n{done.stderr}\n{log}")

    data = root / "data"
    port = free_port()
    options = " ".join([
        "-c listen_addresses=127.0.0.1", f"-c port={port}", f"-c unix_socket_directories={root}",
        # A test cluster: durability off for speed.
        "-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off",
    ])
    try:
        pg("initdb", "-D", str(data), "-U", "tidal", "--auth=trust", "-E", "UTF8", "--no-sync")
        pg("pg_ctl", "-D", str(data), "-l", str(root / "server.log"), "-o", options, "-w",
           "-t", "30", "start")
        try:
            server = PostgresServer(host="127.0.0.1", port=port, user="tidal")
            server.create()
            yield server
        finally:
            pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store, once on a SQLite file and once on an emptied PostgreSQL database."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "home" / "store.db")
    return request.getfixturevalue("postgres_server").empty_database()


@pytest.fixture
def engine(store_url: str) -> Iterator[sa.Engine]:
    """An engine on a store migrated to head."""
    engine = make_engine(store_url)
    migrate(engine)
    yield engine
    engine.dispose()
