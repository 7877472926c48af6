"""Store functions: what the control plane writes after each step and reads back on resume.

Every function takes an open ``Session``, flushes what it wrote and never commits: the caller
owns the transaction (``session_scope``). ``record_step`` writes all the rows of one step; called
inside one ``session_scope`` it is all or nothing, which is what makes a step the unit of resume.
Constraint violations (a step recorded twice, a prompt trained twice in one epoch) become
``StoreError`` with a one-line reason; the caller's rollback then leaves nothing of the step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.orm import Session

from storage.engine import StoreError, first_line, replayable
from storage.models import (
    Checkpoint,
    ConsumedPrompt,
    Decision,
    Metric,
    PolicyState,
    Run,
    RunStatus,
    Step,
    SwitchEvent,
)

__all__ = [
    "ResumeState",
    "RunSummary",
    "StoredCheckpoint",
    "StoredStep",
    "consumed_prompts",
    "create_run",
    "get_run",
    "latest_step",
    "list_runs",
    "load_resume_state",
    "read_step_metrics",
    "record_step",
    "run_summaries",
    "set_run_status",
]


class StoredCheckpoint(NamedTuple):
    """Where a step's trainer checkpoint lies and how to check it is intact."""

    path: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class StoredStep:
    """Everything one committed step writes. Defaults make a minimal valid step.

    Times are seconds on the controller's clock; ``wall_s`` defaults to
    ``finished_at - started_at``. ``switch_events`` items carry the fields of the controller's
    ``loop.SwitchReport`` (kind, started_at, duration_s, phases, aborted); ``decisions`` items those
    of its ``DecisionRecord`` (hook, answer, reason, inputs, duration_s; a ``step`` key is
    ignored). ``consumed_prompts`` lists the (epoch, prompt_index) pairs trained in this step.
    """

    step: int
    param_version: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    wall_s: float | None = None
    hybrid_active_after: bool = False
    controller_state: Mapping[str, Any] = field(default_factory=dict)
    data_position: Mapping[str, Any] = field(default_factory=dict)
    policy_state: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    switch_events: Sequence[Mapping[str, Any]] = ()
    decisions: Sequence[Mapping[str, Any]] = ()
    checkpoint: StoredCheckpoint | tuple[str, str, int] | None = None
    consumed_prompts: Sequence[tuple[int, int]] = ()


@dataclass(frozen=True)
class ResumeState:
    """What a resumed run restores: the state after its last committed step.

    ``checkpoint`` is the newest trainer checkpoint at or before ``step`` (``checkpoint_step``
    says which step wrote it). ``consumed`` holds every (epoch, prompt_index) already trained.
    """

    run_uid: str
    step: int
    param_version: int
    hybrid_active: bool
    policy_state: dict[str, Any]
    controller_state: dict[str, Any]
    data_position: dict[str, Any]
    checkpoint: StoredCheckpoint | None
    checkpoint_step: int | None
    consumed: frozenset[tuple[int, int]]


@dataclass(frozen=True)
class RunSummary:
    """One line of ``tidal runs``: a run with its committed step count and wall clock."""

    uid: str
    name: str
    project: str
    policy: str
    status: str
    steps: int
    last_step: int | None
    wall_s: float


# ----------------------------------------------------------------------------------------- runs


def create_run(
    session: Session,
    *,
    uid: str,
    name: str,
    project: str,
    policy: str,
    seed: int,
    config: Mapping[str, Any],
    output_dir: str,
) -> Run:
    """Add a run in status ``running``; ``StoreError`` if ``uid`` is taken."""
    run = Run(
        uid=uid,
        name=name,
        project=project,
        policy=policy,
        seed=seed,
        status=RunStatus.RUNNING.value,
        config_json=_json_dict("config", config),
        output_dir=str(output_dir),
    )
    session.add(run)
    _flush(session, f"cannot create run {uid!r}")
    return run


def get_run(session: Session, uid: str) -> Run | None:
    """The run with this uid, or None."""
    return session.scalars(sa.select(Run).where(Run.uid == uid)).one_or_none()


