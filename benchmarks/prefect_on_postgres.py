"""Run a benchmark with Prefect's embedded server on a throwaway PostgreSQL instead of its SQLite.

On SQLite, Prefect's server now and then answers a subflow's start with 503 (``database is
locked`` against its own background writers) and the client retries 2 s later; in a 20 s
benchmark run one retry moves the result by ~9 % (``docs/platform-notes.md``). This starts a
PostgreSQL in a temp dir (the tests' helper: ``initdb`` + ``pg_ctl``, loopback only, fsync off),
points ``PREFECT_API_DATABASE_CONNECTION_URL`` at a fresh database in it, runs the command, and
removes the cluster. The embedded server that every ``tidal run`` of the command starts honours it.

Usage:
    .venv/bin/python benchmarks/prefect_on_postgres.py benchmarks/bench_compare.py --presets training-bound --no-write
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT)]


def main(argv: list[str]) -> int:
    if not argv:
        print("error: give the benchmark to run, e.g. benchmarks/bench_compare.py --presets training-bound",
              file=sys.stderr)
        return 2
    from pg_support import running_postgres  # the tests' throwaway PostgreSQL

    with running_postgres() as pg:
        url = pg.new_database("prefect").replace("postgresql://", "postgresql+asyncpg://")
        env = dict(os.environ, PREFECT_API_DATABASE_CONNECTION_URL=url)
        return subprocess.run([sys.executable, *argv], env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
