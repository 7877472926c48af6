"""Fault campaign, the Prefect API server killed in the middle of a run (``flows.driver.ApiWatch``).

- Tidal's own temporary server (the one `tidal run` starts when no Prefect API is configured):
  SIGKILLed once step 1 has committed, it is started again by the driver on the same port and
  database, and the run carries on to exit 0 with no resume: steps 1..STEPS committed once each,
  no prompt trained twice. The one case CI runs (~1-2 min on a loaded 2-core machine).
- A `prefect server start` of the user's (the run pointed at it with ``PREFECT_API_URL``), only in
  the fault campaign (``TIDAL_FAULT_REPORT``): SIGKILLed after step 1 and started again by the
  test 8 s later, the run waits for it and carries on; SIGKILLed again after step 3 and left
  down, the run stops once ``prefect.api_outage_timeout_s`` has passed, with exit 3 and one line
  naming the resume command; with the server back, `tidal resume` ends where an uninterrupted run
  of the same config ends (same policy state, the same prompts, none twice)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from driver_support import (assert_resumed_exactly, cli_env, config_args, end_group, final_state, next_log, run_tidal,
                            start, steps_committed, store_url)
from fault_report import ENV as REPORT_ENV
from fault_report import record

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 4
CAMPAIGN_STEPS = 5  # the session's uninterrupted run of 5 steps (tests/integration/test_resume.py's)
OUTAGE_S = 30  # prefect.api_outage_timeout_s of the user's-server case



def _until(what: Callable[[], Any], proc: Any, timeout_s: float, why: str) -> Any:
    """``what()``'s first truthy value, polled while the driver ``proc`` lives."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        assert proc.poll() is None, f"the driver exited ({proc.returncode}) before {why}"
        time.sleep(0.2)
    raise AssertionError(f"no {why} within {timeout_s:.0f} s")


def _alive(pid: int, wait_s: float = 10.0) -> bool:
    """Whether ``pid`` is still a live (not zombie) process after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z" or time.monotonic() > deadline:
            return state != "Z"
        time.sleep(0.2)


def _server_pid(out_dir: Path) -> int | None:
    """The pid in the run's ``prefect-server`` record (``flows.driver``: Tidal's own server)."""
    for path in out_dir.glob("*/driver/prefect-server.json"):
        try:
            return int(json.loads(path.read_text())["procs"][0][0])
        except (OSError, ValueError, KeyError, IndexError):
            return None
    return None


def _run_states(api_url: str, uid: str) -> list[str]:
    """The states of the ``training-run`` flow runs named ``uid`` on the server at ``api_url``, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[uid])),
                                     sort=FlowRunSort.START_TIME_ASC)
    return [run.state.type.value for run in runs]


def test_tidals_own_prefect_server_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path, ray_address):
    url = store_url(tmp_path, "own")
    log = next_log(tmp_path)
    with open(log, "w") as out:
        proc = start(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "own", STEPS)], tmp_path, out, cli_env())
        try:
            pid = _until(lambda: steps_committed(url) >= 1 and _server_pid(tmp_path / "own"), proc, 400,
                         "step 1's commit")
            os.kill(pid, signal.SIGKILL)  # the server only: the run must notice by itself
            code = proc.wait(timeout=600)
        finally:
            end_group(proc)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert f"Tidal's Prefect server (pid {pid}) died mid-run" in text, text[-3000:]
    back = re.search(r"Tidal's Prefect server is back \(pid (\d+)\)", text)
    assert back, text[-3000:]
    assert not _alive(int(back.group(1))), "the restarted server outlived the run"
    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished"
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert state.policy_state["steps_seen"] == list(range(1, STEPS + 1))
    assert prompts and len(prompts) == len(set(prompts))
    record("prefect_server_kill", injected=1, survived=1, samples_duplicated=len(prompts) - len(set(prompts)),
           server="tidal's own", outcome="restarted on the same port and database; the run carried on")


@pytest.mark.skipif(not os.environ.get(REPORT_ENV), reason="the fault campaign's (TIDAL_FAULT_REPORT): minutes")
def test_a_users_prefect_server_killed_mid_run_is_waited_for_then_the_run_stops_in_one_line_and_resumes(
        tmp_path, ray_address, uninterrupted):
    from flows.prefect_server import LocalPrefectServer

    straight = store_url(uninterrupted(CAMPAIGN_STEPS), "straight")
    url = store_url(tmp_path, "user")
    server = LocalPrefectServer(home=str(tmp_path / "prefect-home"), factory=None).start(timeout_s=240)

    def kill_server() -> None:
        os.killpg(server.pid, signal.SIGKILL)  # `prefect server start` and its uvicorn
        server._proc.wait()

    try:
        env = server.env(cli_env())
        args = ["run", "tiny-cpu", *config_args(tmp_path, ray_address, "user", CAMPAIGN_STEPS),
                "--set", f"prefect.api_outage_timeout_s={OUTAGE_S}"]
        log = next_log(tmp_path)
        with open(log, "w") as out:
            proc = start(args, tmp_path, out, env)
            try:
                _until(lambda: steps_committed(url) >= 1, proc, 400, "step 1's commit")
                kill_server()
                time.sleep(8)  # down for a while, well within prefect.api_outage_timeout_s
                server.restart(timeout_s=240)
                _until(lambda: steps_committed(url) >= 3, proc, 600, "step 3's commit after the first outage")
                kill_server()  # and left down
                killed_at = time.monotonic()
                code = proc.wait(timeout=OUTAGE_S + 240)
                stopped_after_s = time.monotonic() - killed_at
            finally:
                end_group(proc)
        text = log.read_text()
        assert code == 3, text[-3000:]
        last = text.strip().splitlines()[-1]
        summary, state, *_ = final_state(url)
        assert last.startswith("tidal: error: the Prefect API at") and "prefect.api_outage_timeout_s" in last, last
        assert f"resume with: tidal resume {summary.uid} --storage '{url}'" in last, last
        assert "answers again" in text  # the first outage was waited out
        assert state.step >= 3

        server.restart(timeout_s=240)
        code, text = run_tidal(["resume", summary.uid, "--storage", url], tmp_path, timeout=600, extra=env)
        assert code == 0, text[-3000:]
        # the UI caught up: the stopped driver's flow run is Crashed (the resume marked it), the resume's Completed
        assert _run_states(server.api_url, summary.uid) == ["CRASHED", "COMPLETED"]
    finally:
        server.stop()
    lost, duplicated = assert_resumed_exactly(straight, url, CAMPAIGN_STEPS)
    record("prefect_server_kill", injected=2, survived=2, samples_lost=lost, samples_duplicated=duplicated,
           server="prefect server start (the user's)", outage_timeout_s=OUTAGE_S,
           stopped_after_s=round(stopped_after_s, 1),
           outcome="waited out an 8 s outage; stopped with exit 3 and the resume line on a lasting one; resumed")
