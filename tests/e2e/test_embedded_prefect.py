"""`tidal run` with no Prefect server: embedded Prefect, in-process task runner.

The run writes its flow runs into its own ``PREFECT_HOME``; a server started afterwards on that
home shows them (as the README promises), with the same step flow runs and phase order as the
Ray task runner path.
"""

from __future__ import annotations

import pytest
from e2e_support import (
    TIDAL,
    client_env,
    expected_phases,
    kill_processes_mentioning,
    read_logs,
    read_runs_of_flow,
    read_step_runs,
    run_cmd,
    run_overrides,
    store_decisions,
)

from config import load_config
from flows.prefect_server import LocalPrefectServer

pytestmark = pytest.mark.slow

STEPS = 3
TRIGGER = load_config("tiny-cpu").async_training.trigger_parameter_sync_step


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory, short_tmp):
    home = tmp_path_factory.mktemp("embedded-prefect-home")
    tmp = short_tmp / "embedded"
    tmp.mkdir()
    sets = [arg for o in run_overrides(tmp, STEPS) for arg in ("--set", o)]
    try:
        done = run_cmd([*TIDAL, "run", "tiny-cpu", *sets], client_env(None, home=home), 240)
    finally:
        kill_processes_mentioning(str(tmp))
    assert done.returncode == 0, done.stdout[-4000:]
    with LocalPrefectServer(home=str(home)) as server:  # started later, on the run's Prefect home
        [parent] = read_runs_of_flow(server.api_url, "training-run")
        yield {"parent": parent, "steps": read_step_runs(server.api_url, parent.id, STEPS),
               "logs": read_logs(server.api_url, parent.id), "store": tmp / "tidal.db", "stdout": done.stdout}


def test_the_cli_prints_progress_for_every_step(embedded_run):
    progress = [line.split()[:2] for line in embedded_run["stdout"].splitlines() if line.startswith("step ")]
    assert progress == [["step", f"{i}/{STEPS}"] for i in range(1, STEPS + 1)]


def test_the_run_says_its_phases_ran_in_process(embedded_run):
    assert embedded_run["parent"].state == "Completed"
    assert any("phases run on ThreadPoolTaskRunner" in line for line in embedded_run["logs"])


def test_a_server_started_later_shows_every_step_with_its_phases_in_the_documented_order(embedded_run):
    steps = embedded_run["steps"]
    active_after, should_activate, deactivated = store_decisions(embedded_run["store"])
    assert [(s.name, s.state) for s in steps] == [(f"step-{i:05d}", "Completed") for i in range(1, STEPS + 1)]
    assert [s.phases for s in steps] == [
        expected_phases(TRIGGER, deactivated.get(i, False), active_after[i]) for i in range(1, STEPS + 1)
    ]
    assert {i: "hybrid_sync" in s.phases for i, s in enumerate(steps, 1)} == should_activate
