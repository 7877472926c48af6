"""Store functions on a real SQLite file and a real PostgreSQL: runs, steps, resume, failures."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import (
    ResumeState, RunStatus, StoreError, StoredCheckpoint, StoredStep, consumed_prompts, create_run, get_run,
    latest_step, list_runs, load_resume_state, read_step_metrics, record_step, run_summaries, session_scope,
    set_run_status,
)

PER_STEP_TABLES = (
    "steps", "policy_states", "metrics", "switch_events", "decisions", "checkpoints",
    "consumed_prompts",
)


def new_run(engine, uid="run-1", **overrides):
    fields = dict(uid=uid, name="tiny", project="tidal", policy="default", seed=3,
                  config={"trainer": {"steps": 4}}, output_dir=f"/runs/{uid}")
    fields.update(overrides)
    with session_scope(engine) as session:
        return create_run(session, **fields).id


def full_step(step: int, *, prompts=((0, 0), (0, 1))) -> StoredStep:
    """A step that writes a row in every per-step table."""
    return StoredStep(
        step=step,
        param_version=step,
        started_at=10.0 * step,
        finished_at=10.0 * step + 7.25,
        hybrid_active_after=step % 2 == 1,
        controller_state={"state": "HYBRID_ACTIVE", "switch_count": step},
        data_position={"epoch": 0, "cursor": 2 * step},
        policy_state={"deactivate_ratio": 0.3 + step / 100, "history": [1.5, 2.25]},
        metrics={"mq_size": 4.0 + step, "reward": 0.5},
        switch_events=[{"kind": "deactivate", "started_at": 1.0, "duration_s": 0.5,
                        "phases": {"remove": 0.1, "abort": 0.1, "sleep": 0.3}, "aborted": 2}],
        decisions=[{"step": step, "hook": "should_deactivate", "answer": True,
                    "reason": "hybrids active", "inputs": {"mq_size": 4}, "duration_s": 1e-4}],
        checkpoint=StoredCheckpoint(f"/ckpt/{step}", "ab" * 32, 1024 * step),
        consumed_prompts=list(prompts),
    )


def rows_of_step(engine, run_id: int, step: int) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table: conn.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE run_id = :r AND step = :s"),
                {"r": run_id, "s": step},
            ).scalar_one()
            for table in PER_STEP_TABLES
        }


def test_a_new_run_is_running_and_found_by_its_uid(engine):
    new_run(engine, "a")
    new_run(engine, "b", policy="fixed_ratio")
    with session_scope(engine) as session:
        run = get_run(session, "b")
        assert (run.policy, run.status, run.seed, run.config_json) == (
            "fixed_ratio", "running", 3, {"trainer": {"steps": 4}})
        assert [r.uid for r in list_runs(session)] == ["a", "b"]
        assert get_run(session, "nope") is None


def test_rows_read_from_the_store_survive_pickling_as_ray_ships_them(engine):
    run_id = new_run(engine)
    with session_scope(engine) as session:
        record_step(session, run_id, full_step(1))
    with session_scope(engine) as session:
        run, step = get_run(session, "run-1"), latest_step(session, run_id)
        state = load_resume_state(session, "run-1")
    copies = pickle.loads(pickle.dumps((run, step, state)))
    assert (copies[0].uid, copies[1].controller_state_json, copies[2]) == (
        "run-1", {"state": "HYBRID_ACTIVE", "switch_count": 1}, state)


def test_a_second_run_with_the_same_uid_is_refused(engine):
    new_run(engine, "dup")
    with pytest.raises(StoreError, match="already exists"):
        new_run(engine, "dup")
    with session_scope(engine) as session:
        assert len(list_runs(session)) == 1


def test_a_run_changes_status_and_refuses_an_unknown_one(engine):
    new_run(engine, "s")
    with session_scope(engine) as session:
        set_run_status(session, "s", RunStatus.FINISHED)
    with pytest.raises(StoreError, match="unknown run status 'paused'"):
        with session_scope(engine) as session:
            set_run_status(session, "s", "paused")
    with pytest.raises(StoreError, match="no run 'ghost'"):
        with session_scope(engine) as session:
            set_run_status(session, "ghost", "failed")
    with session_scope(engine) as session:
        assert get_run(session, "s").status == "finished"


def test_a_recorded_step_comes_back_whole_as_the_resume_state(engine):
    run_id = new_run(engine)
    with session_scope(engine) as session:
        record_step(session, run_id, full_step(1))
    with session_scope(engine) as session:
        record_step(session, run_id, full_step(2, prompts=[(0, 2), (0, 3)]))

    with session_scope(engine) as session:
        state = load_resume_state(session, "run-1")
        assert latest_step(session, run_id).step == 2
    assert state == ResumeState(
        run_uid="run-1",
        step=2,
        param_version=2,
        hybrid_active=False,
        policy_state={"deactivate_ratio": 0.32, "history": [1.5, 2.25]},
        controller_state={"state": "HYBRID_ACTIVE", "switch_count": 2},
        data_position={"epoch": 0, "cursor": 4},
        checkpoint=StoredCheckpoint("/ckpt/2", "ab" * 32, 2048),
        checkpoint_step=2,
        consumed=frozenset({(0, 0), (0, 1), (0, 2), (0, 3)}),
    )
    assert rows_of_step(engine, run_id, 2) == {
        "steps": 1, "policy_states": 1, "metrics": 2, "switch_events": 1, "decisions": 1,
        "checkpoints": 1, "consumed_prompts": 2,
    }


def test_resume_takes_the_newest_checkpoint_at_or_before_the_last_step(engine):
    run_id = new_run(engine)
    for step in (1, 2, 3):
        record = full_step(step, prompts=[(0, step)])
        if step == 3:
            record = dataclasses.replace(record, checkpoint=None)
        with session_scope(engine) as session:
            record_step(session, run_id, record)
    with session_scope(engine) as session:
        state = load_resume_state(session, "run-1")
    assert (state.step, state.checkpoint_step, state.checkpoint.path) == (3, 2, "/ckpt/2")


def test_resume_state_is_none_before_the_first_step_and_an_error_for_an_unknown_run(engine):
    new_run(engine)
    with session_scope(engine) as session:
        assert load_resume_state(session, "run-1") is None
        with pytest.raises(StoreError, match="no run 'other'"):
            load_resume_state(session, "other")


def test_recording_a_step_twice_is_a_store_error_and_keeps_the_first(engine):
    run_id = new_run(engine)
    with session_scope(engine) as session:
        record_step(session, run_id, full_step(1))
    second = dataclasses.replace(full_step(1, prompts=[(0, 9)]), param_version=99)
    with pytest.raises(StoreError, match="step 1 .*already recorded") as raised:
        with session_scope(engine) as session:
            record_step(session, run_id, second)
    assert "\n" not in str(raised.value)
    with session_scope(engine) as session:
        assert load_resume_state(session, "run-1").param_version == 1
        assert consumed_prompts(session, "run-1") == [(0, 0), (0, 1)]


def test_a_prompt_trained_twice_in_one_epoch_fails_the_whole_step(engine):
    run_id = new_run(engine)
    with session_scope(engine) as session:
        record_step(session, run_id, full_step(1, prompts=[(0, 5)]))
    with pytest.raises(StoreError, match="trained twice in one epoch"):
        with session_scope(engine) as session:
            record_step(session, run_id, full_step(2, prompts=[(0, 6), (0, 5)]))
    assert rows_of_step(engine, run_id, 2) == dict.fromkeys(PER_STEP_TABLES, 0)
    assert rows_of_step(engine, run_id, 1)["steps"] == 1


def test_a_prompt_listed_twice_in_one_step_fails_the_whole_step(engine):
    run_id = new_run(engine)
    with pytest.raises(StoreError, match="trained twice in one epoch"):
        with session_scope(engine) as session:
            record_step(session, run_id, full_step(1, prompts=[(0, 7), (0, 7)]))
    assert rows_of_step(engine, run_id, 1) == dict.fromkeys(PER_STEP_TABLES, 0)


def test_the_same_prompt_is_trained_again_in_the_next_epoch(engine):
    run_id = new_run(engine)
    with session_scope(engine) as session:
        record_step(session, run_id, full_step(1, prompts=[(0, 4)]))
        record_step(session, run_id, full_step(2, prompts=[(1, 4)]))
    with session_scope(engine) as session:
        assert consumed_prompts(session, "run-1") == [(0, 4), (1, 4)]


def test_an_error_after_record_step_in_the_same_transaction_leaves_no_row_of_the_step(engine):
    run_id = new_run(engine)
    with pytest.raises(RuntimeError, match="checkpoint vanished"):
        with session_scope(engine) as session:
            record_step(session, run_id, full_step(1))
            raise RuntimeError("checkpoint vanished")
    assert rows_of_step(engine, run_id, 1) == dict.fromkeys(PER_STEP_TABLES, 0)
    with session_scope(engine) as session:
        assert load_resume_state(session, "run-1") is None


def test_state_that_json_cannot_hold_is_refused_before_anything_is_written(engine):
    run_id = new_run(engine)
    bad = dataclasses.replace(full_step(1), policy_state={"ratio": math.nan})
    with pytest.raises(StoreError, match="policy_state is not storable as JSON"):
        with session_scope(engine) as session:
            record_step(session, run_id, bad)
    assert rows_of_step(engine, run_id, 1) == dict.fromkeys(PER_STEP_TABLES, 0)


def test_step_metrics_give_one_row_per_step_in_order_with_nan_kept(engine):
    run_id = new_run(engine)
    for step in (2, 1):
        record = StoredStep(step=step, param_version=step, started_at=1.0, finished_at=4.0,
                            metrics={"reward": 0.25 * step, "loss": math.nan, "step": -1.0})
        with session_scope(engine) as session:
            record_step(session, run_id, record)
    with session_scope(engine) as session:
        rows = read_step_metrics(session, "run-1")
    assert [(r["step"], r["param_version"], r["wall_s"], r["reward"]) for r in rows] == [
        (1, 1, 3.0, 0.25), (2, 2, 3.0, 0.5)]
    assert [math.isnan(r["loss"]) for r in rows] == [True, True]


def test_run_summaries_count_committed_steps_and_their_wall_time(engine):
    first = new_run(engine, "one")
    new_run(engine, "two")
    with session_scope(engine) as session:
        record_step(session, first, StoredStep(step=1, started_at=0.0, finished_at=2.0))
        record_step(session, first, StoredStep(step=2, started_at=2.0, finished_at=2.5))
    with session_scope(engine) as session:
        summaries = run_summaries(session)
    assert [(s.uid, s.steps, s.last_step, s.wall_s) for s in summaries] == [
        ("one", 2, 2, 2.5), ("two", 0, None, 0.0)]


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)
json_state = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8),
    max_size=5,
)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy_state=json_state, controller_state=json_state)
def test_any_json_state_round_trips_exactly(engine, policy_state, controller_state):
    with session_scope(engine) as session:
        run = create_run(session, uid=f"h{len(list_runs(session))}", name="h", project="p",
                         policy="default", seed=0, config={}, output_dir="/o")
        record_step(session, run.id, StoredStep(step=1, policy_state=policy_state,
                                                controller_state=controller_state))
        uid = run.uid
    with session_scope(engine) as session:
        state = load_resume_state(session, uid)
    assert (state.policy_state, state.controller_state) == (policy_state, controller_state)


def test_step_metrics_read_for_some_names_keep_every_step_and_only_those_metrics(engine):
    run_id = new_run(engine)
    for step in (1, 2):
        record = StoredStep(step=step, param_version=step, started_at=1.0, finished_at=4.0,
                            metrics={"reward": 0.25 * step, "loss": 1.0, "mq_size": 3.0})
        with session_scope(engine) as session:
            record_step(session, run_id, record)
    with session_scope(engine) as session:
        rows = read_step_metrics(session, "run-1", ["reward", "mq_size", "absent"])
    assert rows == [{"step": s, "param_version": s, "started_at": 1.0, "finished_at": 4.0, "wall_s": 3.0,
                     "hybrid_active_after": False, "mq_size": 3.0, "reward": 0.25 * s} for s in (1, 2)]
