"""The per-step artifact: decisions with reasons, switch timings and the step's metrics (markdown)."""

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


def artifact_key(uid: str, step: int) -> str:
    """Prefect keys allow lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9-]+", "-", uid.lower()).strip("-")
    return f"{slug}-step-{step:05d}"


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
