"""Per-step progress in the terminal: one rich line per step (time, reward, queue, hybrid state)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from config import TidalConfig


class StepPrinter:
    def __init__(self, uid: str, cfg: TidalConfig, console: Console | None = None):
        self.console = console or Console(stderr=True, highlight=False)
        self.total = cfg.trainer.total_training_steps
        self.console.print(f"[bold]tidal[/] run [cyan]{uid}[/]: {cfg.trainer_gpus} trainer GPU(s), "
                           f"{cfg.standalone_gpus} rollout GPU(s), policy {cfg.async_training.dynamic_schedule_policy}")

    def step(self, step: int, result: dict[str, Any]) -> None:
        m = result["metrics"]
        of = f"/{self.total}" if self.total else ""
        hybrid = "[green]lent[/]" if result["hybrid_active"] else "[dim]training[/]"
        self.console.print(
            f"step {step:>4}{of}  {m.get('timing_s/step', 0.0):6.2f}s  "
            f"reward {m.get('train/reward_mean', float('nan')):.3f}  "
            f"queue {int(m.get('dynamic_resource/mq_size', 0)):>3}  "
            f"util {m.get('dynamic_resource/resource_utilization', 0.0):.2f}  hybrid {hybrid}"
        )

    def done(self, report: dict[str, Any]) -> None:
        self.console.print(f"[bold green]done[/]: report {report.get('markdown')}")
