"""`tidal compare`: the same job never lending and with the recommended policy, side by side.

Owns: running one ``tidal run`` per setup, one after the other (on a small machine two runs at once
would share its cores and each would measure the other), each into a store of its own under the
output folder; reading both back; the table (``compare.md``) and the plot (``compare.png``). The
setups differ only in the policy: same config, seed, data and split.

Must not: change the job beyond the policy (a policy's switch-cost prior, which `static_fully_async`
refuses, is unset for never lending), or run the setups concurrently.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import ConfigError, load_config
from metrics import lent_spans as spans_of
from metrics import lent_steps, step_split

NEVER_LEND = "static_fully_async"
"""The policy that keeps the hybrids asleep: the trainer's GPUs only train."""
RECOMMENDED = "predictive"
"""The policy the README recommends (docs/policies.md, "Which policy to pick")."""
SETUPS: tuple[tuple[str, list[str]], ...] = (
    ("never lend", [f"async_training.dynamic_schedule_policy={NEVER_LEND}",
                    "async_training.dynamic_schedule_prior_switch_s=null"]),
    (RECOMMENDED, [f"async_training.dynamic_schedule_policy={RECOMMENDED}"]),
)
"""Each setup's label and its overrides on top of the job's own."""
LAST_REWARDS = 10
"""The final reward is the mean over this many last steps (one step's mean reward is noisy)."""


@dataclass(frozen=True)
class SetupRun:
    """One setup's run: its label, policy, the real elapsed seconds of the `tidal run` process
    (start-up and report included) and its committed steps' metric rows, in step order."""

    label: str
    policy: str
    elapsed_s: float
    rows: list[dict[str, Any]]

    @property
    def steps_s(self) -> float:
        return sum(float(r.get("timing_s/step", 0.0)) for r in self.rows)

    @property
    def lent(self) -> int:
        return len(lent_steps(self.rows))

    @property
    def wait_s(self) -> float:
        return sum(step_split(r).wait for r in self.rows)

    @property
    def switch_s(self) -> float:
        return sum(step_split(r).switch for r in self.rows)

    @property
    def final_reward(self) -> float:
        rewards = [float(r["train/reward_mean"]) for r in self.rows if _finite(r.get("train/reward_mean"))]
        last = rewards[-LAST_REWARDS:]
        return sum(last) / len(last) if last else math.nan


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def setup_overrides(label: str) -> list[str]:
    return next(overrides for name, overrides in SETUPS if name == label)


def check(config: str, overrides: Sequence[str]) -> None:
    """Every setup's config loads (``ConfigError`` with one line otherwise): nothing runs before."""
    for _, extra in SETUPS:
        load_config(config, [*overrides, *extra])


def table(runs: Sequence[SetupRun]) -> str:
    """The markdown table: one row per setup, then the speed-up of the last over the first."""
    lines = ["| setup | policy | steps | step time s | elapsed s | steps lent | trainer wait s | switch s | "
             f"reward (last {LAST_REWARDS}) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.label} | `{r.policy}` | {len(r.rows)} | {r.steps_s:.1f} | {r.elapsed_s:.1f} | {r.lent} | "
                     f"{r.wait_s:.1f} | {r.switch_s:.1f} | {r.final_reward:.3f} |")
    if len(runs) >= 2 and runs[-1].steps_s > 0:
        base, best = runs[0], runs[-1]
        lines += ["", f"`{best.policy}` against never lending: the steps took {best.steps_s:.1f} s against "
                      f"{base.steps_s:.1f} s, {base.steps_s / best.steps_s:.3f}× as fast (the summed step times; "
                      f"start-up and report are the same work in both and left out)."]
    return "\n".join(lines) + "\n"


def lent_spans(run: SetupRun) -> list[tuple[float, float]]:
    """The x-ranges to shade for ``run``'s lent steps (``metrics.lent_spans``)."""
    return spans_of(lent_steps(run.rows))


