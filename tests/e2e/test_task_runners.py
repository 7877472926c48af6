"""Both task runners of the step flow: which one is picked, and where a phase really runs."""

from __future__ import annotations

import json
import sys

import pytest
from e2e_support import ROOT, client_env, kill_processes_mentioning, read_runs_of_flow, run_cmd

from config import load_config
from flows.runners import runner_kind


@pytest.mark.parametrize(
    ("choice", "api_url", "env_url", "expected"),
    [
        ("auto", None, None, "thread"),
        ("auto", "http://127.0.0.1:4200/api", None, "ray"),
        ("auto", None, "http://127.0.0.1:4200/api", "ray"),
        ("thread", "http://127.0.0.1:4200/api", None, "thread"),
        ("ray", None, None, "ray"),
    ],
)
def test_auto_picks_ray_exactly_when_a_prefect_server_is_configured(monkeypatch, choice, api_url, env_url, expected):
    if env_url:
        monkeypatch.setenv("PREFECT_API_URL", env_url)
    else:
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
    cfg = load_config("tiny-cpu", [f"prefect.task_runner={choice}", f"prefect.api_url={api_url or 'null'}"])
    assert runner_kind(cfg) == expected


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
    assert ray_side["runner"] == "RayTaskRunner"
    assert ray_side["ray_worker"] is True and ray_side["pid"] != probe["driver_pid"]
    assert ray_side["gcs_address"] == probe["gcs_address"]  # attached to the run's cluster, not a new one
    assert ray_side["actor_pid"] == probe["actor_pid"]  # and found the run's actor by name


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
        ("probe-ray", "Completed", ("probe",)), ("probe-thread", "Completed", ("probe",))]
