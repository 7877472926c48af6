"""A Tidal-started Prefect server (``flows.prefect_server``): its event loop and HTTP parser, its
batched task-run and event writes, and that a clean stop loses none of the batched rows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from driver_support import seed_prefect_home

from flows.prefect_server import BATCHED_WRITES, LocalPrefectServer

ROOT = Path(__file__).resolve().parents[2]

COMMAND = "from flows.prefect_app import server_command; print(' '.join(server_command(1234)))"


def _server_command(extra_path: Path | None = None) -> str:
    path = f"{extra_path}:{ROOT}" if extra_path else str(ROOT)
    proc = subprocess.run([sys.executable, "-c", COMMAND], cwd=ROOT, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip()


def test_server_runs_on_uvloop_and_httptools_when_installed():
    assert _server_command().endswith("--loop uvloop --http httptools")


def test_server_falls_back_to_asyncio_and_h11_without_them(tmp_path):
    for name in ("uvloop", "httptools"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('not installed here')\n")
    assert _server_command(tmp_path).endswith("--loop asyncio --http h11")


def test_tidal_server_batches_writes_and_a_value_in_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL", "7")
    _, env = LocalPrefectServer(home=str(tmp_path)).command()
    assert env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == BATCHED_WRITES[
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] != "1"  # Prefect's own: one row a transaction
    assert env["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL"] == "7"
    assert float(env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"]) >= 1  # Prefect int()s it: 0 spins


def test_prefect_server_start_keeps_prefects_own_settings(tmp_path, monkeypatch):
    for key in BATCHED_WRITES:
        monkeypatch.delenv(key, raising=False)
    cmd, env = LocalPrefectServer(home=str(tmp_path), factory=None).command()
    assert cmd[1:5] == ["-m", "prefect", "server", "start"]
    assert not set(BATCHED_WRITES) & set(env)


# A flow of 3 subflows of 4 tasks each against the server, then the task runs' count.
FLOW = textwrap.dedent("""
    import sys
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(cache_policy=NO_CACHE, persist_result=False)
    def phase(i):
        return i

    @flow
    def step(n):
        return [phase.submit(i).result() for i in range(4)]

    @flow
    def run():
        for n in range(3):
            step(n)

    run()
""")
READ = textwrap.dedent("""
    import asyncio
    from prefect.client.orchestration import get_client

    async def main():
        async with get_client() as client:
            runs = await client.read_task_runs(limit=200)
            print(sum(1 for r in runs if r.name.startswith("phase")), sum(1 for r in runs if r.state_name == "Completed"))

    asyncio.run(main())
""")


@pytest.mark.slow
def test_batched_task_runs_are_all_written_by_a_clean_stop(tmp_path, monkeypatch):
    """Every task run reaches the database although the recorder writes in batches: the ones still
    queued when the server stops are flushed on the way down (read back by a second server). The
    first server's periodic flush is set beyond the test's length, so only the final one writes."""
    home = seed_prefect_home(tmp_path / "home")
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "3600")
    with LocalPrefectServer(home=str(home)) as server:
        subprocess.run([sys.executable, "-c", FLOW], cwd=ROOT, env={**server.env(), "PYTHONPATH": str(ROOT)},
                       check=True, timeout=300, capture_output=True)
    monkeypatch.delenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL")
    with LocalPrefectServer(home=str(home)) as server:
        out = subprocess.run([sys.executable, "-c", READ], cwd=ROOT, env={**server.env(), "PYTHONPATH": str(ROOT)},
                             check=True, timeout=120, capture_output=True, text=True).stdout.split()
    phases, completed = int(out[0]), int(out[1])
    assert phases == 12
    assert completed == 12 + 3  # and the subflows' stand-in task runs in the parent
