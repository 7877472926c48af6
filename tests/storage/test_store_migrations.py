"""The migrations own the schema: one head, the models agree with them, and down/up round-trips."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from storage import (
    Base,
    StoreError,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    migrate,
)
from storage.migrate import alembic_config

ROOT = Path(__file__).resolve().parents[2]
TABLES = {
    "runs", "steps", "policy_states", "metrics", "switch_events", "decisions", "checkpoints",
    "consumed_prompts", "driver_leases",
}

# One row in every table, in raw SQL so that the test does not depend on today's models.
ONE_ROW_EACH = [
    "INSERT INTO runs (id, uid, name, project, policy, seed, status, config_json, output_dir) "
    "VALUES (1, 'r1', 'run', 'proj', 'default', 7, 'running', '{\"a\": 1}', '/out')",
    "INSERT INTO steps (id, run_id, step, param_version, started_at, finished_at, wall_s, "
    "hybrid_active_after, controller_state_json, data_position_json) "
    "VALUES (1, 1, 1, 1, 0.0, 2.5, 2.5, TRUE, '{}', '{\"epoch\": 0}')",
    "INSERT INTO policy_states (id, run_id, step, state_json) VALUES (1, 1, 1, '{\"r\": 0.3}')",
    "INSERT INTO metrics (id, run_id, step, name, value) VALUES (1, 1, 1, 'mq_size', 4.0)",
    "INSERT INTO switch_events (id, run_id, step, kind, started_at, duration_s, phases_json, "
    "aborted) VALUES (1, 1, 1, 'deactivate', 0.5, 0.25, '{\"sleep\": 0.2}', 3)",
    "INSERT INTO decisions (id, run_id, step, hook, answer_json, reason, inputs_json, duration_s) "
    "VALUES (1, 1, 1, 'should_deactivate', 'true', 'active', '{}', 0.001)",
    "INSERT INTO checkpoints (id, run_id, step, path, sha256, size_bytes) "
    "VALUES (1, 1, 1, '/ckpt/1', 'ab', 10)",
    "INSERT INTO consumed_prompts (id, run_id, step, epoch, prompt_index) VALUES (1, 1, 1, 0, 5)",
    "INSERT INTO driver_leases (id, run_id, driver_id, host, pid, pid_started, acquired_at, heartbeat_at, "
    "timeout_s) VALUES (1, 1, 'd1', 'host', 42, 7, 1.0, 2.0, 30.0)",
]


def _insert_one_row_each(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for statement in ONE_ROW_EACH:
            conn.exec_driver_sql(statement)


def _row_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar_one() for t in TABLES}


def _tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_the_migration_history_has_exactly_one_head():
    script = ScriptDirectory.from_config(alembic_config())
    assert len(script.get_heads()) == 1
    assert head_revision() == script.get_heads()[0]


def test_migrating_a_url_builds_every_table_and_stamps_the_head(store_url):
    migrate(store_url)
    engine = make_engine(store_url)
    try:
        assert _tables(engine) == TABLES | {"alembic_version"}
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_the_migrated_schema_matches_the_models_exactly(engine):
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_migrating_an_up_to_date_store_again_keeps_its_rows(engine):
    _insert_one_row_each(engine)
    migrate(engine)
    assert _row_counts(engine) == dict.fromkeys(TABLES, 1)


def test_down_to_base_with_rows_present_drops_every_table_and_up_again_rebuilds_them(engine):
    _insert_one_row_each(engine)
    assert _row_counts(engine) == dict.fromkeys(TABLES, 1)

    downgrade(engine, "base")
    assert _tables(engine) & TABLES == set()
    assert current_revision(engine) is None

    migrate(engine)
    assert _row_counts(engine) == dict.fromkeys(TABLES, 0)
    _insert_one_row_each(engine)
    assert _row_counts(engine) == dict.fromkeys(TABLES, 1)


def test_going_down_to_the_first_revision_turns_interrupted_runs_back_into_running_ones(engine):
    _insert_one_row_each(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE runs SET status = 'interrupted'")
    downgrade(engine, "0001")
    assert _tables(engine) == TABLES - {"driver_leases"} | {"alembic_version"}
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT uid, status FROM runs").all() == [("r1", "running")]
    migrate(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE runs SET status = 'interrupted'")
        assert conn.exec_driver_sql("SELECT status FROM runs").scalar_one() == "interrupted"


def test_a_store_stamped_by_an_unknown_newer_revision_is_refused_in_one_line(engine):
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'f00dfeed'")
    with pytest.raises(StoreError, match="newer Tidal") as raised:
        migrate(engine)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("package", ["storage", "tasks", "flows", "cluster", "sim", "deployments"])
def test_no_production_code_creates_tables_behind_the_migrations_back(package):
    calls = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "create_all":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []
