"""Session-wide test environment: private Prefect home, Ray settings, markers."""

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
