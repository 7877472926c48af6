"""Kill the driver (SIGKILL) at several points of a run; `tidal resume` must end exactly where an
uninterrupted run with the same seed ends: same policy state, step count and trained prompts,
no step committed twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from storage import load_resume_state, make_engine, run_summaries, session_scope
from storage.store import consumed_prompts, step_metrics

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
STEPS = 5
# (crash point, step) for each successive process of the interrupted run; the last one finishes.
CRASHES = ["wait_for_samples:2", "train:3", "broadcast_sync:3", "commit_step:4"]


def _tidal(args, tmp_path, crash=None, timeout=240):
    """Run the CLI in its own process group; afterwards end whatever it left behind (a SIGKILLed
    driver orphans its ephemeral Prefect server), by that group id only."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TIDAL_CRASH_AT", None)
    if crash:
        env["TIDAL_CRASH_AT"] = crash
    cmd = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))", *args]
    log = tmp_path / f"cli-{len(list(tmp_path.glob('cli-*.log')))}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return code, log.read_text()


def _config_args(tmp_path, ray_address, name):
    return [
        "--set", f"storage.url=sqlite:///{tmp_path}/{name}.db", "--set", f"trainer.default_local_dir={tmp_path}/{name}",
        "--set", f"ray.address={ray_address}", "--set", f"trainer.total_training_steps={STEPS}",
        "--set", "async_training.dynamic_schedule_policy=step_counting_policy:StepCountingPolicy",
        "--set", "async_training.trigger_parameter_sync_step=2", "--set", "actor_rollout_ref.rollout.response_length=8",
    ]


def _final(tmp_path, name):
    engine = make_engine(f"sqlite:///{tmp_path}/{name}.db")
    with session_scope(engine) as s:
        (summary,) = run_summaries(s)
        state = load_resume_state(s, summary.uid)
        rows = step_metrics(s, summary.uid)
        prompts = consumed_prompts(s, summary.uid)
    return summary, state, rows, prompts


def test_a_run_killed_at_every_phase_resumes_to_the_uninterrupted_result(tmp_path, ray_address):
    code, log = _tidal(["run", "tiny-cpu", *_config_args(tmp_path, ray_address, "straight")], tmp_path)
    assert code == 0, log[-3000:]

    args = _config_args(tmp_path, ray_address, "crashed")
    code, log = _tidal(["run", "tiny-cpu", *args], tmp_path, crash=CRASHES[0])
    assert code == -signal.SIGKILL, log[-3000:]
    summary, *_ = _final(tmp_path, "crashed")
    store = ["--storage", f"sqlite:///{tmp_path}/crashed.db"]
    for crash in [*CRASHES[1:], None]:
        code, log = _tidal(["resume", summary.uid, *store], tmp_path, crash=crash)
        assert code == (-signal.SIGKILL if crash else 0), log[-3000:]

    want_summary, want_state, want_rows, want_prompts = _final(tmp_path, "straight")
    got_summary, got_state, got_rows, got_prompts = _final(tmp_path, "crashed")
    assert got_summary.status == want_summary.status == "finished"
    assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows] == list(range(1, STEPS + 1))
    assert got_state.policy_state == want_state.policy_state
    assert got_state.policy_state["steps_seen"] == list(range(1, STEPS + 1))
    assert sorted(got_prompts) == sorted(want_prompts)
    assert len(got_prompts) == len(set(got_prompts))
