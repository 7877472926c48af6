"""What a run shows in the Prefect UI: the step artifact (decisions with reasons, switch timings
and the step's metrics, markdown: one key per run, a version per step) and the run's step table
(one key per run, a row per step). Must not: read the store (the commit task passes the rows)."""

from __future__ import annotations

import re
from typing import Any

SHOWN_METRICS = (
    "timing_s/step", "train/reward_mean", "dynamic_resource/mq_size",
    "dynamic_resource/train_resource_utilization", "dynamic_resource/rollout_resource_utilization",
    "dynamic_resource/resource_utilization", "timing_s/wait_for_enough_samples", "waste/switch_s",
    "waste/aborted_tokens", "waste/reprefilled_tokens", "fully_async/step_generated_samples",
    "fully_async/rollouter/step_generated_samples", "fully_async/max_staleness",
)


TABLE_COLUMNS = (("timing_s/step", "step s"), ("train/reward_mean", "reward"), ("dynamic_resource/mq_size", "queue"),
                 ("dynamic_resource/resource_utilization", "utilization"))


def artifact_key(uid: str, kind: str) -> str:
    """``<run>-<kind>``; Prefect keys allow lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9-]+", "-", uid.lower()).strip("-")
    return f"{slug}-{kind}"


def step_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's step table from ``storage.read_step_metrics`` rows: a row per step, rounded."""
    table = []
    for row in rows:
        cells: dict[str, Any] = {"step": row["step"], "version": row["param_version"],
                                 "lent after": "yes" if row["hybrid_active_after"] else "no"}
        for metric, column in TABLE_COLUMNS:
            value = row.get(metric)
            cells[column] = None if value is None or value != value else float(f"{value:.4g}")
        table.append(cells)
    return table


def step_markdown(step: int, decisions: list[dict[str, Any]], switches: list[dict[str, Any]],
                  metrics: dict[str, float]) -> str:
    lines = [f"## step {step}", "", "| hook | answer | reason | ms |", "|---|---|---|---|"]
    for d in decisions:
        reason = str(d.get("reason", "")).replace("|", "\\|")
        lines.append(f"| {d['hook']} | {d['answer']} | {reason} | {1000 * d.get('duration_s', 0.0):.2f} |")
    lines += ["", "| switch | seconds | phases | aborted |", "|---|---|---|---|"]
    for s in switches:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in s.get("phases", {}).items())
        lines.append(f"| {s['kind']} | {s['duration_s']:.3f} | {phases} | {s.get('aborted', 0)} |")
    lines += ["", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {metrics[k]:.4g} |" for k in SHOWN_METRICS if k in metrics]
    lines += [f"| {k} | {v:.4g} |" for k, v in sorted(metrics.items()) if k.startswith("val-core/")]
    return "\n".join(lines) + "\n"


def publish_step(run: Any, step: int, result: dict[str, Any], metrics: dict[str, float]) -> None:
    """The step's markdown (a new version of the run's step key) and the run's step table, read
    back from the store so that a resumed run's table has every step."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from storage import open_store, read_step_metrics, session_scope

    create_markdown_artifact(
        key=artifact_key(run.uid, "step"),
        markdown=step_markdown(step, result["decisions"], result["switch_events"], metrics),
        description=f"Tidal run {run.uid}: step {step} decisions, switches and metrics",
    )
    with session_scope(open_store(run.storage_url, busy_timeout_ms=run.busy_timeout_ms)) as session:
        rows = read_step_metrics(session, run.uid)
    create_table_artifact(key=artifact_key(run.uid, "steps"), table=step_table(rows),
                          description=f"Tidal run {run.uid}: one row per committed step (policy {run.policy})")


def run_progress(uid: str, done: int, total: int, artifact_id: Any = None) -> Any:
    """The run's progress artifact (``<run>-progress``): created on the first call, then updated;
    returns its id for the next call. ``done`` of ``total`` steps."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    percent = 100.0 * done / total if total else 100.0
    description = f"Tidal run {uid}: {done} of {total} steps committed"
    if artifact_id is None:
        return create_progress_artifact(progress=percent, key=artifact_key(uid, "progress"), description=description)
    update_progress_artifact(artifact_id=artifact_id, progress=percent, description=description)
    return artifact_id