def _require_run(session: Session, uid: str) -> Run:
    run = get_run(session, uid)
    if run is None:
        raise StoreError(f"no run {uid!r} in the store")
    return run


def list_runs(session: Session) -> list[Run]:
    """Every run, oldest first."""
    return list(session.scalars(sa.select(Run).order_by(Run.id)))


def run_summaries(session: Session) -> list[RunSummary]:
    """Every run with its committed step count, last step and summed step wall time."""
    totals = (
        sa.select(
            Step.run_id,
            sa.func.count(Step.id).label("steps"),
            sa.func.max(Step.step).label("last_step"),
            sa.func.coalesce(sa.func.sum(Step.wall_s), 0.0).label("wall_s"),
        )
        .group_by(Step.run_id)
        .subquery()
    )
    rows = session.execute(
        sa.select(Run, totals.c.steps, totals.c.last_step, totals.c.wall_s)
        .outerjoin(totals, totals.c.run_id == Run.id)
        .order_by(Run.id)
    )
    return [
        RunSummary(
            uid=run.uid,
            name=run.name,
            project=run.project,
            policy=run.policy,
            status=run.status,
            steps=steps or 0,
            last_step=last_step,
            wall_s=float(wall_s or 0.0),
        )
        for run, steps, last_step, wall_s in rows
    ]


def set_run_status(session: Session, uid: str, status: str | RunStatus) -> Run:
    """Mark a run running, finished, failed or interrupted."""
    try:
        value = RunStatus(status).value
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise StoreError(f"unknown run status {status!r}; known: {known}") from None
    run = _require_run(session, uid)
    run.status = value
    _flush(session, f"cannot set the status of run {uid!r}")
    return run


# ---------------------------------------------------------------------------------------- steps


def latest_step(session: Session, run_id: int) -> Step | None:
    """The run's last committed step (highest step number), or None before the first."""
    query = sa.select(Step).where(Step.run_id == run_id).order_by(Step.step.desc()).limit(1)
    return session.scalars(query).first()


def record_step(session: Session, run_id: int, record: StoredStep) -> Step:
    """Write one step: its row, policy state, metrics, switch events, decisions, checkpoint and
    consumed prompts. Flushes; the caller commits (one transaction per step).

    On PostgreSQL the step is a replayable write (``storage.engine.replayable``): a server lost
    while the rows are written, or while they are committed, is waited for within the engine's
    reconnect bound and the step written again; a step found already committed with the same
    identity (param version, start and finish times) counts as written, so a COMMIT whose answer
    was lost never records the step twice."""
    return replayable(session, _StepWrite(run_id, record))


@dataclass(frozen=True)
class _StepWrite:
    """One step's rows as a replayable write, keyed by (run, step) like the ``steps`` table."""

    run_id: int
    record: StoredStep

    def landed(self, session: Session) -> bool:
        row = session.scalars(sa.select(Step).where(Step.run_id == self.run_id, Step.step == self.record.step)).first()
        if row is None:
            return False
        if (row.param_version, row.started_at, row.finished_at) != (
                self.record.param_version, float(self.record.started_at), float(self.record.finished_at)):
            raise StoreError(f"cannot record step {self.record.step} of run id {self.run_id}: the step is already "
                             f"recorded (by another writer)")
        return True

    def apply(self, session: Session) -> Step:
        return _write_step(session, self.run_id, self.record)


