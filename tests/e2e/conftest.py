"""End-to-end fixtures: a short temp dir under /tmp and a real local Prefect server.

Everything the e2e tests start gets its own temp dir (Prefect home; Ray temp dir under /tmp, as
Ray's unix sockets cap the path length), a free loopback port and a timeout, and is ended by its
pid at the end (see ``e2e_support``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import kill_processes_mentioning

from flows.prefect_server import LocalPrefectServer


@pytest.fixture(scope="session")
def short_tmp() -> Iterator[Path]:
    """A short, unique folder under /tmp (Ray temp dirs live here); cleaned with what mentions it."""
    path = Path(tempfile.mkdtemp(prefix="tidal-e2e-", dir="/tmp"))
    yield path
    kill_processes_mentioning(str(path))
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[LocalPrefectServer]:
    """A real Prefect server on a free loopback port, with its own PREFECT_HOME; stopped by its pid."""
    server = LocalPrefectServer(home=str(tmp_path_factory.mktemp("prefect-home")))
    server.start(timeout_s=120)
    try:
        yield server
    finally:
        server.stop()
