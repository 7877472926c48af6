"""What the terminal shows while a run goes: start-up stages, one line (or a live bar) per step, a summary.

Owns: ``Progress`` (the interface the driver and the flow report to: ``stage``, ``begin``,
``phase``, ``step``, ``done``), its two faces (``LiveProgress``: a rich live display on a terminal;
``LineProgress``: one plain line per step, for CI, workers and pipes) and ``current()``, the one
this process reports to. Must not: read the store, talk to Prefect or Ray, or print Prefect's logs.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from config import TidalConfig
from metrics import lending_gain, lent_steps


def step_line(step: int, total: int | None, result: dict[str, Any], eta_s: float | None) -> str:
    m = result["metrics"]
    of = f"/{total}" if total else ""
    eta = f"  eta {eta_s:5.0f}s" if eta_s is not None else ""
    return (f"step {step:>4}{of}  {m.get('timing_s/step', 0.0):6.2f}s  "
            f"reward {m.get('train/reward_mean', float('nan')):.3f}  "
            f"queue {int(m.get('dynamic_resource/mq_size', 0)):>3}  "
            f"util {m.get('dynamic_resource/resource_utilization', 0.0):.2f}  "
            f"hybrid {'lent' if result['hybrid_active'] else 'training'}{eta}")


class Progress:
    """Base: keeps the numbers both faces show; prints nothing itself."""

    def __init__(self, uid: str = "", cfg: TidalConfig | None = None) -> None:
        self.uid = uid
        self.cfg = cfg
        self.started = time.monotonic()
        self.first_step = 1
        self.last_step: int | None = None
        self.steps_done = 0
        self.step_started = time.monotonic()
        self._steps_since = self.step_started
        self.rewards: list[float] = []
        self.rows: list[dict[str, Any]] = []  # each committed step's metrics, for what lending bought

    def headline(self) -> str:
        cfg = self.cfg
        if cfg is None:
            return f"tidal run {self.uid}"
        return (f"tidal run {self.uid}: {cfg.trainer_gpus} trainer GPU(s), {cfg.standalone_gpus} rollout GPU(s), "
                f"policy {cfg.async_training.dynamic_schedule_policy}")

    def stage(self, name: str) -> None:
        """A start-up stage begins (Prefect server, store, Ray, actors, weights)."""

    def begin(self, first_step: int, last_step: int) -> None:
        """The steps ``first_step..last_step`` are about to run."""
        self.first_step, self.last_step = first_step, last_step
        self.step_started = time.monotonic()

    def phase(self, name: str) -> None:
        """The current step entered phase ``name``."""

    def eta_s(self) -> float | None:
        if self.last_step is None or not self.steps_done:
            return None
        per_step = (time.monotonic() - self._steps_since) / self.steps_done
        return per_step * max(0, self.last_step - (self.first_step + self.steps_done - 1))

    def step(self, step: int, result: dict[str, Any]) -> None:
        """Step ``step`` committed with ``result`` (the step flow's return value)."""
        if not self.steps_done:
            self._steps_since = self.step_started
        self.steps_done += 1
        reward = result["metrics"].get("train/reward_mean")
        if reward is not None and not math.isnan(reward):
            self.rewards.append(reward)
        self.rows.append({**result["metrics"], "step": step, "hybrid_active_after": result["hybrid_active"]})
        self.step_started = time.monotonic()

    def summary(self, report: dict[str, Any] | None) -> str:
        wall = time.monotonic() - self.started
        reward = f", reward {self.rewards[0]:.3f} → {self.rewards[-1]:.3f}" if self.rewards else ""
        where = f"; report {report.get('markdown')}" if report else ""
        gain = lending_gain(self.rows)
        lent = f"; {gain.sentence()}" if gain else (
            f"; lent on {len(lent_steps(self.rows))} of {len(self.rows)} steps" if self.rows else "")
        return f"done: {self.steps_done} step(s) in {wall:.1f}s{reward}{lent}{where}"

    def done(self, report: dict[str, Any] | None) -> None:
        """The run finished; ``report`` is ``write_report``'s answer."""

    def close(self) -> None:
        """Stop any live display (the run ended, however it ended)."""


class LineProgress(Progress):
    """One plain line per step (no colour, no cursor moves): for pipes, CI logs and workers."""

    def __init__(self, uid: str = "", cfg: TidalConfig | None = None, out: TextIO | None = None) -> None:
        super().__init__(uid, cfg)
        self.out = out or sys.stdout
        self._said_headline = False

    def _say(self, line: str) -> None:
        self.out.write(line + "\n")  # not print(): the flows' log_prints would send it to the log instead
        self.out.flush()

    def begin(self, first_step: int, last_step: int) -> None:
        super().begin(first_step, last_step)
        self._say(f"{self.headline()}; steps {first_step}..{last_step}")

    def step(self, step: int, result: dict[str, Any]) -> None:
        super().step(step, result)
        self._say(step_line(step, self.cfg.trainer.total_training_steps if self.cfg else None, result, self.eta_s()))

    def done(self, report: dict[str, Any] | None) -> None:
        self._say(self.summary(report))


class LiveProgress(Progress):
    """A rich live display: the start-up stages, then a step bar with ETA, the current phase and
    the last step's reward, queue, utilization and hybrid state; the summary at the end."""

    def __init__(self, uid: str = "", cfg: TidalConfig | None = None, console: Console | None = None) -> None:
        super().__init__(uid, cfg)
        self.console = console or Console(highlight=False)
        self.bar = RichProgress(TextColumn("[bold]steps"), BarColumn(), MofNCompleteColumn(), TextColumn("eta"),
                                TimeRemainingColumn(), TextColumn("elapsed"), TimeElapsedColumn(),
                                console=self.console, auto_refresh=False)
        self.task: Any = None
        self.stages: list[tuple[str, float]] = []
        self.current_phase = ""
        self.last_line = ""
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def _render(self) -> Group:
        parts: list[Any] = [Text(self.headline(), style="bold")]
        if self.task is None:
            now = time.monotonic()
            for i, (name, since) in enumerate(self.stages):
                end = self.stages[i + 1][1] if i + 1 < len(self.stages) else now
                mark = "✓" if i + 1 < len(self.stages) else "…"
                parts.append(Text(f"  {mark} {name} ({end - since:.1f}s)"))
        else:
            parts.append(self.bar)
            parts.append(Text(f"  phase: {self.current_phase or '-'}", style="cyan"))
            if self.last_line:
                parts.append(Text(f"  last: {self.last_line}"))
        return Group(*parts)

    def _refresh(self) -> None:
        self.live.update(self._render(), refresh=True)

    def stage(self, name: str) -> None:
        self.stages.append((name, time.monotonic()))
        self._refresh()

    def begin(self, first_step: int, last_step: int) -> None:
        super().begin(first_step, last_step)
        self.task = self.bar.add_task("steps", total=last_step - first_step + 1)
        self._refresh()

    def phase(self, name: str) -> None:
        self.current_phase = name
        self._refresh()

    def step(self, step: int, result: dict[str, Any]) -> None:
        super().step(step, result)
        self.bar.advance(self.task)
        self.last_line = step_line(step, self.cfg.trainer.total_training_steps if self.cfg else None, result, None)
        self._refresh()

    def done(self, report: dict[str, Any] | None) -> None:
        self.current_phase = "finished"
        self._refresh()
        self.close()
        self.console.print(self.summary(report))

    def close(self) -> None:
        if self.live.is_started:
            self.live.stop()


_CURRENT: list[Progress] = []


def open_progress(uid: str, cfg: TidalConfig, mode: str | None = None) -> Progress:
    """The display for this run (``lifecycle.progress``: live on a terminal, lines otherwise),
    made this process's ``current()``."""
    mode = mode or cfg.lifecycle.progress
    if mode == "auto":
        mode = "live" if sys.stdout.isatty() else "lines"
    progress: Progress = LiveProgress(uid, cfg) if mode == "live" else LineProgress(uid, cfg)
    _CURRENT.append(progress)
    return progress


def current(uid: str, cfg: TidalConfig) -> Progress:
    """The display this process reports to; a ``LineProgress`` when no driver opened one (a flow
    run started by a deployment)."""
    if not _CURRENT or _CURRENT[-1].uid != uid:
        _CURRENT.append(LineProgress(uid, cfg))
    return _CURRENT[-1]


def close_progress() -> None:
    while _CURRENT:
        _CURRENT.pop().close()


def report_phase(name: str) -> None:
    """Tell the current display (if any) that the step entered ``name``."""
    if _CURRENT:
        _CURRENT[-1].phase(name)
