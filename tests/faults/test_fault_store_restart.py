"""Fault campaign, the store's PostgreSQL restarted under the store itself (the unit of issue 47's
restart fault; the whole run: ``test_fault_postgres_restart_run.py``).

A real PostgreSQL (``pg_support.StoppablePostgres``) goes away and comes back while a step is
committed through ``storage``. Each test states one promise of the reconnect bound
(``storage.reconnect_timeout_s``): a restart within it is ridden through, the step written once;
a COMMIT whose answer was lost is not applied twice; a server that stays away past the bound is
a one-line ``StoreUnavailable`` soon after the bound, and later calls fail at once.
"""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from storage import (
    StoredStep,
    StoreUnavailable,
    create_run,
    make_engine,
    migrate,
    record_step,
    session_scope,
)
from storage.store import consumed_prompts, latest_step

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def store(stoppable_pg):
    """(url, run id) of a migrated store with one run, on the module's PostgreSQL (started again
    if an earlier test left it stopped)."""
    if not stoppable_pg.running():
        stoppable_pg.start()
    url = stoppable_pg.new_database("restart")
    engine = make_engine(url)
    migrate(engine)
    with session_scope(engine) as s:
        run_id = create_run(s, uid="r", name="r", project="p", policy="default", seed=0, config={},
                            output_dir="/o").id
    engine.dispose()
    yield url, run_id
    if not stoppable_pg.running():
        stoppable_pg.start()


def _step(n: int) -> StoredStep:
    return StoredStep(step=n, param_version=n, started_at=float(n), finished_at=n + 0.5, metrics={"m": float(n)},
                      policy_state={"n": n}, consumed_prompts=[(0, 2 * n), (0, 2 * n + 1)])


def _commit(engine: sa.Engine, run_id: int, n: int) -> None:
    """What the step commit does: read the run, write the step, in one transaction."""
    with session_scope(engine, immediate=True) as s:
        s.execute(sa.text("SELECT 1"))
        record_step(s, run_id, _step(n))


def _steps(engine: sa.Engine) -> list[int]:
    with session_scope(engine) as s:
        return list(s.scalars(sa.text("SELECT step FROM steps ORDER BY step")))


def test_a_restart_between_two_commits_is_waited_for_and_the_next_step_commits_once(stoppable_pg, store):
    url, run_id = store
    engine = make_engine(url, reconnect_timeout_s=20)
    _commit(engine, run_id, 1)
    stoppable_pg.stop("immediate")  # the pooled connection dies with the server
    starter = threading.Timer(3.0, stoppable_pg.start)
    starter.start()
    t0 = time.monotonic()
    _commit(engine, run_id, 2)  # waits for the server, then commits
    waited = time.monotonic() - t0
    starter.join()
    assert _steps(engine) == [1, 2]
    assert 2.5 < waited < 20, waited
    engine.dispose()


def test_a_server_lost_while_the_step_is_written_is_waited_for_and_the_step_written_again(stoppable_pg, store):
    url, run_id = store
    engine = make_engine(url, reconnect_timeout_s=20)
    _commit(engine, run_id, 1)
    starter = threading.Timer(2.0, stoppable_pg.start)
    with session_scope(engine, immediate=True) as s:
        s.execute(sa.text("SELECT 1"))  # the transaction's connection, alive
        stoppable_pg.stop("immediate")  # ... and gone before the step's rows are flushed
        starter.start()
        record_step(s, run_id, _step(2))
    starter.join()
    assert _steps(engine) == [1, 2]
    with session_scope(engine) as s:
        assert consumed_prompts(s, "r") == [(0, 2), (0, 3), (0, 4), (0, 5)]
    engine.dispose()


def test_a_commit_whose_answer_was_lost_after_it_landed_is_not_applied_twice(stoppable_pg, store, monkeypatch):
    url, run_id = store
    engine = make_engine(url, reconnect_timeout_s=20)
    _commit(engine, run_id, 1)
    real_commit = Session.commit
    lost: list[int] = []

    def commit_then_lose_the_answer(session):
        real_commit(session)
        if not lost:  # the COMMIT landed; the client never hears so (the server restarts)
            lost.append(1)
            stoppable_pg.restart(down_s=1.0)
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"),
                                          connection_invalidated=True)

    monkeypatch.setattr(Session, "commit", commit_then_lose_the_answer)
    _commit(engine, run_id, 2)
    monkeypatch.setattr(Session, "commit", real_commit)
    assert lost == [1]
    assert _steps(engine) == [1, 2]
    with session_scope(engine) as s:
        assert len(consumed_prompts(s, "r")) == len(set(consumed_prompts(s, "r"))) == 4
    engine.dispose()


def test_a_commit_whose_answer_was_lost_before_it_landed_is_applied_once_the_server_is_back(
        stoppable_pg, store, monkeypatch):
    url, run_id = store
    engine = make_engine(url, reconnect_timeout_s=20)
    _commit(engine, run_id, 1)
    real_commit = Session.commit
    lost: list[int] = []

    def lose_the_commit(session):
        if not lost:  # the server goes away before the COMMIT reaches it
            lost.append(1)
            session.rollback()
            stoppable_pg.restart(down_s=1.0)
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"),
                                          connection_invalidated=True)
        real_commit(session)

    monkeypatch.setattr(Session, "commit", lose_the_commit)
    _commit(engine, run_id, 2)
    monkeypatch.setattr(Session, "commit", real_commit)
    assert _steps(engine) == [1, 2]
    engine.dispose()


def test_a_server_away_past_the_bound_is_one_line_unavailable_and_later_calls_fail_at_once(stoppable_pg, store):
    url, run_id = store
    engine = make_engine(url, reconnect_timeout_s=2)
    _commit(engine, run_id, 1)
    stoppable_pg.stop("immediate")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as raised:
        _commit(engine, run_id, 2)
    first = time.monotonic() - t0
    t1 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        _commit(engine, run_id, 2)
    second = time.monotonic() - t1
    assert "\n" not in str(raised.value) and str(raised.value).startswith("the store at "), raised.value
    assert 1.5 < first < 8 and second < 1.5, (first, second)

    stoppable_pg.start()  # back: the same engine commits again, the step once
    _commit(engine, run_id, 2)
    with session_scope(engine) as s:
        assert latest_step(s, run_id).step == 2
    engine.dispose()
