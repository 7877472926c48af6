"""The run report: ``report.md`` and ``report.png`` in the run folder, read from the store alone.

Owns what the report shows (``ReportData``: the per-step series, the step-time split, the steps
with the hybrid lent) and drawing it. Must not: need a Prefect server or Ray — ``tidal report``
runs it offline; only a caller inside a flow run asks for the Prefect artifact as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from config import TidalConfig
from metrics import SPLIT_PARTS, LendingGain, StepSplit, lending_gain, lent_spans, lent_steps, step_split
from storage import open_store, read_step_metrics, session_scope

SERIES = {
    "train/reward_mean": "mean reward",
    "dynamic_resource/mq_size": "queue (samples)",
    "dynamic_resource/resource_utilization": "cluster",
    "dynamic_resource/train_resource_utilization": "train",
    "dynamic_resource/rollout_resource_utilization": "rollout",
}
"""The metrics the report plots, with their labels."""

SPLIT_COLORS = {"train": "#4c72b0", "wait": "#dd8452", "switch": "#c44e52", "sync": "#8172b3", "other": "#b0b0b0"}
LENT_COLOR = "#d8a93b"


@dataclass(frozen=True)
class ReportData:
    """Everything the PNG is drawn from (tests check this, not pixels)."""

    uid: str
    policy: str
    steps: list[int]
    series: dict[str, list[float]]
    """Metric name → one value per step (NaN where the step has none)."""
    split: list[StepSplit]
    lent: list[int]
    """Steps during which the hybrid replicas were lent (``metrics.lent_steps``)."""
    gain: LendingGain | None = None
    """What lending bought, measured in the run (``metrics.lending_gain``)."""
    title: str = field(init=False)

    def __post_init__(self) -> None:
        lent = f", hybrid lent in {len(self.lent)} of {len(self.steps)} steps" if self.steps else ""
        if self.gain is not None:
            verb = "bought" if self.gain.bought_s >= 0 else "cost"
            lent += f" ({verb} ≈ {abs(self.gain.bought_s):.1f} s, estimated)"
        object.__setattr__(self, "title", f"Tidal run {self.uid} · policy {self.policy}{lent}")

    def lent_spans(self) -> list[tuple[float, float]]:
        """The x spans shaded as "hybrid lent" (``metrics.lent_spans``)."""
        return lent_spans(self.lent)


def report_data(uid: str, policy: str, rows: list[dict[str, Any]]) -> ReportData:
    """The report's data from ``storage.read_step_metrics`` rows."""
    nan = float("nan")
    return ReportData(
        uid=uid, policy=policy, steps=[int(r["step"]) for r in rows],
        series={name: [float(r.get(name, nan)) for r in rows] for name in SERIES},
        split=[step_split(r) for r in rows], lent=lent_steps(rows), gain=lending_gain(rows),
    )


def write_report(cfg: TidalConfig, uid: str, out_dir: Path, *, artifact: bool = True) -> dict[str, Any]:
    """Write ``report.md`` and (with steps) ``report.png`` into ``out_dir``; ``artifact``: also
    the Prefect markdown artifact (only inside a flow run: it needs the Prefect API)."""
    with session_scope(open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms)) as session:
        rows = read_step_metrics(session, uid)
    data = report_data(uid, cfg.async_training.dynamic_schedule_policy, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_report(data, out_dir / "report.png") if rows else None
    text = report_markdown(cfg, data, rows)
    md = out_dir / "report.md"
    md.write_text(text, encoding="utf-8")
    if artifact:
        try:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(markdown=text, key=f"run-{uid}".lower().replace("_", "-")[:60],
                                     description="Tidal run report")
        except Exception:  # noqa: BLE001 - the files are the report; the artifact is a view of it
            pass
    return {"markdown": str(md), "plot": str(png) if png else None, "steps": len(rows)}


def report_markdown(cfg: TidalConfig, data: ReportData, rows: list[dict[str, Any]]) -> str:
    gain = data.gain
    bought = (f"**What lending bought**: {gain.sentence()}. The estimate compares {LendingGain.BASIS}; those "
              "steps ran at other moments of the run, and `tidal compare` runs the same job without lending beside it."
              if gain else f"The hybrids were lent on {len(data.lent)} of {len(rows)} steps: no comparison to make.")
    lines = [f"# Tidal run `{data.uid}`", "", f"policy `{data.policy}`, {cfg.trainer_gpus} trainer + "
             f"{cfg.standalone_gpus} rollout GPU(s), {len(rows)} steps", "", bought, "",
             "| step | step s | train s | wait s | switch s | sync s | reward | mq_size | cluster util | hybrid |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lent = set(data.lent)
    for row, split in zip(rows, data.split):
        lines.append(
            f"| {row['step']} | {row.get('timing_s/step', 0):.2f} | {split.train:.2f} | {split.wait:.2f} | "
            f"{split.switch:.2f} | {split.sync:.2f} | {row.get('train/reward_mean', float('nan')):.3f} | "
            f"{row.get('dynamic_resource/mq_size', 0):.0f} | {row.get('dynamic_resource/resource_utilization', 0):.2f} | "
            f"{'lent' if row['step'] in lent else '-'} |"
        )
    return "\n".join(lines) + "\n"


def plot_report(data: ReportData, path: Path) -> Path:
    """Four panels over the steps, each titled, legends outside the plotting area: the step time
    stacked by part, the mean reward, the queue, the three utilizations; green spans = lent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    fig.suptitle(data.title, fontsize=11)
    x = data.steps
    bottom = [0.0] * len(x)
    time_ax = axes[0]
    for part in SPLIT_PARTS:
        heights = [getattr(s, part) for s in data.split]
        time_ax.bar(x, heights, bottom=bottom, width=0.8, color=SPLIT_COLORS[part], label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    time_ax.set_title("step time by part", fontsize=9)
    time_ax.set_ylabel("seconds", fontsize=8)
    panels = [
        (axes[1], "mean reward", "reward", ["train/reward_mean"]),
        (axes[2], "queue size (samples, after the step)", "samples", ["dynamic_resource/mq_size"]),
        (axes[3], "resource utilization", "utilization", ["dynamic_resource/resource_utilization",
                                                          "dynamic_resource/train_resource_utilization",
                                                          "dynamic_resource/rollout_resource_utilization"]),
    ]
    for ax, title, ylabel, names in panels:
        for name in names:
            ax.plot(x, data.series[name], marker="o", ms=3, label=SERIES[name])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in axes:
        for lo, hi in data.lent_spans():
            ax.axvspan(lo, hi, color=LENT_COLOR, alpha=0.15, linewidth=0)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if data.lent:
            handles.append(Patch(color=LENT_COLOR, alpha=0.3))
            labels.append("hybrid lent")
        # outside the axes, right of them: a legend never covers a line or a bar
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
