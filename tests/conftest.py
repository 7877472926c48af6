"""Session-wide test environment: private Prefect home, Ray settings, markers; what killed drivers left is ended."""

from __future__ import annotations

import os
import tempfile

# Before anything imports prefect: never share (or lock) the developer's own Prefect database.
os.environ["PREFECT_HOME"] = os.environ.get("TIDAL_TEST_PREFECT_HOME") or tempfile.mkdtemp(prefix="tidal-test-prefect-")
os.environ.pop("PREFECT_API_URL", None)  # tests that want a server start their own
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402  (after the environment above, before any test imports prefect)


@pytest.fixture(autouse=True)
def _end_what_drivers_left(request):
    """After a test that ran drivers under its ``tmp_path``: end what their records
    (``<run dir>/driver/*.json``) still name. A SIGKILLed driver's Prefect server leads a session
    of its own, which the SIGKILL of the driver's process group does not reach."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is None:
        return
    runs = [records.parent for records in tmp.glob("**/driver") if records.is_dir()]
    if runs:
        from flows.lifecycle import end_leftovers

        for run_dir in runs:
            end_leftovers(run_dir)
