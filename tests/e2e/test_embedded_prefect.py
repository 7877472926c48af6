"""`tidal run` with no Prefect server: embedded Prefect, in-process task runner.

The run (conftest ``embedded_run``) writes its flow runs into its own ``PREFECT_HOME``; the
session's server, started afterwards on that home, shows them (docs/deployment.md), with the
same step flow runs and phase order as the Ray task runner path.
"""

from __future__ import annotations

import json

import pytest
from e2e_support import (
    EMBEDDED_STEPS,
    expected_phases,
    read_artifacts,
    read_logs,
    read_runs_of_flow,
    read_step_runs,
    step_run_names,
    store_decisions,
)

from config import load_config

pytestmark = pytest.mark.slow

STEPS = EMBEDDED_STEPS
TRIGGER = load_config("tiny-cpu").async_training.trigger_parameter_sync_step


@pytest.fixture(scope="module")
def embedded(embedded_run, prefect_server):
    assert embedded_run.done.returncode == 0, embedded_run.done.stdout[-4000:]
    [parent] = [r for r in read_runs_of_flow(prefect_server.api_url, "training-run")
                if str(embedded_run.out) in " ".join(r.parameters.get("overrides") or [])]
    return {"parent": parent, "steps": read_step_runs(prefect_server.api_url, parent.id, STEPS),
            "logs": read_logs(prefect_server.api_url, parent.id), "store": embedded_run.out / "tidal.db",
            "stdout": embedded_run.done.stdout}


def test_the_cli_prints_progress_for_every_step(embedded):
    progress = [line.split()[:2] for line in embedded["stdout"].splitlines() if line.startswith("step ")]
    assert progress == [["step", f"{i}/{STEPS}"] for i in range(1, STEPS + 1)]


def test_the_run_says_its_phases_ran_in_process(embedded):
    assert embedded["parent"].state == "Completed"
    assert any("phases run on ThreadPoolTaskRunner" in line for line in embedded["logs"])


def test_a_server_started_later_shows_every_step_with_its_phases_in_the_documented_order(embedded):
    steps = embedded["steps"]
    active_after, should_activate, deactivated = store_decisions(embedded["store"])
    assert [(s.name, s.state) for s in steps] == [(name, "Completed") for name in step_run_names(embedded["store"], STEPS)]
    assert [s.phases for s in steps] == [
        expected_phases(TRIGGER, deactivated.get(i, False), active_after[i], final=i == STEPS, overlap=True,
                        lent=active_after.get(i - 1, False))
        for i in range(1, STEPS + 1)
    ]
    # the last step asks no lend: no decision, no lend
    assert {i: "activate" in s.phases for i, s in enumerate(steps, 1)} == {**should_activate, STEPS: False}
    assert STEPS not in should_activate and not active_after[STEPS]


def test_with_overlap_each_lend_syncs_the_hybrid_inside_its_broadcast_task(embedded):
    """``dynamic_schedule_overlap_hybrid_sync``: no ``hybrid_sync`` task; a step that lends records
    a hybrid sync whose time lies inside its ``broadcast_sync`` task, then activates it."""
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import SwitchEvent

    _, should_activate, _ = store_decisions(embedded["store"])
    lent = sorted(s for s, yes in should_activate.items() if yes)
    assert lent, f"the embedded run never lent its hybrid: {should_activate}"
    engine = make_engine(f"sqlite:///{embedded['store']}")
    with engine.connect() as conn:
        events = conn.execute(sa.select(SwitchEvent.step, SwitchEvent.kind, SwitchEvent.started_at,
                                        SwitchEvent.duration_s).order_by(SwitchEvent.started_at)).all()
    engine.dispose()
    for step in lent:
        run = embedded["steps"][step - 1]
        assert "hybrid_sync" not in run.phases
        start, end = run.spans[run.phases.index("broadcast_sync")]
        [(began, took)] = [(e.started_at, e.duration_s) for e in events if (e.step, e.kind) == (step, "hybrid_sync")]
        assert start <= began and began + took <= end, (start, began, took, end)
        assert [e.kind for e in events if e.step == step and e.started_at >= began][:2] == [
            "hybrid_sync", "activate"], events


def test_the_ui_has_one_step_artifact_key_with_a_version_per_step_and_a_step_table(embedded, prefect_server):
    uid = embedded["steps"][0].name.rsplit("-step-", 1)[0]
    versions = read_artifacts(prefect_server.api_url, f"{uid}-step")
    assert sorted(a.description for a in versions) == sorted(f"Tidal run {uid}: step {i} decisions, switches and metrics"
                                                             for i in range(1, STEPS + 1))
    tables = read_artifacts(prefect_server.api_url, f"{uid}-steps")
    newest = max(tables, key=lambda a: a.created)
    rows = json.loads(newest.data) if isinstance(newest.data, str) else newest.data
    assert (len(tables), [row["step"] for row in rows]) == (STEPS, list(range(1, STEPS + 1)))
