"""The run report: a markdown artifact (Prefect) and PNG plots next to the run's outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config import TidalConfig
from storage import open_store, read_step_metrics, session_scope

PLOTTED = {
    "dynamic_resource/mq_size": "queue size (samples)",
    "dynamic_resource/resource_utilization": "cluster utilization",
    "dynamic_resource/train_resource_utilization": "train utilization",
    "dynamic_resource/rollout_resource_utilization": "rollout utilization",
    "timing_s/step": "step time (s)",
    "train/reward_mean": "mean reward",
}


def write_report(cfg: TidalConfig, uid: str, out_dir: Path) -> dict[str, Any]:
    with session_scope(open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms)) as session:
        rows = read_step_metrics(session, uid)
    png = _plot(rows, out_dir / "report.png")
    lines = [f"# Tidal run `{uid}`", "", f"policy `{cfg.async_training.dynamic_schedule_policy}`, "
             f"{cfg.trainer_gpus} trainer + {cfg.standalone_gpus} rollout GPU(s), {len(rows)} steps", "",
             "| step | step s | reward | mq_size | cluster util | hybrid |", "|---|---|---|---|---|---|"]
    for row in rows:
        m = row.get("metrics", row)
        lines.append(
            f"| {row['step']} | {m.get('timing_s/step', 0):.2f} | {m.get('train/reward_mean', float('nan')):.3f} | "
            f"{m.get('dynamic_resource/mq_size', 0):.0f} | {m.get('dynamic_resource/resource_utilization', 0):.2f} | "
            f"{'lent' if m.get('dynamic_resource/hybrid_active') else '-'} |"
        )
    text = "\n".join(lines) + "\n"
    md = out_dir / "report.md"
    md.write_text(text, encoding="utf-8")
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(markdown=text, key=f"run-{uid}".lower().replace("_", "-")[:60],
                                 description="Tidal run report")
    except Exception:  # noqa: BLE001 - the files are the report; the artifact is a view of it
        pass
    return {"markdown": str(md), "plot": png, "steps": len(rows)}


def _plot(rows: list[dict[str, Any]], path: Path) -> str | None:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PLOTTED), 1, figsize=(8, 2.2 * len(PLOTTED)), sharex=True)
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes, PLOTTED.items()):
        ax.plot(steps, [r.get("metrics", r).get(key, float("nan")) for r in rows], marker="o", ms=3)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
