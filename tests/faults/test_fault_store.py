"""Fault campaign, store faults: the step commit (`tasks.commit.commit`) against a real SQLite file
locked by another writer past the busy timeout, and a real PostgreSQL stopped between steps and in
the middle of a step's transaction. Each time: a one-line `StoreError`, no row of the failed step
in any per-step table, and once the database is back the same step commits and resume reads it.

The trainer actor that `commit` checkpoints through is replaced by a small fake, and the
controller's step outcome is made here: the subject here is the transaction, not the data plane.
"""

from __future__ import annotations

import sqlite3
import time
import types
from pathlib import Path

import pytest
import sqlalchemy as sa

import storage.engine as storage_engine
import tasks.commit as commit_mod
from loop import DecisionRecord, StepOutcome, SwitchReport
from storage import (
    StoreError,
    StoredStep,
    create_run,
    latest_step,
    load_resume_state,
    make_engine,
    migrate,
    record_step,
    session_scope,
    sqlite_url,
)
from tasks.run_ref import RunRef

PER_STEP_TABLES = ("steps", "policy_states", "metrics", "switch_events", "decisions", "checkpoints",
                   "consumed_prompts")
UID = "fault-run"

# --------------------------------------------------------------------------------------- fakes


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _FakeTrainer:
    def __init__(self):
        self.save_checkpoint = _Remote(self._save)

    @staticmethod
    def _save(path, export_hf=True, async_save=False):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"weights")
        return {"path": path, "sha256": "0" * 64, "size_bytes": 7}


@pytest.fixture
def fake_ray(monkeypatch):
    actors = {commit_mod.TRAINER: _FakeTrainer()}
    fake = types.SimpleNamespace(get_actor=lambda name, namespace=None: actors[name], get=lambda ref: ref)
    monkeypatch.setattr(commit_mod, "ray", fake)
    monkeypatch.setattr(storage_engine, "_OPEN", {})  # each test's own engine and busy timeout


STOPPED_BOUND_S = 1.0
"""``storage.reconnect_timeout_s`` of these runs: a stopped server is waited for this long (a
restarted one is ridden through: test_fault_store_restart.py), then the one-line error."""


def _run_ref(url: str, tmp_path: Path, busy_timeout_ms: int = 30_000) -> RunRef:
    return RunRef(uid=UID, namespace=UID, storage_url=url, busy_timeout_ms=busy_timeout_ms,
                  reconnect_timeout_s=STOPPED_BOUND_S,
                  output_dir=str(tmp_path / "out"), required_samples=2, trigger_parameter_sync_step=1,
                  buffer_samples=0, only_hybrid=False, standalone_replicas=1, hybrid_replicas=1,
                  trainer_gpus=1, standalone_gpus=1, policy="default")


def _summary(step: int) -> dict:
    outcome = StepOutcome(
        step=step, hybrid_active=False, policy_state={"steps_seen": list(range(1, step + 1))},
        controller_state={"state": "STANDALONE_ONLY"},
        decisions=(DecisionRecord(step, "should_deactivate", True, "r", {}, 0.0),),
        switch_events=(SwitchReport(kind="deactivate", started_at=1.0, duration_s=0.5, phases={"remove": 0.1},
                                    aborted=1),),
        replacements={"spent": {"standalone-0": 1}, "joined": 1},
    )
    return {"started_at": 100.0 * step, "outcome": outcome, "metrics": {"mq_size": float(step), "reward": 0.5},
            "prompts": [(0, 2 * step), (0, 2 * step + 1)], "consumed_total": 2 * step}


def _commit(run: RunRef, step: int) -> dict:
    return commit_mod.commit(run, step, step, _summary(step), now=100.0 * step + 5)


def _new_store(url: str) -> None:
    engine = make_engine(url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid=UID, name="f", project="tests", policy="default", seed=0, config={},
                   output_dir="/o")
    engine.dispose()


