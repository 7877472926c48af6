"""A deployment triggered with `prefect deployment run` against a real local Prefect server.

The module fixture does what docs/deployment.md does, on a private
server: create the process work pool, `prefect deploy` from `deployments/prefect.yaml`, start a
worker, trigger `training-run/tiny-cpu` for a few steps with `prefect deployment run --param`
(and `--watch` until it ends). The tests then read the run back through the Prefect client API
and compare it with the Tidal store the run wrote.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_support import (
    PREFECT,
    ROOT,
    client_env,
    expected_phases,
    kill_processes_mentioning,
    read_flow_run,
    read_logs,
    read_step_runs,
    run_cmd,
    run_overrides,
    stop_group,
    step_of,
    step_run_names,
    store_decisions,
)

from config import load_config

pytestmark = pytest.mark.slow

STEPS = 3
TRIGGER = load_config("tiny-cpu").async_training.trigger_parameter_sync_step


@dataclass(frozen=True)
class DeployedRun:
    api_url: str
    flow_run_id: str
    trigger: subprocess.CompletedProcess
    store: Path
    worker_log: str


@pytest.fixture(scope="module")
def deployed_run(prefect_server, short_tmp) -> DeployedRun:
    tmp = short_tmp / "deployed"
    tmp.mkdir()
    env = client_env(prefect_server)
    pool = run_cmd([*PREFECT, "work-pool", "create", "tidal-process", "--type", "process"], env, 60)
    assert pool.returncode == 0, pool.stdout
    deploy = run_cmd([*PREFECT, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
                      "--name", "tiny-cpu"], env, 120)
    assert deploy.returncode == 0, deploy.stdout
    worker_log = tmp / "worker.log"
    with open(worker_log, "w") as log:
        worker = subprocess.Popen([*PREFECT, "worker", "start", "--pool", "tidal-process", "--limit", "1"],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            trigger = run_cmd([*PREFECT, "deployment", "run", "training-run/tiny-cpu",
                               "--param", f"overrides={json.dumps(run_overrides(tmp, STEPS))}",
                               "--watch", "--watch-interval", "2", "--watch-timeout", "200"], env, 230)
        finally:
            stop_group(worker)
            kill_processes_mentioning(str(tmp))  # the run's Ray cluster, if the run died holding it
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", trigger.stdout)
    assert found, trigger.stdout
    return DeployedRun(prefect_server.api_url, found.group(1), trigger, tmp / "tidal.db",
                       worker_log.read_text(errors="replace")[-6000:])


def test_a_deployment_run_triggered_from_the_cli_completes(deployed_run):
    assert deployed_run.trigger.returncode == 0, deployed_run.trigger.stdout + deployed_run.worker_log
    flow_run = read_flow_run(deployed_run.api_url, deployed_run.flow_run_id)
    assert (flow_run.state_name, flow_run.parameters["config"]) == ("Completed", "tiny-cpu")


def test_the_run_says_its_phases_ran_on_the_ray_task_runner(deployed_run):
    logs = read_logs(deployed_run.api_url, deployed_run.flow_run_id)
    assert any("phases run on RayTaskRunner" in line for line in logs), logs


def test_the_api_lists_one_step_flow_run_per_step_with_its_phases_in_the_documented_order(deployed_run):
    steps = read_step_runs(deployed_run.api_url, deployed_run.flow_run_id, STEPS)
    active_after, _, deactivated = store_decisions(deployed_run.store)
    assert [(s.name, s.state) for s in steps] == [(name, "Completed") for name in step_run_names(deployed_run.store, STEPS)]
    assert [s.phases for s in steps] == [
        expected_phases(TRIGGER, deactivated.get(i, False), active_after[i], final=i == STEPS,
                        lent=active_after.get(i - 1, False))
        for i in range(1, STEPS + 1)
    ]


def test_hybrid_sync_is_absent_exactly_on_the_steps_where_the_policy_did_not_activate(deployed_run):
    steps = read_step_runs(deployed_run.api_url, deployed_run.flow_run_id, STEPS)
    active_after, should_activate, _ = store_decisions(deployed_run.store)
    synced = {step_of(s.name): "hybrid_sync" in s.phases for s in steps}
    assert len(synced) == STEPS
    assert synced.pop(STEPS) is False and STEPS not in should_activate  # the last step asks no lend
    assert synced == should_activate == {s: a for s, a in active_after.items() if s != STEPS}
