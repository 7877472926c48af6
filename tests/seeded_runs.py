"""A store with runs and committed steps written through the store functions, for the tests of
what reads runs back (`tidal runs`, `tidal report`, the trackers' catch-up). No Ray, no Prefect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config import load_config, write_resolved
from storage import StoredStep, create_run, get_run, migrate, open_store, record_step, session_scope, sqlite_url


def step_metrics(step: int, *, lent: bool = False) -> dict[str, float]:
    """A step's metrics under the stored names, with numbers that differ per step."""
    return {
        "timing_s/step": 2.0 + step,
        "dynamic_resource/train_compute_time_s": 1.0,
        "timing_s/wait_for_enough_samples": 0.25 * step,
        "timing_s/wait_for_samples_in_train": 0.25,
        "waste/switch_s": 0.5 if lent else 0.0,
        "timing_s/param_sync": 0.125,
        "train/reward_mean": 0.1 * step,
        "actor/pg_loss": -0.5 * step,
        "dynamic_resource/mq_size": float(4 * step),
        "dynamic_resource/resource_utilization": 0.5,
        "dynamic_resource/train_resource_utilization": 0.75,
        "dynamic_resource/rollout_resource_utilization": 0.25,
        "fully_async/param_version": float(step),
        "dynamic_resource/hybrid_active": 1.0 if lent else 0.0,
        "val-core/tidal/arith/reward/mean@4": 0.5,
    }


def seeded_store(tmp_path: Path, runs: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Path]]:
    """A SQLite store under ``tmp_path`` with ``runs``: uid → {policy, steps, lent (set of steps
    after which the hybrid stayed lent), total (trainer.total_training_steps), status}. Each run
    gets its folder with its resolved config; returns (store URL, uid → run folder)."""
    url = sqlite_url(tmp_path / "store.db")
    engine = open_store(url)
    migrate(engine)
    folders: dict[str, Path] = {}
    for uid, spec in runs.items():
        out = tmp_path / "runs" / uid
        cfg = load_config("tiny-cpu", [f"storage.url={url}", f"trainer.default_local_dir={tmp_path / 'runs'}",
                                       f"async_training.dynamic_schedule_policy={spec.get('policy', 'default')}",
                                       f"trainer.total_training_steps={spec.get('total', 'null')}"])
        write_resolved(cfg, out)
        folders[uid] = out
        with session_scope(engine) as session:
            run = create_run(session, uid=uid, name="tiny", project="tidal", policy=spec.get("policy", "default"),
                             seed=0, config=cfg.model_dump(mode="json"), output_dir=str(out))
            lent = spec.get("lent", set())
            for n in range(1, spec.get("steps", 0) + 1):
                record_step(session, run.id, StoredStep(
                    step=n, param_version=n, started_at=1000.0 + 10 * n, finished_at=1000.0 + 10 * n + 2 + n,
                    hybrid_active_after=n in lent, metrics=step_metrics(n, lent=n - 1 in lent)))
            if "status" in spec:
                get_run(session, uid).status = spec["status"]
    return url, folders
