"""End-to-end fixtures: a short temp dir under /tmp, an embedded-Prefect run, a real Prefect server.

Everything the e2e tests start gets its own temp dir (Prefect home; Ray temp dir under /tmp, as
Ray's unix sockets cap the path length), a free loopback port and a timeout, and is ended by its
pid at the end (see ``e2e_support``).

The session's Prefect server is started on the Prefect home of a `tidal run` made just before it
with no server (embedded Prefect, in-process task runner): one server start instead of two, and
the embedded run's flow runs showing up in it is what ``test_embedded_prefect`` checks.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_support import EMBEDDED_OVERLAP, EMBEDDED_STEPS, TIDAL, client_env, kill_processes_mentioning, run_cmd, run_overrides

from driver_support import pythonpath, seed_prefect_home

from flows.prefect_server import LocalPrefectServer



@dataclass(frozen=True)
class EmbeddedRun:
    home: Path  # its PREFECT_HOME
    out: Path  # its store, outputs and Ray temp dir
    done: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def short_tmp() -> Iterator[Path]:
    """A short, unique folder under /tmp (Ray temp dirs live here); cleaned with what mentions it."""
    path = Path(tempfile.mkdtemp(prefix="tidal-e2e-", dir="/tmp"))
    yield path
    kill_processes_mentioning(str(path))
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_run(tmp_path_factory, short_tmp) -> EmbeddedRun:
    """`tidal run tiny-cpu` for a few steps with no Prefect server, in its own PREFECT_HOME, with
    the hybrid sync overlapped with the broadcast (the deployed run keeps the reference's order)
    and the step-counting policy, which lends after odd steps whatever the machine's speed."""
    home = seed_prefect_home(tmp_path_factory.mktemp("prefect-home"))
    out = short_tmp / "embedded"
    out.mkdir()
    sets = [arg for o in [*run_overrides(out, EMBEDDED_STEPS), *EMBEDDED_OVERLAP] for arg in ("--set", o)]
    env = {**client_env(None, home=home), "PYTHONPATH": pythonpath()}  # the step-counting policy
    try:
        done = run_cmd([*TIDAL, "run", "tiny-cpu", *sets], env, 240)
    finally:
        kill_processes_mentioning(str(out))  # its Ray cluster, if it died holding it
    return EmbeddedRun(home, out, done)


@pytest.fixture(scope="session")
def prefect_server(embedded_run) -> Iterator[LocalPrefectServer]:
    """A real Prefect server on a free loopback port, on the embedded run's PREFECT_HOME; stopped by its pid."""
    server = LocalPrefectServer(home=str(embedded_run.home))
    server.start(timeout_s=120)
    try:
        yield server
    finally:
        server.stop()
