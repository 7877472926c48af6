"""Several drivers starting at once on a new store (issue 47's four runs on one PostgreSQL): each
migrates it, and all of them must succeed with the schema at head once. Without the migration's
lock, the second CREATE TABLE of a table another transaction created meanwhile failed on
PostgreSQL (`duplicate key value violates unique constraint "pg_type_typname_nsp_index"`)."""

from __future__ import annotations

import threading

import pytest

from storage import current_revision, head_revision, make_engine, migrate

pytestmark = pytest.mark.timeout(120)


def test_four_drivers_migrating_a_new_store_at_once_all_succeed(store_url):
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def driver() -> None:
        engine = make_engine(store_url)
        try:
            start.wait()
            migrate(engine)
        except BaseException as exc:  # reported below; a thread cannot fail the test itself
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=driver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    engine = make_engine(store_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