def plot(runs: Sequence[SetupRun], path: Path) -> Path:
    """Three panels over the steps: cumulative step time, the trainer's wait per step, the mean
    reward; the recommended policy's lent steps shaded; legends outside the plotting area."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = ["#4c72b0", "#dd8452"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    fig.suptitle("Same job, never lending vs " + ", ".join(r.policy for r in runs[1:]), fontsize=11)
    for i, run in enumerate(runs):
        steps = [int(r["step"]) for r in run.rows]
        cum, total = [], 0.0
        for r in run.rows:
            total += float(r.get("timing_s/step", 0.0))
            cum.append(total)
        label = f"{run.label} ({run.lent} lent)" if run.lent else run.label
        axes[0].plot(steps, cum, color=colors[i % 2], label=label)
        axes[1].plot(steps, [step_split(r).wait for r in run.rows], color=colors[i % 2], marker="o", ms=2,
                     lw=1, label=run.label)
        axes[2].plot(steps, [r.get("train/reward_mean", math.nan) for r in run.rows], color=colors[i % 2],
                     label=run.label)
    lent = lent_spans(runs[-1]) if runs else []
    for ax, title, ylabel in zip(axes, ("time to reach each step (summed step times)", "trainer wait for samples",
                                        "mean reward"), ("seconds", "seconds per step", "reward")):
        for start, end in lent:
            ax.axvspan(start, end, color="#d8a93b", alpha=0.15, linewidth=0)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if lent:
            handles.append(Patch(color="#d8a93b", alpha=0.3))
            labels.append(f"lent ({runs[-1].policy})")
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("step")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def read_rows(url: str) -> list[dict[str, Any]]:
    """The step rows of the one run in the store at ``url``."""
    import storage
    from storage import open_store, read_step_metrics, session_scope

    with session_scope(open_store(url)) as session:
        runs = storage.list_runs(session)
        if len(runs) != 1:
            raise RuntimeError(f"{url}: expected one run, found {len(runs)}")
        return read_step_metrics(session, runs[0].uid)


def run_setup(config: str, overrides: Sequence[str], label: str, out: Path, steps: int | None,
              say: Callable[[str], None]) -> SetupRun:
    """``tidal run`` for one setup into ``out/<label>/`` (its own store), its step lines forwarded."""
    folder = out / label.replace(" ", "-")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    url = f"sqlite:///{folder.resolve()}/tidal.db"
    extra = [*overrides, *setup_overrides(label), f"storage.url={url}",
             f"trainer.default_local_dir={folder.resolve()}/runs", "lifecycle.progress=lines",
             *([f"trainer.total_training_steps={steps}"] if steps else [])]
    args = [sys.executable, "-m", "flows.cli", "run", config, *(a for o in extra for a in ("--set", o))]
    policy = setup_overrides(label)[0].split("=", 1)[1]
    say(f"== {label}: tidal run {config} (policy {policy})")
    started = time.monotonic()
    with open(folder / "run.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith(("step ", "done:", "tidal: ")):
                say("   " + line.rstrip())
        code = proc.wait()
    elapsed = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"the {label} run exited {code}; its log: {folder / 'run.log'}")
    say(f"== {label}: done in {elapsed:.1f} s")
    return SetupRun(label=label, policy=policy, elapsed_s=elapsed, rows=read_rows(url))


def compare_main(config: str, overrides: Sequence[str], steps: int | None, out: Path, readme_figure: bool,
                 say: Callable[[str], None] = print) -> dict[str, str]:
    """Run the setups one after the other, then write ``compare.md`` and ``compare.png`` into
    ``out`` (and the PNG to ``docs/images/compare.png`` with ``readme_figure``); their paths."""
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: must be at least 1")
    check(config, overrides)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_setup(config, overrides, label, out, steps, say) for label, _ in SETUPS]
    text = table(runs)
    (out / "compare.md").write_text(f"# `tidal compare {config}`\n\n{text}", encoding="utf-8")
    png = plot(runs, out / "compare.png")
    written = {"table": str(out / "compare.md"), "plot": str(png)}
    if readme_figure:
        figure = Path(__file__).resolve().parents[1] / "docs" / "images" / "compare.png"
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, figure)
        written["readme_figure"] = str(figure)
    say(text)
    say("wrote " + ", ".join(written.values()))
    return written
