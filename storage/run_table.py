"""What ``tidal runs`` shows of each run, read in three queries (runs, step totals, last values).

Owns ``RunRow`` and ``run_table``. Must not: write, or read a run's folder (the CLI adds the real
wall clock from it). Like every store function it takes a Session and leaves the transaction to
the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from storage.lease import run_statuses
from storage.models import Metric, Run, Step

__all__ = ["RunRow", "run_table"]


@dataclass(frozen=True)
class RunRow:
    """One run: its status as stored, committed steps of how many, and its last value of a metric."""

    uid: str
    status: str
    policy: str
    steps: int
    total_steps: int | None
    """``trainer.total_training_steps`` of the run's config (None: until the data runs out)."""
    created: datetime
    output_dir: str
    step_wall_s: float
    """Sum of the committed steps' wall times (not the run's elapsed time)."""
    last_value: float | None
    """The metric's value at the last committed step that has it; None without one (or NaN)."""


def run_table(session: Session, metric: str = "train/reward_mean") -> list[RunRow]:
    """Every run, oldest first."""
    totals = {
        run_id: (steps, wall)
        for run_id, steps, wall in session.execute(
            sa.select(Step.run_id, sa.func.count(Step.id), sa.func.coalesce(sa.func.sum(Step.wall_s), 0.0))
            .group_by(Step.run_id)
        )
    }
    last_step = (
        sa.select(Metric.run_id, sa.func.max(Metric.step).label("step"))
        .where(Metric.name == metric)
        .group_by(Metric.run_id)
        .subquery()
    )
    last = dict(session.execute(
        sa.select(Metric.run_id, Metric.value)
        .join(last_step, sa.and_(Metric.run_id == last_step.c.run_id, Metric.step == last_step.c.step))
        .where(Metric.name == metric)
    ).all())
    statuses = run_statuses(session)  # a run whose driver's heartbeat stopped reads `interrupted`
    rows = []
    for run in session.scalars(sa.select(Run).order_by(Run.id)):
        steps, wall = totals.get(run.id, (0, 0.0))
        total = (run.config_json.get("trainer") or {}).get("total_training_steps")
        value = last.get(run.id)
        rows.append(RunRow(
            uid=run.uid, status=statuses.get(run.uid, run.status), policy=run.policy, steps=int(steps),
            total_steps=int(total) if isinstance(total, int) else None, created=run.created,
            output_dir=run.output_dir, step_wall_s=float(wall),
            last_value=None if value is None or math.isnan(value) else float(value),
        ))
    return rows
