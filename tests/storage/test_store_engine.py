"""Opening a store: SQLite pragmas, URL handling, clear errors, and several SQLite writers."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.ports import free_port

from storage import (
    StoreError,
    StoredStep,
    create_run,
    latest_step,
    list_runs,
    make_engine,
    migrate,
    open_store,
    read_step_metrics,
    record_step,
    session_scope,
    sqlite_url,
    store_file,
)


@pytest.fixture
def sqlite_store(tmp_path):
    """A migrated SQLite store with one run; yields (url, run id)."""
    url = sqlite_url(tmp_path / "store.db")
    engine = make_engine(url)
    migrate(engine)
    with session_scope(engine) as session:
        run_id = create_run(session, uid="r", name="r", project="p", policy="default", seed=0,
                            config={}, output_dir="/o").id
    engine.dispose()
    return url, run_id


def test_a_sqlite_store_makes_its_folder_and_runs_in_wal_mode_with_the_busy_timeout(tmp_path):
    path = tmp_path / "deep" / "er" / "store.db"
    engine = make_engine(sqlite_url(path), busy_timeout_ms=1234)
    try:
        with engine.connect() as conn:
            pragmas = {name: conn.exec_driver_sql(f"PRAGMA {name}").scalar_one()
                       for name in ("journal_mode", "busy_timeout", "foreign_keys")}
    finally:
        engine.dispose()
    assert path.is_file()
    assert pragmas == {"journal_mode": "wal", "busy_timeout": 1234, "foreign_keys": 1}


def test_store_file_names_a_sqlite_file_and_nothing_for_other_stores_without_opening_them(tmp_path):
    path = tmp_path / "not" / "there.db"
    assert [store_file(sqlite_url(path)), store_file("sqlite://"), store_file("postgresql://u@nowhere:1/db")] == [
        path, None, None]
    assert not (tmp_path / "not").exists()
    with pytest.raises(StoreError, match="unsupported store backend 'mysql'"):
        store_file("mysql://x")


def test_open_store_gives_one_engine_per_url_and_busy_timeout_and_retries_a_failure(tmp_path):
    url = sqlite_url(tmp_path / "once.db")
    first = open_store(url, busy_timeout_ms=1000)
    assert [open_store(url, busy_timeout_ms=1000) is first, open_store(url, busy_timeout_ms=2000) is first] == [
        True, False]
    (tmp_path / "blocked").write_text("a file where the store's folder should be")
    blocked = sqlite_url(tmp_path / "blocked" / "store.db")
    for _ in range(2):  # not cached: the second call tries again and fails the same way
        with pytest.raises(StoreError, match="cannot create the store's folder"):
            open_store(blocked)


def test_a_plain_postgresql_url_is_served_by_psycopg(postgres_server):
    url = postgres_server.empty_database()
    assert url.startswith("postgresql://")
    engine = make_engine(url)
    try:
        assert (engine.dialect.name, engine.dialect.driver) == ("postgresql", "psycopg")
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("not a url", "not a database URL"),
        ("mysql://u@localhost/db", "unsupported store backend 'mysql'"),
    ],
)
def test_a_bad_url_is_refused_in_one_line(url, reason):
    with pytest.raises(StoreError, match=reason) as raised:
        make_engine(url)
    assert "\n" not in str(raised.value)


def test_an_unreachable_postgresql_is_a_one_line_store_error():
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    port = free_port()  # nothing listens here
    with pytest.raises(StoreError, match=f"cannot open the store at .*:{port}/") as raised:
        make_engine(f"postgresql://tidal:secret@127.0.0.1:{port}/tidal")
    assert "\n" not in str(raised.value)
    assert "secret" not in str(raised.value)


def test_a_store_folder_that_cannot_be_made_is_a_store_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StoreError, match="cannot create the store's folder"):
        make_engine(sqlite_url(tmp_path / "a-file" / "store.db"))


def test_two_writers_doing_read_modify_write_under_begin_immediate_both_commit(sqlite_store):
    url, run_id = sqlite_store
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer(name: str) -> None:
        engine = make_engine(url, busy_timeout_ms=10_000)
        try:
            start.wait()
            for _ in range(5):
                # Read the last step, then write the next: the classic race BEGIN IMMEDIATE fixes.
                with session_scope(engine, immediate=True) as session:
                    last = latest_step(session, run_id)
                    time.sleep(0.005)
                    record_step(session, run_id, StoredStep(
                        step=1 if last is None else last.step + 1, metrics={name: 1.0}))
        except BaseException as exc:  # reported below; a thread cannot fail the test itself
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert errors == []
    engine = make_engine(url)
    with session_scope(engine) as session:
        rows = read_step_metrics(session, "r")
    engine.dispose()
    assert [row["step"] for row in rows] == list(range(1, 11))
    assert sorted(sum(1 for row in rows if name in row) for name in ("a", "b")) == [5, 5]


def test_a_writer_blocked_past_a_short_busy_timeout_gets_a_clear_store_error(sqlite_store):
    url, run_id = sqlite_store
    holder = make_engine(url)
    locked, release = threading.Event(), threading.Event()

    def hold_the_write_lock() -> None:
        with session_scope(holder, immediate=True):
            locked.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=hold_the_write_lock)
    thread.start()
    impatient = make_engine(url, busy_timeout_ms=200)
    try:
        assert locked.wait(timeout=10)
        began = time.monotonic()
        with pytest.raises(StoreError) as raised:
            with session_scope(impatient, immediate=True) as session:
                record_step(session, run_id, StoredStep(step=1))
        waited = time.monotonic() - began

        # WAL: readers are not blocked by the writer.
        with session_scope(impatient) as session:
            assert [run.uid for run in list_runs(session)] == ["r"]
    finally:
        release.set()
        thread.join(timeout=30)
        impatient.dispose()
        holder.dispose()

    message = str(raised.value)
    assert "locked by another writer (waited up to the busy timeout of 200 ms" in message
    assert "database is locked" in message
    assert "\n" not in message
    assert 0.15 <= waited < 5.0
