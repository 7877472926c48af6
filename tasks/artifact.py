"""What a run shows in the Prefect UI: the step artifact (decisions with reasons, switch timings
and the step's metrics, markdown: one key per run, a version per step) and the run's step table
(one key per run, a row per step). Must not: read the store (the commit task passes the rows)."""

from __future__ import annotations

import contextvars
import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
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


ANSWERED_BY = {"should_deactivate": "should_deactivate", "should_activate": "should_activate_after_step"}
"""The policy hook whose answer a skip reason names (its own reason is added to the skip's)."""


def step_markdown(step: int, decisions: list[dict[str, Any]], switches: list[dict[str, Any]],
                  metrics: dict[str, float], skipped: Sequence[tuple[str, str]] = ()) -> str:
    """The step's artifact: the policy's answers with reasons, the phases skipped with why, the
    switches and the headline metrics."""
    lines = [f"## step {step}", "", "| hook | answer | reason | ms |", "|---|---|---|---|"]
    for d in decisions:
        reason = str(d.get("reason", "")).replace("|", "\\|")
        lines.append(f"| {d['hook']} | {d['answer']} | {reason} | {1000 * d.get('duration_s', 0.0):.2f} |")
    if skipped:
        reasons = {d["hook"]: str(d.get("reason", "")) for d in decisions}
        lines += ["", "| skipped task | why |", "|---|---|"]
        for task, why in skipped:
            hook = next((h for name, h in ANSWERED_BY.items() if why.startswith(name)), None)
            if hook and reasons.get(hook):
                why = f"{why}: {reasons[hook]}"
            lines.append(f"| {task} | {why.replace('|', chr(92) + '|')} |")
    lines += ["", "| switch | seconds | phases | aborted |", "|---|---|---|---|"]
    for s in switches:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in s.get("phases", {}).items())
        lines.append(f"| {s['kind']} | {s['duration_s']:.3f} | {phases} | {s.get('aborted', 0)} |")
    lines += ["", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {metrics[k]:.4g} |" for k in SHOWN_METRICS if k in metrics]
    lines += [f"| {k} | {v:.4g} |" for k, v in sorted(metrics.items()) if k.startswith("val-core/")]
    return "\n".join(lines) + "\n"


def publish_step(run: Any, step: int, result: dict[str, Any], metrics: dict[str, float],
                 skipped: Sequence[tuple[str, str]] = ()) -> None:
    """The step's markdown (a new version of the run's step key) and the run's step table, read
    back from the store so that a resumed run's table has every step. The two are posted at the
    same time (the markdown from a helper thread in a copy of this task run's context): a step
    waits for one API round trip instead of two."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from storage import open_store, read_step_metrics, session_scope

    markdown = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-artifact")
    try:
        posted = markdown.submit(contextvars.copy_context().run, create_markdown_artifact, _sync=True,
                                 key=artifact_key(run.uid, "step"),
                                 markdown=step_markdown(step, result["decisions"], result["switch_events"], metrics,
                                                        skipped),
                                 description=f"Tidal run {run.uid}: step {step} decisions, switches and metrics")
        with session_scope(open_store(run.storage_url, busy_timeout_ms=run.busy_timeout_ms,
                                  reconnect_timeout_s=run.reconnect_timeout_s)) as session:
            rows = read_step_metrics(session, run.uid, [metric for metric, _ in TABLE_COLUMNS])
        create_table_artifact(key=artifact_key(run.uid, "steps"), table=step_table(rows),
                              description=f"Tidal run {run.uid}: one row per committed step (policy {run.policy})")
        posted.result()
    finally:
        markdown.shutdown(wait=True)


class RunProgress:
    """The run's progress artifact (``<run>-progress``), posted off the step loop's path.

    ``show(done)`` queues the update and returns at once; one background thread posts the updates
    in call order (created on the first, updated after), each in a copy of the caller's context
    (its flow run and Prefect client), so the driver starts the next step without waiting for the
    API's answer (a round trip per step boundary, ~0.05-0.08 s on a loaded 2-core machine). A
    post waits until the next step's data plane is busy (``release``; at most ``hold_s``), so it
    does not queue at the server beside the next step's start.
    ``close()`` (the ``with`` block's end) releases and waits up to ``drain_s`` for what is queued. A
    failed post is logged as a warning and the later ones still go: the progress bar is not worth
    a run. ``create``/``update``: Prefect's progress-artifact functions (tests pass recorders).
    """

    def __init__(self, uid: str, total: int, *, create: Any = None, update: Any = None, drain_s: float = 10.0,
                 hold_s: float = 30.0):
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        self.uid, self.total, self.drain_s, self.hold_s = uid, total, drain_s, hold_s
        self._create, self._update = create or create_progress_artifact, update or update_progress_artifact
        self._artifact_id: Any = None
        self._pending: list[Future] = []
        self._go = threading.Event()
        self._poster = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-progress")

    def show(self, done: int) -> None:
        """Queue ``done`` of ``total`` steps committed (posted once the next step's data plane works)."""
        self._go.clear()
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._poster.submit(contextvars.copy_context().run, self._post, done))

    def release(self) -> None:
        """A step's data plane is busy: the queued posts may go."""
        self._go.set()

    def _post(self, done: int) -> None:
        self._go.wait(self.hold_s)
        percent = 100.0 * done / self.total if self.total else 100.0
        description = f"Tidal run {self.uid}: {done} of {self.total} steps committed"
        try:
            if self._artifact_id is None:
                self._artifact_id = self._create(progress=percent, key=artifact_key(self.uid, "progress"),
                                                 description=description)
            else:
                self._update(artifact_id=self._artifact_id, progress=percent, description=description)
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            logging.getLogger("tidal.artifact").warning("progress artifact of run %s not updated: %s", self.uid, exc)

    def close(self, drain_s: float | None = None) -> None:
        self._go.set()
        wait(self._pending, timeout=self.drain_s if drain_s is None else drain_s)
        self._poster.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.close(None if kind is None else min(self.drain_s, 1.0))  # a failing run does not wait long
