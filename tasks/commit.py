"""The commit of one step: the trainer checkpoint, then one SQL transaction.

With ``actor.checkpoint.async_save`` the trainer copies its state to host memory and returns; the
write goes on in the background while the next step runs, and the next commit waits for it
first. The step is committed before its checkpoint is whole on disk, so a resume checks: a step
whose checkpoint never completed is dropped and its prompts are trained again
(``flows.training_run``). The run's last step is written whole before the run ends."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Any

import ray

from cluster.actors import TRAINER, actor_gone
from loop.plans import StepOutcome
from storage import StoredStep, open_store, record_step, session_scope
from storage.store import get_run
from tasks.faults import crash_point, kill_rank_point
from tasks.run_ref import RunRef

def checkpoint_path(run: RunRef, step: int) -> Path:
    """``<run>/checkpoints/global_step_<N>/actor.pt`` (verl's folder per step; an HF model's
    export lands beside it in ``huggingface/``)."""
    return Path(run.output_dir) / "checkpoints" / f"global_step_{step}" / "actor.pt"


_STEP_DIR = re.compile(r"global_step_(\d+)")


def is_kept_step(step: int, save_freq: int, total_steps: int | None) -> bool:
    """verl's rule for a saved step: every ``save_freq`` steps and the last one (none when <= 0)."""
    return save_freq > 0 and (step % save_freq == 0 or step == total_steps)


def prune_checkpoints(checkpoints: Path, keep: int | None, *, save_freq: int = 1,
                      total_steps: int | None = None, latest: int | None = None,
                      previous: int | None = None) -> list[int]:
    """Delete every ``global_step_<N>`` folder but the ``keep`` newest kept steps (``is_kept_step``;
    ``keep`` None = all of them), ``latest`` and ``previous``; returns the steps deleted. Call only
    after ``latest``, the newest step, is committed: resume needs its checkpoint (or, while
    ``latest``'s is still being written in the background, ``previous``'s)."""
    steps = sorted(int(m.group(1)) for p in checkpoints.glob("global_step_*")
                   if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))
    kept = [s for s in steps if is_kept_step(s, save_freq, total_steps)]
    if keep is not None:
        kept = kept[-keep:]
    doomed = [s for s in steps if s not in kept and s not in (latest, previous)]
    for step in doomed:
        shutil.rmtree(checkpoints / f"global_step_{step}", ignore_errors=True)
    return doomed


def commit(run: RunRef, step: int, version: int, summary: dict[str, Any], now: float) -> dict[str, Any]:
    """Checkpoint (the one actor call), then record ``summary`` with its ``outcome`` (the
    controller's ``StepOutcome``: states, decisions, switches) in one transaction."""
    outcome: StepOutcome = summary["outcome"]
    try:
        trainer = ray.get_actor(TRAINER, namespace=run.namespace)
    except ValueError as e:
        raise actor_gone(TRAINER, e) from e
    last = step if summary.get("final") else run.total_steps  # the run's last step, also when the data ends it
    export_hf = is_kept_step(step, run.save_freq, last)
    background = run.async_save and not summary.get("final") and step != run.total_steps
    kill_rank_point("commit", step, run.namespace, run.trainer_gpus)
    ckpt = ray.get(trainer.save_checkpoint.remote(str(checkpoint_path(run, step)), export_hf, background))
    decisions = [dataclasses.asdict(d) for d in outcome.decisions]
    switch_events = [dataclasses.asdict(s) for s in outcome.switch_events]
    record = StoredStep(
        step=step,
        param_version=version,
        started_at=summary["started_at"],
        finished_at=now,
        wall_s=now - summary["started_at"],
        hybrid_active_after=outcome.hybrid_active,
        controller_state=outcome.controller_state,
        data_position={"consumed_total": summary["consumed_total"], "replacements": outcome.replacements},
        policy_state=outcome.policy_state,
        metrics=summary["metrics"],
        switch_events=switch_events,
        decisions=decisions,
        checkpoint=(ckpt["path"], ckpt["sha256"], ckpt["size_bytes"]),
        consumed_prompts=[tuple(p) for p in summary["prompts"]],
    )
    crash_point("commit", step)  # checkpoint on disk, step not yet committed
    with session_scope(open_store(run.storage_url, busy_timeout_ms=run.busy_timeout_ms,
                                  reconnect_timeout_s=run.reconnect_timeout_s), immediate=True) as session:
        db_run = get_run(session, run.uid)
        if db_run is None:
            raise RuntimeError(f"run {run.uid} is not in the store")
        record_step(session, db_run.id, record)
    prune_checkpoints(Path(run.output_dir) / "checkpoints", run.max_actor_ckpt_to_keep, save_freq=run.save_freq,
                      total_steps=last, latest=step, previous=step - 1 if background else None)
    return {"step": step, "checkpoint": ckpt["path"], "decisions": decisions, "switch_events": switch_events}
