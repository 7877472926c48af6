"""Several runs on one platform: four `tidal run`s at once against one PostgreSQL store and one
Prefect server (issue 47).

One Ray head (8 emulated GPUs: each run takes one trainer and one rollout GPU), one PostgreSQL
database, one Prefect server; four drivers started together, each with its own output folder and
run id (its own Ray namespace), phases on threads (``prefect.task_runner=thread``: the point is
the shared server and store, and four runs' phases as Ray tasks would not fit two cores). The test
proves that:

- all four exit 0; while they run, `tidal runs` lists each one `running` (or `finished` once its
  last step is in), and afterwards all four `finished`, STEPS/STEPS;
- each run's records are its own: steps 1..STEPS once each under its run id, each step with its own
  whole batch of consumed prompts (none twice within the run), its policy state counting its own
  steps only;
- nothing of one run is visible in another's: each `report.md` names its own run and none of the
  other three, and its step table is its own steps' wall times; in the Prefect server each run's
  step-table artifact has its own STEPS rows, and each run's step flow runs are named after it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from cluster.ray_cluster import LocalRayCluster
from config import load_config
from fault_preset import RANKS_ENV
from fault_report import record
from driver_support import seed_prefect_home
from flows.prefect_server import LocalPrefectServer
from storage import load_resume_state, make_engine, run_summaries, session_scope
from storage.store import consumed_prompts, read_step_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

POLICY_DIR = Path(__file__).resolve().parents[1] / "integration"  # step_counting_policy.py
RUNS = 4
STEPS = 3
RUN_TIMEOUT_S = 900.0
CLI = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"]


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(POLICY_DIR), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def cluster():
    ranks = os.environ.get(RANKS_ENV, "").strip()  # a campaign's trainer of N ranks: N + 1 GPUs a run
    per_run = 1 + (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1)
    head = LocalRayCluster(num_cpus=2, gpus=per_run * RUNS, memory_gb=8.0, object_store_memory_gb=0.5,
                           env={"PYTHONPATH": _pythonpath()}).start()
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    server = LocalPrefectServer(home=str(seed_prefect_home(tmp_path_factory.mktemp("prefect-home"))))
    server.start(timeout_s=180)
    try:
        yield server
    finally:
        server.stop()


def _runs_lines(url: str, env: dict) -> list[str]:
    listed = subprocess.run([*CLI, "runs", "--storage", url], capture_output=True, text=True, env=env, timeout=180)
    assert listed.returncode == 0, listed.stderr[-2000:]
    return listed.stdout.splitlines()[1:]  # under the header


def _committed(url: str) -> dict[str, int]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(sa.text(
                "SELECT r.uid, count(s.id) FROM runs r LEFT JOIN steps s ON s.run_id = r.id GROUP BY r.uid")).all())
    except sa.exc.SQLAlchemyError:  # no tables yet
        return {}
    finally:
        engine.dispose()


def _step_artifact_rows(server: LocalPrefectServer, uid: str) -> int:
    """Rows of the latest `<run>-steps` table artifact in the server."""
    import json
    import urllib.request

    from tasks.artifact import artifact_key

    body = json.dumps({"artifacts": {"key": {"any_": [artifact_key(uid, "steps")]}}, "sort": "CREATED_DESC",
                       "limit": 1}).encode()
    req = urllib.request.Request(f"{server.api_url}/artifacts/filter", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        (artifact,) = json.loads(response.read())
    data = artifact["data"]
    return len(json.loads(data) if isinstance(data, str) else data)


def _flow_run_names(server: LocalPrefectServer) -> list[str]:
    import json
    import urllib.request

    req = urllib.request.Request(f"{server.api_url}/flow_runs/filter", data=json.dumps({"limit": 200}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        return [r["name"] for r in json.loads(response.read())]


def test_four_runs_at_once_on_one_store_and_one_prefect_server_each_keep_their_own_records(
        tmp_path, cluster, prefect_server, stoppable_pg, fault_preset):
    url = stoppable_pg.new_database("four_runs")
    env = {**prefect_server.env(), "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1"}
    env.pop("TIDAL_CRASH_AT", None)
    common = [
        f"storage.url={url}", f"ray.address={cluster.address}", f"trainer.total_training_steps={STEPS}",
        f"prefect.api_url={prefect_server.api_url}", "prefect.task_runner=thread",
        "async_training.dynamic_schedule_policy=step_counting_policy:StepCountingPolicy",
        "async_training.trigger_parameter_sync_step=2", "actor_rollout_ref.rollout.response_length=8",
    ]
    per_step = load_config(fault_preset.name, [*fault_preset.overrides(), *common]).step_required_samples
    procs = []
    t0 = time.monotonic()
    for i in range(RUNS):
        cwd = tmp_path / f"run{i}"
        cwd.mkdir()
        overrides = [*common, f"trainer.default_local_dir={cwd}/out", f"trainer.seed={i}"]
        args = ["run", *fault_preset.cli_args(cwd), *(a for o in overrides for a in ("--set", o))]
        out, err = open(cwd / "run.out", "w"), open(cwd / "run.err", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([*CLI, *args], cwd=cwd, env=env, stdout=out, stderr=err,
                                       start_new_session=True), cwd, out, err))
    seen_in_flight: list[list[str]] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p, *_ in procs):
            assert time.monotonic() < deadline, f"the runs did not all end within {RUN_TIMEOUT_S:.0f} s"
            committed = _committed(url)
            if not seen_in_flight and len(committed) == RUNS and all(0 < n < STEPS for n in committed.values()):
                seen_in_flight.append(_runs_lines(url, env))  # `tidal runs` while all four are mid-run
            time.sleep(0.5)
        wall_s = time.monotonic() - t0
    finally:
        for proc, _, out, err in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            out.close()
            err.close()

    for proc, cwd, *_ in procs:
        log = (cwd / "run.out").read_text() + (cwd / "run.err").read_text()
        assert proc.returncode == 0, f"{cwd.name} exited {proc.returncode}:\n{log[-3000:]}"
        assert "Traceback" not in log, log[-4000:]

    # --- `tidal runs`: all four, with their states ------------------------------------------------
    uids = {}
    for proc, cwd, *_ in procs:
        found = re.search(r"run (\S+) finished: ", (cwd / "run.out").read_text())
        assert found, (cwd / "run.out").read_text()[-2000:]
        uids[cwd.name] = found[1]
    assert len(set(uids.values())) == RUNS
    if seen_in_flight:  # each line says running while its steps are short of the total
        (lines,) = seen_in_flight
        assert {ln.split()[0] for ln in lines} == set(uids.values()), lines
        for ln in lines:
            status, steps = ln.split()[1], ln.split()[3]
            done, total = map(int, steps.split("/"))
            assert (status, total) == ("running" if done < STEPS else status, STEPS), ln
            assert status in ("running", "finished"), ln
    lines = _runs_lines(url, env)
    assert sorted(ln.split()[0] for ln in lines) == sorted(uids.values()), lines
    for ln in lines:
        assert ln.split()[1] == "finished" and ln.split()[3] == f"{STEPS}/{STEPS}", ln

    # --- each run's records are its own ----------------------------------------------------------
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            summaries = {r.uid: r for r in run_summaries(s)}
            states = {uid: load_resume_state(s, uid) for uid in uids.values()}
            rows = {uid: read_step_metrics(s, uid) for uid in uids.values()}
            prompts = {uid: consumed_prompts(s, uid) for uid in uids.values()}
            per_step_rows = {uid: dict(s.execute(sa.text(
                "SELECT c.step, count(*) FROM consumed_prompts c JOIN runs r ON r.id = c.run_id "
                "WHERE r.uid = :u GROUP BY c.step"), {"u": uid}).all()) for uid in uids.values()}
    finally:
        engine.dispose()
    assert set(summaries) == set(uids.values())
    for uid in uids.values():
        assert summaries[uid].status == "finished" and summaries[uid].steps == STEPS
        assert [r["step"] for r in rows[uid]] == list(range(1, STEPS + 1))
        assert per_step_rows[uid] == {step: per_step for step in range(1, STEPS + 1)}
        assert len(prompts[uid]) == len(set(prompts[uid])) == STEPS * per_step
        assert states[uid].policy_state["steps_seen"] == list(range(1, STEPS + 1))

    # --- nothing of one run in another's report or Prefect records ---------------------------------
    flow_runs = _flow_run_names(prefect_server)
    for name, uid in uids.items():
        (report,) = (tmp_path / name / "out").glob("*/report.md")
        text = report.read_text()
        assert f"# Tidal run `{uid}`" in text, text[:300]
        assert not [other for other in uids.values() if other != uid and other in text], text[:500]
        table = [ln for ln in text.splitlines() if re.match(r"\| \d+ \|", ln)]
        assert [int(ln.split("|")[1]) for ln in table] == list(range(1, STEPS + 1)), table
        assert [ln.split("|")[2].strip() for ln in table] == [f"{r.get('timing_s/step', 0):.2f}" for r in rows[uid]]
        assert _step_artifact_rows(prefect_server, uid) == STEPS
        assert sum(1 for n in flow_runs if n.startswith(f"{uid}-step-")) == STEPS, sorted(flow_runs)

    duplicated = sum(len(p) - len(set(p)) for p in prompts.values())
    record("four_runs_one_platform", injected=RUNS, survived=RUNS, samples_lost=0, samples_duplicated=duplicated,
           runs=RUNS, steps=STEPS, wall_s=round(wall_s, 1), seen_in_flight=bool(seen_in_flight))
