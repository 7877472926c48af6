"""The commit of one step: trainer checkpoint on disk first, then one SQL transaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from cluster.actors import CONTROLLER, ROLLOUT_SERVICE, TRAINER
from storage import StepRecord, make_engine, record_step, session_scope
from storage.store import get_run
from tasks.faults import crash_point
from tasks.run_ref import RunRef

_ENGINES: dict[str, Any] = {}


def engine_for(url: str, busy_timeout_ms: int) -> Any:
    """One SQLAlchemy engine per URL per process (tasks on Ray workers reuse theirs)."""
    if url not in _ENGINES:
        _ENGINES[url] = make_engine(url, busy_timeout_ms=busy_timeout_ms)
    return _ENGINES[url]


def checkpoint_path(run: RunRef, step: int) -> Path:
    return Path(run.output_dir) / "checkpoints" / f"step-{step:05d}.pt"


def commit(run: RunRef, step: int, version: int, summary: dict[str, Any], now: float) -> dict[str, Any]:
    controller = ray.get_actor(CONTROLLER, namespace=run.namespace)
    trainer = ray.get_actor(TRAINER, namespace=run.namespace)
    ckpt = ray.get(trainer.save_checkpoint.remote(str(checkpoint_path(run, step))))
    records = ray.get(controller.drain_records.remote())
    rollout = ray.get_actor(ROLLOUT_SERVICE, namespace=run.namespace)
    record = StepRecord(
        step=step,
        param_version=version,
        started_at=summary["started_at"],
        finished_at=now,
        wall_s=now - summary["started_at"],
        hybrid_active_after=ray.get(controller.hybrid_active.remote()),
        controller_state=ray.get(controller.controller_state.remote()),
        data_position={"consumed_total": summary["consumed_total"],
                       "replacements": ray.get(rollout.replacement_state.remote())},
        policy_state=summary["policy_state"],
        metrics=summary["metrics"],
        switch_events=records["switch_events"],
        decisions=records["decisions"],
        checkpoint=(ckpt["path"], ckpt["sha256"], ckpt["size_bytes"]),
        consumed_prompts=[tuple(p) for p in summary["prompts"]],
    )
    crash_point("commit_step", step)  # checkpoint on disk, step not yet committed
    with session_scope(engine_for(run.storage_url, run.busy_timeout_ms), immediate=True) as session:
        db_run = get_run(session, run.uid)
        if db_run is None:
            raise RuntimeError(f"run {run.uid} is not in the store")
        record_step(session, db_run.id, record)
    return {"step": step, "checkpoint": ckpt["path"], "decisions": records["decisions"],
            "switch_events": records["switch_events"]}
