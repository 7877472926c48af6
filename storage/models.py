"""The store's tables, as SQLAlchemy 2 typed declarative models.

Owns: one ``Base`` (id, created, updated, constraint names), a run's steps and the per-step rows keyed
by ``(run_id, step)``. Must not: import anything but SQLAlchemy and ``storage`` (Ray pickles these
classes by reference) or change without a new migration. More: ``docs/storage.md``.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "NAMING_CONVENTION",
    "Base",
    "Checkpoint",
    "ConsumedPrompt",
    "Decision",
    "DriverLease",
    "Metric",
    "PolicyState",
    "Run",
    "RunStatus",
    "Step",
    "SwitchEvent",
]

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JsonDict = dict[str, Any]


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Every table: integer ``id``, ``created`` and ``updated`` (UTC), conventional names."""

    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {JsonDict: sa.JSON, datetime: sa.DateTime(timezone=True)}

    id: Mapped[int] = mapped_column(primary_key=True, sort_order=-1)
    created: Mapped[datetime] = mapped_column(
        default=_utcnow, server_default=sa.text("CURRENT_TIMESTAMP")
    )
    updated: Mapped[datetime] = mapped_column(
        default=_utcnow, onupdate=_utcnow, server_default=sa.text("CURRENT_TIMESTAMP")
    )


class RunStatus(enum.StrEnum):
    """Where a run is, as its driver last wrote it. ``running`` also covers a driver that was
    killed: ``storage.effective_status`` reads the lease's heartbeat to tell (``interrupted``)."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    """Stopped by SIGINT / SIGTERM (or its driver died): ``tidal resume`` continues it."""

RUN_STATUSES = "status IN ('running', 'finished', 'failed', 'interrupted')"


def _step_key() -> sa.ForeignKeyConstraint:
    """The composite foreign key from a per-step table to its step row."""
    return sa.ForeignKeyConstraint(
        ["run_id", "step"], ["steps.run_id", "steps.step"], ondelete="CASCADE"
    )


class Run(Base):
    """One training run: what was asked for and where its outputs go."""

    __tablename__ = "runs"
    __table_args__ = (
        sa.CheckConstraint(RUN_STATUSES, name="status"),
    )

    uid: Mapped[str] = mapped_column(sa.String(64), unique=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    project: Mapped[str] = mapped_column(sa.String(200))
    policy: Mapped[str] = mapped_column(sa.String(200))
    seed: Mapped[int]
    status: Mapped[str] = mapped_column(sa.String(16), default=RunStatus.RUNNING.value)
    config_json: Mapped[JsonDict]
    output_dir: Mapped[str] = mapped_column(sa.String(1024))


class Step(Base):
    """One committed sync cycle: its timing and the controller / data state after it."""

    __tablename__ = "steps"
    __table_args__ = (sa.UniqueConstraint("run_id", "step"),)

    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int]
    param_version: Mapped[int]
    started_at: Mapped[float]
    finished_at: Mapped[float]
    wall_s: Mapped[float]
    hybrid_active_after: Mapped[bool]
    controller_state_json: Mapped[JsonDict]
    data_position_json: Mapped[JsonDict]


class PolicyState(Base):
    """The policy's ``state_dict()`` after ``update_after_step`` of this step."""

    __tablename__ = "policy_states"
    __table_args__ = (sa.UniqueConstraint("run_id", "step"), _step_key())

    run_id: Mapped[int]
    step: Mapped[int]
    state_json: Mapped[JsonDict]


class Metric(Base):
    """One named number of one step. NaN is stored as NULL (SQLite cannot hold NaN)."""

    __tablename__ = "metrics"
    __table_args__ = (sa.UniqueConstraint("run_id", "step", "name"), _step_key())

    run_id: Mapped[int]
    step: Mapped[int]
    name: Mapped[str] = mapped_column(sa.String(200))
    value: Mapped[float | None]


class SwitchEvent(Base):
    """One timed controller switch (deactivate, hybrid_sync, activate, rebalance)."""

    __tablename__ = "switch_events"
    __table_args__ = (sa.Index(None, "run_id", "step"), _step_key())

    run_id: Mapped[int]
    step: Mapped[int]
    kind: Mapped[str] = mapped_column(sa.String(32))
    started_at: Mapped[float]
    duration_s: Mapped[float]
    phases_json: Mapped[JsonDict]
    aborted: Mapped[int]


class Decision(Base):
    """One policy call as the controller recorded it: inputs, answer, reason, duration."""

    __tablename__ = "decisions"
    __table_args__ = (sa.Index(None, "run_id", "step"), _step_key())

    run_id: Mapped[int]
    step: Mapped[int]
    hook: Mapped[str] = mapped_column(sa.String(64))
    answer_json: Mapped[Any] = mapped_column(sa.JSON)
    reason: Mapped[str] = mapped_column(sa.Text)
    inputs_json: Mapped[JsonDict]
    duration_s: Mapped[float]


class Checkpoint(Base):
    """The trainer checkpoint written for a step, on disk before the step committed."""

    __tablename__ = "checkpoints"
    __table_args__ = (sa.UniqueConstraint("run_id", "step"), _step_key())

    run_id: Mapped[int]
    step: Mapped[int]
    path: Mapped[str] = mapped_column(sa.String(1024))
    sha256: Mapped[str] = mapped_column(sa.String(64))
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)


class ConsumedPrompt(Base):
    """A prompt the trainer trained on; the unique key forbids training it twice in an epoch."""

    __tablename__ = "consumed_prompts"
    __table_args__ = (
        sa.UniqueConstraint("run_id", "epoch", "prompt_index"),
        sa.Index(None, "run_id", "step"),
        _step_key(),
    )

    run_id: Mapped[int]
    step: Mapped[int]
    epoch: Mapped[int]
    prompt_index: Mapped[int]


class DriverLease(Base):
    """The one driver allowed to run a run: who it is and when it last said it was alive.

    Taken at ``run`` / ``resume`` start, renewed by a heartbeat, deleted at the end. A lease whose
    heartbeat is older than ``timeout_s`` (or whose process is gone, on the same host) is stale and
    may be taken over. Times are wall-clock seconds since the epoch.
    """

    __tablename__ = "driver_leases"
    __table_args__ = (sa.UniqueConstraint("run_id"),)

    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    driver_id: Mapped[str] = mapped_column(sa.String(64))
    host: Mapped[str] = mapped_column(sa.String(255))
    pid: Mapped[int]
    pid_started: Mapped[int] = mapped_column(sa.BigInteger)
    """The process's start time in clock ticks since boot (``/proc/PID/stat``; 0 where unknown):
    with the pid, it tells a live holder from a reused pid on the same host."""
    acquired_at: Mapped[float]
    heartbeat_at: Mapped[float]
    timeout_s: Mapped[float]
