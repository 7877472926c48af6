"""`python -m flows.serve`: serves prefect.yaml's deployments, runs them, stops on one SIGINT."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from e2e_support import PREFECT, ROOT, client_env, kill_processes_mentioning, on_server, run_cmd, run_overrides, stop_group

from flows.serve import deployment_specs

pytestmark = pytest.mark.slow

SERVE = [sys.executable, "-m", "flows.serve"]


async def _bind_to_a_work_pool(name: str) -> None:
    """What `prefect deploy` leaves behind: training-run/<name> on the process pool."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async with get_client() as client:
        try:
            await client.create_work_pool(WorkPoolCreate(name="tidal-process", type="process"))
        except ObjectAlreadyExists:
            pass
        flow_id = await client.create_flow_from_name("training-run")
        await client.create_deployment(flow_id=flow_id, name=name, work_pool_name="tidal-process",
                                       entrypoint="flows/training_run.py:training_run")


async def _served_since(name: str, since: datetime) -> dict | None:
    """The parameters of training-run/<name> if it was (re)written after ``since`` with no work pool."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            d = await client.read_deployment_by_name(f"training-run/{name}")
        except ObjectNotFound:
            return None
    return d.parameters if d.updated and d.updated >= since and not d.work_pool_name else None


def test_serve_refuses_names_that_a_work_pool_already_holds(prefect_server):
    env = client_env(prefect_server)
    on_server(prefect_server.api_url, _bind_to_a_work_pool, "tiny-cpu")
    refused = run_cmd([*SERVE, "--only", "tiny-cpu"], env, 120)
    assert refused.returncode == 2 and "prefect deployment delete" in refused.stdout, refused.stdout
    freed = run_cmd([*PREFECT, "deployment", "delete", "training-run/tiny-cpu"], env, 60)
    assert freed.returncode == 0, freed.stdout


def test_a_served_deployment_runs_and_one_sigint_stops_serve(prefect_server, short_tmp, tmp_path):
    env = client_env(prefect_server)
    run_cmd([*PREFECT, "deployment", "delete", "training-run/tiny-cpu"], env, 60)  # whoever held it
    expected = next(s["parameters"] for s in deployment_specs(only=["tiny-cpu"]))
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    out = short_tmp / "served"
    out.mkdir()
    log = tmp_path / "serve.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*SERVE, "--only", "tiny-cpu"], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150  # serve imports the whole stack first (slow on a busy machine)
        served = None
        while served is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)
            served = on_server(prefect_server.api_url, _served_since, "tiny-cpu", since)
        assert served == expected, log.read_text()[-3000:]
        triggered = run_cmd([*PREFECT, "deployment", "run", "training-run/tiny-cpu",
                             "--param", f"overrides={json.dumps(run_overrides(out, 1))}",
                             "--watch", "--watch-interval", "2", "--watch-timeout", "150"], env, 180)
        assert triggered.returncode == 0, triggered.stdout[-3000:] + log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)  # once, to serve itself: it must stop even after running a flow
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, log.read_text()[-3000:]
    finally:
        stop_group(proc, first=signal.SIGKILL)
        kill_processes_mentioning(str(out))


def test_serve_refuses_an_unknown_deployment_name():
    with pytest.raises(SystemExit, match="unknown deployment"):
        deployment_specs(only=["no-such-preset"])