def _write_step(session: Session, run_id: int, record: StoredStep) -> Step:
    where = f"step {record.step} of run id {run_id}"
    if session.get(Run, run_id) is None:
        raise StoreError(f"cannot record {where}: no such run")
    controller_state = _json_dict("controller_state", record.controller_state)
    data_position = _json_dict("data_position", record.data_position)
    policy_state = _json_dict("policy_state", record.policy_state)
    wall_s = record.finished_at - record.started_at if record.wall_s is None else record.wall_s

    step = Step(
        run_id=run_id,
        step=record.step,
        param_version=record.param_version,
        started_at=float(record.started_at),
        finished_at=float(record.finished_at),
        wall_s=float(wall_s),
        hybrid_active_after=bool(record.hybrid_active_after),
        controller_state_json=controller_state,
        data_position_json=data_position,
    )
    session.add(step)
    _flush(session, f"cannot record {where}")

    rows: list[Any] = [PolicyState(run_id=run_id, step=record.step, state_json=policy_state)]
    rows += [
        Metric(run_id=run_id, step=record.step, name=name, value=_metric_value(name, value))
        for name, value in record.metrics.items()
    ]
    rows += [_switch_event(run_id, record.step, event) for event in record.switch_events]
    rows += [_decision(run_id, record.step, decision) for decision in record.decisions]
    if record.checkpoint is not None:
        path, sha256, size_bytes = record.checkpoint
        rows.append(
            Checkpoint(
                run_id=run_id, step=record.step, path=str(path), sha256=sha256,
                size_bytes=int(size_bytes),
            )
        )
    rows += [
        ConsumedPrompt(run_id=run_id, step=record.step, epoch=int(epoch), prompt_index=int(index))
        for epoch, index in record.consumed_prompts
    ]
    session.add_all(rows)
    _flush(session, f"cannot record {where}")
    return step


def _switch_event(run_id: int, step: int, event: Mapping[str, Any]) -> SwitchEvent:
    try:
        return SwitchEvent(
            run_id=run_id,
            step=step,
            kind=str(event["kind"]),
            started_at=float(event["started_at"]),
            duration_s=float(event["duration_s"]),
            phases_json=_json_dict("switch event phases", event.get("phases", {})),
            aborted=int(event.get("aborted", 0)),
        )
    except KeyError as missing:
        raise StoreError(f"a switch event of step {step} is missing {missing}") from None


def _decision(run_id: int, step: int, decision: Mapping[str, Any]) -> Decision:
    try:
        return Decision(
            run_id=run_id,
            step=step,
            hook=str(decision["hook"]),
            answer_json=_json_value("decision answer", decision["answer"]),
            reason=str(decision.get("reason", "")),
            inputs_json=_json_dict("decision inputs", decision.get("inputs", {})),
            duration_s=float(decision.get("duration_s", 0.0)),
        )
    except KeyError as missing:
        raise StoreError(f"a decision of step {step} is missing {missing}") from None


def drop_steps_after(session: Session, uid: str, step: int) -> list[int]:
    """Delete the run's committed steps after ``step`` with everything recorded for them (their
    policy states, metrics, switch events, decisions, checkpoints and consumed prompts, through the
    step key's ``ON DELETE CASCADE``): a resume whose last steps' checkpoints never reached the
    disk goes back to the last step that has one, and those steps' prompts are trained again.
    Returns the steps deleted. Flushes; the caller commits."""
    run = _require_run(session, uid)
    doomed = list(session.scalars(sa.select(Step.step).where(Step.run_id == run.id, Step.step > step)
                                  .order_by(Step.step)))
    if doomed:
        for model in (PolicyState, Metric, SwitchEvent, Decision, Checkpoint, ConsumedPrompt):
            session.execute(sa.delete(model).where(model.run_id == run.id, model.step > step))
        session.execute(sa.delete(Step).where(Step.run_id == run.id, Step.step > step))
        _flush(session, f"cannot drop the steps after {step} of run {uid}")
    return doomed


# --------------------------------------------------------------------------------------- reading


