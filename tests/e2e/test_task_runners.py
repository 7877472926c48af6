"""Both task runners of the step flow: which one is picked, and where a phase really runs."""

from __future__ import annotations

import json
import sys

import pytest
from e2e_support import ROOT, client_env, kill_processes_mentioning, read_runs_of_flow, run_cmd

from config import load_config
from flows.runners import prefect_settings_for, runner_kind


@pytest.mark.parametrize(
    ("choice", "env_url", "expected"),
    [
        ("auto", None, "thread"),
        ("auto", "http://127.0.0.1:4200/api", "ray"),
        ("thread", "http://127.0.0.1:4200/api", "thread"),
        ("ray", None, "ray"),
    ],
)
def test_auto_picks_ray_exactly_when_prefect_talks_to_a_server(choice, env_url, expected):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    cfg = load_config("tiny-cpu", [f"prefect.task_runner={choice}"])
    with temporary_settings(updates={PREFECT_API_URL: env_url}):
        assert runner_kind(cfg) == expected


def test_prefect_api_url_from_the_config_points_the_client_at_that_server():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    cfg = load_config("tiny-cpu", ["prefect.api_url=http://127.0.0.1:4200/api"])
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert runner_kind(cfg) == "thread"  # named in the config but not applied: still embedded
        with prefect_settings_for(cfg):
            assert (PREFECT_API_URL.value(), runner_kind(cfg)) == ("http://127.0.0.1:4200/api", "ray")


@pytest.fixture(scope="module")
def probe(prefect_server, short_tmp) -> dict:
    ray_dir = short_tmp / "probe-ray"
    try:
        done = run_cmd([sys.executable, str(ROOT / "tests" / "e2e" / "runner_probe.py"), str(ray_dir)],
                       client_env(prefect_server), 180)
    finally:
        kill_processes_mentioning(str(ray_dir))
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-4000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


@pytest.mark.slow
def test_the_ray_runner_runs_a_phase_on_a_worker_of_the_runs_own_cluster(probe):
    ray_side = probe["ray"]
    assert ray_side["runner"] == "PhaseRayTaskRunner"  # prefect-ray's RayTaskRunner, one client per worker
    assert ray_side["ray_worker"] is True and ray_side["pid"] != probe["driver_pid"]
    assert ray_side["gcs_address"] == probe["gcs_address"]  # attached to the run's cluster, not a new one
    assert ray_side["actor_pid"] == probe["actor_pid"]  # and found the run's actor by name


@pytest.mark.slow
def test_phases_on_the_same_ray_worker_share_one_prefect_client(probe):
    clients_by_worker: dict[int, set[int]] = {}
    for phase in [probe["ray"], *probe["ray"]["rest"]]:
        clients_by_worker.setdefault(phase["pid"], set()).add(phase["client"])
    assert len(clients_by_worker) < 4  # sequential phases reuse idle workers
    assert all(len(clients) == 1 for clients in clients_by_worker.values()), clients_by_worker


@pytest.mark.slow
def test_the_thread_runner_runs_a_phase_in_the_flows_own_process(probe):
    thread_side = probe["thread"]
    assert thread_side["runner"] == "ThreadPoolTaskRunner"
    assert (thread_side["pid"], thread_side["ray_worker"]) == (probe["driver_pid"], False)
    assert thread_side["actor_pid"] == probe["actor_pid"]


@pytest.mark.slow
def test_both_runners_record_their_phase_as_a_task_run_on_the_server(probe, prefect_server):
    runs = read_runs_of_flow(prefect_server.api_url, "runner-probe")
    assert [(r.name, r.state, r.phases) for r in runs] == [
        ("probe-ray", "Completed", ("probe",) * 4), ("probe-thread", "Completed", ("probe",) * 4)]
