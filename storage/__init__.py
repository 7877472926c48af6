"""Tidal's SQL store: SQLAlchemy 2 models, store functions and Alembic migrations.

Owns: the tables (runs, steps, policy states, metrics, switch events, decisions, checkpoints,
consumed prompts), their migrations, opening a store (SQLite with WAL and a busy timeout by
default, PostgreSQL by URL) and reading back what a resumed run needs. Store functions take a
Session, flush and never commit: the caller owns the transaction (``session_scope``), so one
step's rows commit together or not at all. Migrations own the schema (no ``create_all``).
May import: config. Must not: import Ray, torch, cluster, tasks or flows.
"""

from storage.engine import StoreError, StoreUnavailable, make_engine, redact_url, session_scope, sqlite_url
from storage.migrate import current_revision, downgrade, head_revision, migrate
from storage.models import Base, RunStatus
from storage.store import (
    CheckpointInfo,
    ResumeState,
    RunSummary,
    StepRecord,
    consumed_prompts,
    create_run,
    get_run,
    latest_step,
    list_runs,
    load_resume_state,
    record_step,
    run_summaries,
    set_run_status,
    step_metrics,
)

__all__ = [
    "Base",
    "CheckpointInfo",
    "ResumeState",
    "RunStatus",
    "RunSummary",
    "StepRecord",
    "StoreError",
    "StoreUnavailable",
    "consumed_prompts",
    "create_run",
    "current_revision",
    "downgrade",
    "get_run",
    "head_revision",
    "latest_step",
    "list_runs",
    "load_resume_state",
    "make_engine",
    "migrate",
    "record_step",
    "redact_url",
    "run_summaries",
    "session_scope",
    "set_run_status",
    "sqlite_url",
    "step_metrics",
]
