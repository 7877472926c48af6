"""Prefect's SQLite transactions begun IMMEDIATE (``flows.prefect_app``) wait for the write lock
where Prefect's own DEFERRED ones fail with ``database is locked`` (the 503 + 2 s client retry)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Two of Prefect's own write transactions on one database: the first reads, then sleeps while the
# second reads, writes and commits, then writes itself; prints how each ended.
RACE = textwrap.dedent("""
    import asyncio, sys
    import sqlalchemy as sa
    from prefect.server.database.configurations import AioSqliteConfiguration
    if sys.argv[2] == "1":
        from flows.prefect_app import begin_immediate
        assert begin_immediate()

    async def main():
        config = AioSqliteConfiguration(connection_url=f"sqlite+aiosqlite:///{sys.argv[1]}")
        engine = await config.engine()
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
        first_read = asyncio.Event()

        async def writer(name, wait_s):
            session = await config.session(engine)
            try:
                async with config.begin_transaction(session):
                    await session.execute(sa.text("SELECT count(*) FROM t"))
                    first_read.set()
                    await asyncio.sleep(wait_s)
                    await session.execute(sa.text("INSERT INTO t VALUES (1)"))
                return f"{name}:ok"
            except sa.exc.OperationalError as exc:
                return f"{name}:{'locked' if 'locked' in str(exc) else exc}"
            finally:
                await session.close()

        async def second():
            await first_read.wait()
            return await writer("second", 0.0)

        results = await asyncio.gather(writer("first", 0.5), second())
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT count(*) FROM t"))).scalar()
        await engine.dispose()
        print(" ".join(results), f"rows:{rows}")

    asyncio.run(main())
""")


def race(tmp_path: Path, immediate: bool) -> str:
    db = tmp_path / f"prefect-{int(immediate)}.db"
    proc = subprocess.run([sys.executable, "-c", RACE, str(db), "1" if immediate else "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_prefects_deferred_transaction_fails_on_the_lock_the_other_writer_took(tmp_path):
    assert race(tmp_path, immediate=False) == "first:locked second:ok rows:1"


def test_immediate_transactions_wait_for_the_lock_and_both_commit(tmp_path):
    assert race(tmp_path, immediate=True) == "first:ok second:ok rows:2"
