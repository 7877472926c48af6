"""Fault campaign, the store's PostgreSQL restarted (not stopped) in the middle of a whole run.

`tidal run` (the preset ``TIDAL_FAULT_PRESET`` names, ``tiny-cpu`` by default) runs as its own
process on a local Ray cluster, phases in-process, its store on a real PostgreSQL. Once two steps
are committed the server is stopped (`pg_ctl stop -m immediate`: connections drop), kept down until
the run has noticed (its driver says it waits for the store) and a few seconds more, then started
again on the same port: a restart as the run sees it. The test proves that the run rides it
through, within ``storage.reconnect_timeout_s``:

- the driver exits 0 by itself, no resume: it said that the store was unreachable and that it
  answers again, and printed no traceback;
- the store holds steps 1..N once each, every step with its whole batch of consumed prompts, no
  prompt twice, and the test-only step-counting policy saw steps 1..N once each (its state
  would show a step applied twice or lost);
- `tidal runs` lists the run as finished with N/N steps.

Past the bound the run stops in one line with the resume command: that is the stopped-server test
(``test_fault_postgres_run.py``), unchanged.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.ray_cluster import LocalRayCluster
from config import load_config
from fault_report import record
from driver_support import final_state
from pg_support import committed_steps, rows_per_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POLICY_DIR = Path(__file__).resolve().parents[1] / "integration"  # step_counting_policy.py
STEPS = 6
RUN_TIMEOUT_S = 420.0
NOTICE_TIMEOUT_S = 60.0
EXTRA_DOWN_S = 3.0
RECONNECT_S = 60.0  # the bound of this run: a loaded machine's restart must stay well inside it
CLI = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"]


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(POLICY_DIR), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def cluster():
    """This module's Ray head; its workers import the test-only policy by `module:Class`."""
    head = LocalRayCluster(num_cpus=2, gpus=4, memory_gb=4.0, object_store_memory_gb=0.5,
                           env={"PYTHONPATH": _pythonpath()}).start()
    try:
        yield head
    finally:
        head.stop()


def _overrides(url: str, tmp_path: Path, ray_address: str) -> list[str]:
    return [
        f"storage.url={url}", f"storage.reconnect_timeout_s={RECONNECT_S}",
        f"trainer.default_local_dir={tmp_path}/restarted", f"ray.address={ray_address}",
        f"trainer.total_training_steps={STEPS}",
        "async_training.dynamic_schedule_policy=step_counting_policy:StepCountingPolicy",
        "async_training.trigger_parameter_sync_step=2", "actor_rollout_ref.rollout.response_length=8",
    ]


def test_postgresql_restarted_mid_run_is_ridden_through_and_every_prompt_is_trained_once(
        tmp_path, cluster, stoppable_pg, fault_preset):
    url = stoppable_pg.new_database("restarted")
    overrides = _overrides(url, tmp_path, cluster.address)
    per_step = load_config(fault_preset.name, [*fault_preset.overrides(), *overrides]).step_required_samples
    args = ["run", *fault_preset.cli_args(tmp_path), *(a for o in overrides for a in ("--set", o))]
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1", "PREFECT_LOGGING_LEVEL": "INFO"}
    env.pop("TIDAL_CRASH_AT", None)
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=env, stdout=o, stderr=e, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while committed_steps(url) < 2:
            assert proc.poll() is None, f"the run ended (code {proc.returncode}) before 2 steps:\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no 2 committed steps within {RUN_TIMEOUT_S:.0f} s"
            time.sleep(0.2)
        stoppable_pg.stop("immediate")
        stopped_at = time.monotonic()
        try:  # down until the run has met the outage (it says it waits), then a little longer
            while "waiting up to" not in err.read_text() + out.read_text():
                assert proc.poll() is None, f"the run ended (code {proc.returncode}) while the store was down:\n" \
                                            f"{err.read_text()[-3000:]}"
                assert time.monotonic() - stopped_at < NOTICE_TIMEOUT_S, "the run never noticed the store was down"
                time.sleep(0.2)
            noticed_s = time.monotonic() - stopped_at
            time.sleep(EXTRA_DOWN_S)
        finally:
            stoppable_pg.start()
        down_s = time.monotonic() - stopped_at
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end within {RUN_TIMEOUT_S:.0f} s of the restart:\n{err.read_text()[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if not stoppable_pg.running():
            stoppable_pg.start()

    log = out.read_text() + err.read_text()
    assert code == 0, log[-4000:]
    assert "answers again after" in log, log[-4000:]
    assert "Traceback" not in log, log[-5000:]

    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished"
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    per_table = rows_per_step(url, summary.uid, ("steps", "policy_states", "checkpoints", "consumed_prompts"))
    for table in ("steps", "policy_states", "checkpoints"):
        assert per_table[table] == {step: 1 for step in range(1, STEPS + 1)}, (table, per_table[table])
    assert per_table["consumed_prompts"] == {step: per_step for step in range(1, STEPS + 1)}
    assert len(prompts) == len(set(prompts)) == STEPS * per_step
    assert state.policy_state["steps_seen"] == list(range(1, STEPS + 1))

    listed = subprocess.run([*CLI, "runs", "--storage", url], capture_output=True, text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    (line,) = [ln for ln in listed.stdout.splitlines() if ln.startswith(summary.uid)]
    assert line.split()[1:4] == ["finished", "step_counting_policy:StepCountingPolicy", f"{STEPS}/{STEPS}"], line

    record("postgres_restarted_mid_run", injected=1, survived=1, runner="in-process", samples_lost=0,
           samples_duplicated=len(prompts) - len(set(prompts)), down_s=round(down_s, 1),
           noticed_s=round(noticed_s, 1), steps=STEPS, resumes=0)
