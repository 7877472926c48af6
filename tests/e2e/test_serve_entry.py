"""`python -m flows.serve`: serves the deployments of prefect.yaml and stops cleanly on SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from e2e_support import ROOT, client_env, on_server, stop_group

from flows.serve import deployment_specs

pytestmark = pytest.mark.slow


async def _served(names: list[str]) -> dict[str, tuple[dict, str | None]]:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    out = {}
    async with get_client() as client:
        for name in names:
            try:
                d = await client.read_deployment_by_name(f"training-run/{name}")
            except ObjectNotFound:
                continue
            out[name] = (d.parameters, d.work_pool_name)
    return out


def test_serve_registers_the_prefect_yaml_deployments_and_exits_zero_on_sigint(prefect_server, tmp_path):
    specs = deployment_specs()
    expected = {s["name"]: (s["parameters"], None) for s in specs}  # served: no work pool
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.serve"], cwd=ROOT, env=client_env(prefect_server),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        served: dict = {}
        while time.monotonic() < deadline and served != expected and proc.poll() is None:
            time.sleep(1)
            served = on_server(prefect_server.api_url, _served, list(expected))
        assert served == expected, log.read_text()[-3000:]
        time.sleep(2)  # let the runner reach its polling loop
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        stop_group(proc, first=signal.SIGKILL)


def test_serve_refuses_an_unknown_deployment_name():
    with pytest.raises(SystemExit, match="unknown deployment"):
        deployment_specs(only=["no-such-preset"])