def _rows_of_step(url: str, step: int) -> dict[str, int]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return {t: conn.execute(sa.text(f"SELECT count(*) FROM {t} WHERE step = :s"), {"s": step}).scalar_one()
                    for t in PER_STEP_TABLES}
    finally:
        engine.dispose()


def _resume_step(url: str) -> int | None:
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            state = load_resume_state(s, UID)
        return None if state is None else state.step
    finally:
        engine.dispose()


FULL = {t: (2 if t == "metrics" or t == "consumed_prompts" else 1) for t in PER_STEP_TABLES}
NONE = {t: 0 for t in PER_STEP_TABLES}


# -------------------------------------------------------------------------------------- SQLite


def test_a_commit_blocked_by_another_sqlite_writer_past_the_timeout_fails_cleanly_then_succeeds(tmp_path, fake_ray):
    db = tmp_path / "store.db"
    url = sqlite_url(db)
    _new_store(url)
    run = _run_ref(url, tmp_path, busy_timeout_ms=300)
    _commit(run, 1)
    assert _rows_of_step(url, 1) == FULL

    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock and keeps it
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as raised:
            _commit(run, 2)
        waited = time.monotonic() - t0
        message = str(raised.value)
        assert "\n" not in message
        assert "locked by another writer" in message and "300 ms" in message, message
        assert waited >= 0.25, f"gave up after {waited:.3f}s, before the 300 ms busy timeout"
        assert _rows_of_step(url, 2) == NONE  # nothing of step 2 anywhere (WAL: readers still read)
        assert _resume_step(url) == 1
    finally:
        other.rollback()
        other.close()

    _commit(run, 2)  # the lock is gone: the same step commits whole
    assert _rows_of_step(url, 2) == FULL
    assert _resume_step(url) == 2


def test_a_step_commits_the_replacement_state_that_a_resume_continues_from(tmp_path, fake_ray):
    url = sqlite_url(tmp_path / "store.db")
    _new_store(url)
    _commit(_run_ref(url, tmp_path), 1)
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            state = load_resume_state(s, UID)
    finally:
        engine.dispose()
    assert state.data_position == {"consumed_total": 2, "replacements": {"spent": {"standalone-0": 1}, "joined": 1}}


def test_a_lock_released_within_the_busy_timeout_is_waited_for(tmp_path, fake_ray):
    """The other half of the contract: a writer that finishes in time does not fail the commit."""
    import threading

    db = tmp_path / "store.db"
    url = sqlite_url(db)
    _new_store(url)
    run = _run_ref(url, tmp_path, busy_timeout_ms=5_000)
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, other.rollback)
    release.start()
    try:
        t0 = time.monotonic()
        _commit(run, 1)
        assert time.monotonic() - t0 >= 0.4  # it really waited for the other writer
    finally:
        release.join()
        other.close()
    assert _rows_of_step(url, 1) == FULL


def test_a_failure_in_the_middle_of_a_step_leaves_no_row_of_it(tmp_path):
    """A step whose later rows fail (here: a prompt already trained) rolls back its earlier rows."""
    url = sqlite_url(tmp_path / "store.db")
    _new_store(url)
    engine = make_engine(url)
    with session_scope(engine) as s:
        run_id = create_run(s, uid="other", name="o", project="p", policy="default", seed=0, config={},
                            output_dir="/o").id
    with session_scope(engine) as s:
        record_step(s, run_id, StoredStep(step=1, consumed_prompts=[(0, 1)]))
    with pytest.raises(StoreError, match="trained twice"):
        with session_scope(engine) as s:
            record_step(s, run_id, StoredStep(step=2, metrics={"m": 1.0}, policy_state={"a": 1},
                                              consumed_prompts=[(0, 2), (0, 1)]))
    with session_scope(engine) as s:
        assert latest_step(s, run_id).step == 1
    engine.dispose()
    assert _rows_of_step(url, 2) == NONE


# ---------------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
def pg_store(stoppable_pg):
    if not stoppable_pg.running():
        stoppable_pg.start()
    url = stoppable_pg.server.empty_database()
    _new_store(url)
    yield url
    if not stoppable_pg.running():
        stoppable_pg.start()


