"""`python -m flows.serve`: serves the deployments of prefect.yaml and stops cleanly on SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from e2e_support import ROOT, client_env, on_server, stop_group

from flows.serve import deployment_specs

pytestmark = pytest.mark.slow


async def _served_since(names: list[str], since: datetime) -> dict[str, dict]:
    """Parameters of the named `training-run` deployments written to the server after ``since``."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    out = {}
    async with get_client() as client:
        for name in names:
            try:
                d = await client.read_deployment_by_name(f"training-run/{name}")
            except ObjectNotFound:
                continue
            if d.updated and d.updated >= since:
                out[name] = d.parameters
    return out


def test_serve_registers_the_prefect_yaml_deployments_and_exits_zero_on_sigint(prefect_server, tmp_path):
    expected = {s["name"]: s["parameters"] for s in deployment_specs()}
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.serve"], cwd=ROOT, env=client_env(prefect_server),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150  # serve imports the whole stack first (slow on a busy machine)
        served: dict = {}
        while time.monotonic() < deadline and served != expected and proc.poll() is None:
            time.sleep(1)
            served = on_server(prefect_server.api_url, _served_since, list(expected), since)
        assert served == expected, log.read_text()[-3000:]
        time.sleep(2)  # let the runner reach its polling loop
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        stop_group(proc, first=signal.SIGKILL)


def test_serve_refuses_an_unknown_deployment_name():
    with pytest.raises(SystemExit, match="unknown deployment"):
        deployment_specs(only=["no-such-preset"])
