"""Experiment trackers (`trainer.logger`): every committed step's metrics to JSONL, TensorBoard, W&B
and MLflow, on the global step axis.

Owns: the backends (each behind ``log(data, step)`` / ``close()``, its package imported only when
listed), ``StepTrackers`` (the one object the driver feeds after each committed step: it skips
steps already logged, catches up steps committed but never logged, keeps the run's session clock)
and the record of the last logged step (``<run>/trackers.json``). Must not: stop a run — a missing
package or a tracker that raises is one warning, and that tracker is off for the rest of the run.
The metric names are the step's stored names (``dynamic_resource/*``, ``fully_async/*``,
``actor/*``, ``val-core/*``, ``timing_s/*``). More: ``docs/trackers.md``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from config import TidalConfig, to_plain
from flows.run_clock import SessionClock
from metrics import tracked_scalars
from storage import open_store, read_step_metrics, redact_url, session_scope

log = logging.getLogger("tidal.trackers")

METRICS_FILE = "metrics.jsonl"
WATERMARK_FILE = "trackers.json"
STEP_COLUMNS = frozenset({"step", "param_version", "started_at", "finished_at", "wall_s", "hybrid_active_after"})
"""Columns of ``storage.read_step_metrics`` rows that are the step's own, not metrics."""


class Tracker(Protocol):
    name: str

    def log(self, data: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class FileTracker:
    """``<run>/metrics.jsonl``: one ``{"step": N, "data": {name: value}}`` line per step."""

    name = "file"

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / METRICS_FILE

    def log(self, data: Mapping[str, float], step: int) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "data": dict(data)}) + "\n")

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """TensorBoard event files under ``<run>/tensorboard/`` (one more file per resume)."""

    name = "tensorboard"

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, data: Mapping[str, float], step: int) -> None:
        for name, value in data.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run with the Tidal run id as its id (a resume continues it), under ``<run>/wandb/``;
    offline by default (``tracking.wandb_mode``): no network, no account."""

    name = "wandb"

    def __init__(self, out_dir: Path, uid: str, cfg: TidalConfig, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.trainer.project_name, group=cfg.trainer.experiment_name, name=uid, id=_slug(uid),
            dir=str(out_dir), mode=cfg.tracking.wandb_mode, resume="allow", config=config,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def log(self, data: Mapping[str, float], step: int) -> None:
        self.run.log(dict(data), step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_NAME = re.compile(r"[^\w\-. /:]")


def mlflow_name(name: str) -> str:
    """MLflow allows letters, digits, ``_ - . / :`` and spaces in a metric name: the rest become
    ``_`` (``val-core/x/reward/mean@4`` → ``val-core/x/reward/mean_4``)."""
    return _MLFLOW_NAME.sub("_", name)


class MlflowTracker:
    """An MLflow run (experiment = ``trainer.project_name``, tag ``tidal.run_id``; a resume finds
    and continues it) in ``tracking.mlflow_tracking_uri``, by default ``<run>/mlflow.db``."""

    name = "mlflow"

    def __init__(self, out_dir: Path, uid: str, cfg: TidalConfig, config: dict[str, Any]) -> None:
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its schema upgrade logs at INFO
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.uri = cfg.tracking.mlflow_tracking_uri or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        with warnings.catch_warnings():  # its SQL store maps its tables with a deprecated SQLAlchemy option
            warnings.simplefilter("ignore", DeprecationWarning)
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self.client.get_experiment_by_name(cfg.trainer.project_name)
        # artifacts (the run's config) next to the store, never in the working directory
        eid = experiment.experiment_id if experiment else self.client.create_experiment(
            cfg.trainer.project_name, artifact_location=(out_dir / "mlflow-artifacts").resolve().as_uri())
        found = self.client.search_runs([eid], filter_string=f"tags.`tidal.run_id` = '{uid}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(eid, run_name=uid, tags={"tidal.run_id": uid,
                                                                   "tidal.policy": cfg.async_training.dynamic_schedule_policy})
            self.run_id = run.info.run_id
            self.client.log_dict(self.run_id, config, "config.json")

    def log(self, data: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, ms, step) for k, v in data.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _slug(uid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", uid)[:128]


def _build(name: str, out_dir: Path, uid: str, cfg: TidalConfig, config: dict[str, Any]) -> Tracker | None:
    if name == "file":
        return FileTracker(out_dir)
    if name == "tensorboard":
        return TensorBoardTracker(out_dir)
    if name == "wandb":
        return WandbTracker(out_dir, uid, cfg, config)
    if name == "mlflow":
        return MlflowTracker(out_dir, uid, cfg, config)
    return None  # console: the terminal's step line (flows.progress) already shows each step


def build_trackers(names: Sequence[str], out_dir: Path, uid: str, cfg: TidalConfig) -> list[Tracker]:
    """The listed trackers that could start; each one that could not is one warning."""
    config = to_plain(cfg.model_copy(update={"storage": cfg.storage.model_copy(
        update={"url": redact_url(cfg.storage.url)})}))
    out: list[Tracker] = []
    for name in names:
        try:
            tracker = _build(name, out_dir, uid, cfg, config)
        except ImportError as exc:
            log.warning("tracker %s is off: %s (install it, or drop %s from trainer.logger)", name, exc, name)
            continue
        except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
            log.warning("tracker %s is off: it failed to start: %s", name, _one_line(exc))
            continue
        if tracker is not None:
            out.append(tracker)
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def last_logged_step(out_dir: str | os.PathLike[str]) -> int:
    """The last step the run's trackers logged (0 before the first)."""
    try:
        return int(json.loads((Path(out_dir) / WATERMARK_FILE).read_text(encoding="utf-8"))["last_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def stored_metrics(cfg: TidalConfig, uid: str) -> Callable[[int, int], list[tuple[int, dict[str, Any]]]]:
    """Reads steps ``first..last`` of run ``uid`` back from the store, for a catch-up."""

    def read(first: int, last: int) -> list[tuple[int, dict[str, Any]]]:
        engine = open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms)
        with session_scope(engine) as session:
            rows = read_step_metrics(session, uid)
        return [(int(r["step"]), {k: v for k, v in r.items() if k not in STEP_COLUMNS})
                for r in rows if first <= int(r["step"]) <= last]

    return read


def flow_started_at() -> float | None:
    """When the current Prefect flow run (the driver) was entered; None outside one."""
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        return ctx.start_time.timestamp() if ctx is not None else None
    except Exception:  # noqa: BLE001 - the clock then starts now
        return None


class StepTrackers:
    """What the driver feeds after each committed step: ``log(step, metrics)``, then ``close()``.

    A step at or below the last logged one is skipped (a resume never logs a step twice); a gap
    (steps committed by a driver that died before logging them) is filled from ``catch_up`` first.
    Every ``log`` and ``close`` also ticks the run's session clock (``flows.run_clock``).
    """

    def __init__(self, out_dir: str | os.PathLike[str], trackers: list[Tracker], *,
                 catch_up: Callable[[int, int], list[tuple[int, dict[str, Any]]]] | None = None,
                 started_at: float | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.trackers = trackers
        self.catch_up = catch_up
        self.last_step = last_logged_step(out_dir)
        self.write_failed = False
        self.clock = SessionClock(out_dir, started_at)
        self._keep(self.clock.tick)  # the session is on record from its start

    @classmethod
    def open(cls, cfg: TidalConfig, uid: str, out_dir: str | os.PathLike[str],
             started_at: float | None = None) -> StepTrackers:
        """The trackers ``cfg.trainer.logger`` lists, for run ``uid`` writing into ``out_dir``; the
        session clock starts at ``started_at``, by default when the driver's flow run began."""
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, build_trackers(cfg.trainer.logger, path, uid, cfg),
                   catch_up=stored_metrics(cfg, uid), started_at=started_at or flow_started_at())

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log committed step ``step`` (and any committed steps before it not logged yet)."""
        if step <= self.last_step:
            self._keep(self.clock.tick)
            return
        missing: list[tuple[int, dict[str, Any]]] = []
        if step > self.last_step + 1 and self.catch_up is not None:
            try:
                missing = self.catch_up(self.last_step + 1, step - 1)
            except Exception as exc:  # noqa: BLE001 - the trackers miss those steps, the run goes on
                log.warning("trackers: cannot read steps %d-%d back from the store: %s",
                            self.last_step + 1, step - 1, _one_line(exc))
        for n, values in [*missing, (step, dict(metrics))]:
            self._send(n, tracked_scalars(values))
        self.last_step = step
        self._keep(self._write_watermark, step)
        self._keep(self.clock.tick)

    def _write_watermark(self, step: int) -> None:
        tmp = self.out_dir / (WATERMARK_FILE + ".tmp")
        tmp.write_text(json.dumps({"last_step": step}) + "\n", encoding="utf-8")
        os.replace(tmp, self.out_dir / WATERMARK_FILE)

    def _keep(self, write: Callable[..., None], *args: Any) -> None:
        """Write one of the run folder's records; a failure (a full disk) warns once, never raises."""
        try:
            write(*args)
        except OSError as exc:
            if not self.write_failed:
                log.warning("trackers: cannot write in %s: %s", self.out_dir, _one_line(exc))
            self.write_failed = True

    def _send(self, step: int, data: dict[str, float]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(data, step)
            except Exception as exc:  # noqa: BLE001 - warn once, then this tracker is off
                self._drop(tracker, f"failed at step {step}: {_one_line(exc)}")

    def _drop(self, tracker: Tracker, why: str) -> None:
        log.warning("tracker %s is off for the rest of the run: it %s", tracker.name, why)
        self.trackers.remove(tracker)

    def close(self) -> None:
        """Flush and close every tracker (a failing close is one warning) and tick the clock."""
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                self._drop(tracker, f"failed to close: {_one_line(exc)}")
        self.trackers = []
        self._keep(self.clock.tick)