def load_resume_state(session: Session, uid: str) -> ResumeState | None:
    """The state after the run's last committed step; None if it committed no step yet.
    ``StoreError`` if there is no such run."""
    run = _require_run(session, uid)
    step = latest_step(session, run.id)
    if step is None:
        return None
    policy_state = session.scalars(
        sa.select(PolicyState.state_json).where(
            PolicyState.run_id == run.id, PolicyState.step == step.step
        )
    ).one()
    checkpoint = session.scalars(
        sa.select(Checkpoint)
        .where(Checkpoint.run_id == run.id, Checkpoint.step <= step.step)
        .order_by(Checkpoint.step.desc())
        .limit(1)
    ).first()
    consumed = session.execute(
        sa.select(ConsumedPrompt.epoch, ConsumedPrompt.prompt_index).where(
            ConsumedPrompt.run_id == run.id
        )
    )
    return ResumeState(
        run_uid=run.uid,
        step=step.step,
        param_version=step.param_version,
        hybrid_active=step.hybrid_active_after,
        policy_state=dict(policy_state),
        controller_state=dict(step.controller_state_json),
        data_position=dict(step.data_position_json),
        checkpoint=None
        if checkpoint is None
        else StoredCheckpoint(checkpoint.path, checkpoint.sha256, checkpoint.size_bytes),
        checkpoint_step=None if checkpoint is None else checkpoint.step,
        consumed=frozenset((epoch, index) for epoch, index in consumed),
    )


def read_step_metrics(session: Session, uid: str, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One dict per committed step, in step order, for reports and plots: the step's own
    columns (step, param_version, started_at, finished_at, wall_s, hybrid_active_after) plus
    every metric by name (NaN where it was stored as NULL), or only those in ``names`` (what a
    per-step reader, the UI's step table, needs of a run that has every step's metrics). A
    metric named like a step column does not override it."""
    run = _require_run(session, uid)
    steps = session.scalars(sa.select(Step).where(Step.run_id == run.id).order_by(Step.step))
    out: dict[int, dict[str, Any]] = {}
    for step in steps:
        out[step.step] = {
            "step": step.step,
            "param_version": step.param_version,
            "started_at": step.started_at,
            "finished_at": step.finished_at,
            "wall_s": step.wall_s,
            "hybrid_active_after": step.hybrid_active_after,
        }
    query = sa.select(Metric.step, Metric.name, Metric.value).where(Metric.run_id == run.id)
    if names is not None:
        query = query.where(Metric.name.in_(list(names)))
    metrics = session.execute(query.order_by(Metric.step, Metric.name))
    for step_number, name, value in metrics:
        out[step_number].setdefault(name, math.nan if value is None else value)
    return list(out.values())


def consumed_prompts(session: Session, uid: str) -> list[tuple[int, int]]:
    """Every (epoch, prompt_index) the run trained on, in the order the steps committed them."""
    run = _require_run(session, uid)
    rows = session.execute(
        sa.select(ConsumedPrompt.epoch, ConsumedPrompt.prompt_index)
        .where(ConsumedPrompt.run_id == run.id)
        .order_by(ConsumedPrompt.step, ConsumedPrompt.id)
    )
    return [(epoch, index) for epoch, index in rows]


# --------------------------------------------------------------------------------------- helpers

# Which unique key a violation hit, by the table named in the driver's message, most specific
# first (SQLite says "UNIQUE constraint failed: steps.run_id, ...", PostgreSQL names the
# constraint, e.g. "uq_steps_run_id_step").
_VIOLATIONS = (
    ("consumed_prompts", "a prompt would be trained twice in one epoch"),
    ("checkpoints", "the step already has a checkpoint"),
    ("policy_states", "the step already has a policy state"),
    ("metrics", "a metric is recorded twice"),
    ("steps", "the step is already recorded"),
    ("runs", "a run with this uid already exists"),
)


def _flush(session: Session, what: str) -> None:
    try:
        session.flush()
    except sa.exc.IntegrityError as exc:
        detail = first_line(exc)
        reason = next((text for table, text in _VIOLATIONS if table in detail), "constraint")
        raise StoreError(f"{what}: {reason} ({detail})") from exc


def _json_value(what: str, value: Any) -> Any:
    """Check that ``value`` survives JSON on every backend (no NaN/Infinity, plain types)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{what} is not storable as JSON: {exc}") from None
    return value


def _json_dict(what: str, value: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise StoreError(f"{what} must be a dict, not {type(value).__name__}")
    return _json_value(what, dict(value))


def _metric_value(name: str, value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise StoreError(f"metric {name!r} is not a number: {value!r}") from None
    return None if math.isnan(number) else number