def test_postgresql_stopped_between_steps_then_restarted(tmp_path, fake_ray, stoppable_pg, pg_store):
    url = pg_store
    run = _run_ref(url, tmp_path)
    _commit(run, 1)
    stoppable_pg.stop()  # the database goes away while the run is between two steps
    t0 = time.monotonic()
    with pytest.raises(StoreError) as raised:
        _commit(run, 2)
    message = str(raised.value)
    assert "\n" not in message and "postgresql" in message and "tidal@127.0.0.1" in message, message
    assert time.monotonic() - t0 < 30  # a clear error, not a hang

    stoppable_pg.start()
    assert _rows_of_step(url, 2) == NONE
    assert _resume_step(url) == 1
    _commit(run, 2)  # the same process, the same cached engine: it reconnects
    assert _rows_of_step(url, 2) == FULL
    assert _resume_step(url) == 2


def test_postgresql_stopped_inside_the_step_transaction_leaves_no_half_step(tmp_path, stoppable_pg, pg_store):
    """The server dies after the step's rows were flushed but before COMMIT."""
    url = pg_store
    engine = make_engine(url, reconnect_timeout_s=STOPPED_BOUND_S)
    with session_scope(engine) as s:
        run_id = s.execute(sa.text("SELECT id FROM runs")).scalar_one()
        record_step(s, run_id, StoredStep(step=1, metrics={"m": 1.0}))
    with pytest.raises(StoreError) as raised:
        with session_scope(engine, immediate=True) as s:
            record_step(s, run_id, StoredStep(step=2, metrics={"m": 2.0}, policy_state={"x": 2},
                                              consumed_prompts=[(0, 5)], checkpoint=("/c", "0" * 64, 1)))
            stoppable_pg.stop()  # rows are on the server, uncommitted, when it goes away
    assert "\n" not in str(raised.value) and "the store at" in str(raised.value), raised.value

    stoppable_pg.start()
    assert _rows_of_step(url, 2) == NONE
    with session_scope(engine) as s:  # the old engine recovers (pre-ping) and step 2 commits now
        record_step(s, run_id, StoredStep(step=2, metrics={"m": 2.0}, consumed_prompts=[(0, 5)]))
    with session_scope(engine) as s:
        assert latest_step(s, run_id).step == 2
    engine.dispose()


def test_postgresql_stopped_just_after_a_step_committed_reports_that_step_as_committed(
        tmp_path, fake_ray, stoppable_pg, pg_store, monkeypatch):
    """The server goes away after step 2's transaction, while the commit task shows the step in
    the UI (its step table is read back from the store). Seen in the tiny-hf campaign: the task
    failed, so the driver said "the run stopped after step 1" with step 2 committed. Now the task
    returns the committed step with the loss, for the driver to stop after it. (Prefect's artifact
    calls are replaced: they need a Prefect server. The server is stopped as the step table is
    read back, the moment hit: the step's markdown is posted at the same time from another thread,
    so stopping it there would race with the read.)"""
    import prefect.artifacts

    import storage
    from tasks.phases import commit

    url = pg_store
    run = _run_ref(url, tmp_path)
    _commit(run, 1)
    read_step_metrics = storage.read_step_metrics

    def read_after_the_server_stopped(*args, **kwargs):
        stoppable_pg.stop()
        return read_step_metrics(*args, **kwargs)

    monkeypatch.setattr(storage, "read_step_metrics", read_after_the_server_stopped)
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda **_: None)
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", lambda **_: None)
    result = commit.fn(run, 2, 2, _summary(2))
    lost = result.pop("store_lost")
    shown = url.replace("postgresql://", "postgresql+psycopg://")  # the engine's URL, as the store's errors name it
    assert (result["step"], lost["url"], lost["message"].startswith(f"the store at {shown} is unreachable")) == (
        2, shown, True)

    stoppable_pg.start()
    assert _rows_of_step(url, 2) == FULL
    assert _resume_step(url) == 2
