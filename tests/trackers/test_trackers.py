"""`trainer.logger`: each tracker's scalars read back with its own reader (TensorBoard's event
accumulator, W&B's transaction-log inspector, MLflow's client), the JSONL file, and the rules that
a resume logs no step twice, a gap is caught up from the store, and a failing tracker only warns."""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_config
from flows.run_clock import elapsed_s, read_sessions
from flows.trackers import FileTracker, StepTrackers, build_trackers, last_logged_step, mlflow_name
from tests.seeded_runs import seeded_store, step_metrics

STEP_1 = {"actor/pg_loss": -0.5, "timing_s/step": 3.0, "dynamic_resource/mq_size": 4.0,
          "fully_async/param_version": 1.0, "val-core/tidal/arith/reward/mean@4": 0.5}
STEP_2 = {"actor/pg_loss": -1.0, "timing_s/step": 4.0, "dynamic_resource/mq_size": 8.0,
          "fully_async/param_version": 2.0, "val-core/tidal/arith/reward/mean@4": 0.75}


def config(tmp_path: Path, *logger: str):
    return load_config("tiny-cpu", [f"trainer.logger=[{','.join(logger)}]", f"storage.url=sqlite:///{tmp_path}/s.db"])


def run_two_steps(tmp_path: Path, *logger: str) -> Path:
    out = tmp_path / "run"
    trackers = StepTrackers.open(config(tmp_path, *logger), "tiny-1", out)
    trackers.log(1, STEP_1)
    trackers.log(2, STEP_2 | {"train/reward_mean": math.nan})  # NaN: left out, a gap in the curve
    trackers.close()
    return out


def test_trainer_logger_takes_one_name_or_a_list_as_in_verl_and_refuses_unknown_names():
    assert load_config("tiny-cpu").trainer.logger == ["console", "file"]
    assert load_config("tiny-cpu", ["trainer.logger=wandb"]).trainer.logger == ["wandb"]
    assert load_config("tiny-cpu", ["trainer.logger=[console,mlflow,console]"]).trainer.logger == ["console", "mlflow"]
    with pytest.raises(ConfigError, match="trainer.logger.0: Input should be 'console', 'file'"):
        load_config("tiny-cpu", ["trainer.logger=neptune"])


def test_the_file_tracker_writes_one_step_and_data_line_per_step(tmp_path):
    out = run_two_steps(tmp_path, "console", "file")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "data": dict(sorted(STEP_1.items()))}, {"step": 2, "data": dict(sorted(STEP_2.items()))}]
    assert last_logged_step(out) == 2


def test_tensorboard_event_files_hold_every_scalar_on_the_global_step_axis(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard tracker needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = run_two_steps(tmp_path, "tensorboard")
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(STEP_1)
    for name in STEP_1:
        assert [(e.step, e.value) for e in acc.Scalars(name)] == [(1, pytest.approx(STEP_1[name])),
                                                                  (2, pytest.approx(STEP_2[name]))]


def test_a_wandb_offline_run_in_the_run_folder_holds_every_scalar_by_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb tracker needs the wandb package")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: nothing may reach the network
    out = run_two_steps(tmp_path, "wandb")
    [log_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's own reader of its transaction log (the same binary that `wandb sync` uses)
    wandb_bin = Path(sys.executable).with_name("wandb")
    shown = subprocess.run([str(wandb_bin if wandb_bin.exists() else shutil.which("wandb")), "leet", "inspect",
                            "--json", str(log_file)], capture_output=True, text=True, timeout=120, check=True)
    history = [json.loads(line)["history"] for line in shown.stdout.splitlines() if '"type":"history"' in line]
    got = [(h["step"]["num"], {k: v for k, v in h["item"].items() if not k.startswith("_")}) for h in history]
    assert got == [(1, STEP_1), (2, STEP_2)]


def test_an_mlflow_run_in_the_run_folder_holds_every_scalar_by_step(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow tracker needs mlflow (mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    out = run_two_steps(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("tidal").experiment_id])
    assert (run.info.run_name, run.data.tags["tidal.run_id"], run.info.status) == ("tiny-1", "tiny-1", "FINISHED")
    assert sorted(run.data.metrics) == sorted(mlflow_name(k) for k in STEP_1)
    [artifact] = (out / "mlflow-artifacts").rglob("config.json")  # in the run folder, not the cwd
    assert json.loads(artifact.read_text())["trainer"]["logger"] == ["mlflow"]
    for name in STEP_1:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_name(name)))
        assert history == [(1, STEP_1[name]), (2, STEP_2[name])]


def test_mlflow_names_keep_the_slashes_and_replace_what_mlflow_refuses():
    assert mlflow_name("val-core/openai/gsm8k/reward/mean@4") == "val-core/openai/gsm8k/reward/mean_4"
    assert mlflow_name("timing_s/step") == "timing_s/step"


def test_a_resume_logs_no_step_twice_and_continues_the_same_mlflow_run(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow tracker needs mlflow (mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    out = run_two_steps(tmp_path, "file", "mlflow")
    again = StepTrackers.open(config(tmp_path, "file", "mlflow"), "tiny-1", out)
    again.log(2, STEP_2)  # already logged by the first session: skipped
    again.log(3, STEP_2 | {"actor/pg_loss": -1.5})
    again.close()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("tidal").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "actor/pg_loss"))
    assert history == [(1, -0.5), (2, -1.0), (3, -1.5)]


def test_steps_committed_but_never_logged_are_caught_up_from_the_store(tmp_path):
    url, folders = seeded_store(tmp_path, {"r1": {"steps": 4}})
    out = folders["r1"]
    cfg = load_config("tiny-cpu", ["trainer.logger=file", f"storage.url={url}"])
    first = StepTrackers.open(cfg, "r1", out)
    first.log(1, step_metrics(1))
    first.close()  # the driver died after committing steps 2 and 3, before logging them
    resumed = StepTrackers.open(cfg, "r1", out)
    resumed.log(4, step_metrics(4))
    resumed.close()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["data"]["actor/pg_loss"]) for line in lines] == [(1, -0.5), (2, -1.0), (3, -1.5),
                                                                                  (4, -2.0)]


class Exploding:
    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, data, step):
        self.calls += 1
        raise RuntimeError("the tracker's server went away")

    def close(self):
        raise AssertionError("a tracker that is off is not closed")


def test_a_tracker_that_raises_warns_once_and_the_others_go_on(tmp_path, caplog):
    bad = Exploding()
    trackers = StepTrackers(tmp_path, [bad, FileTracker(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="tidal.trackers"):
        for step in (1, 2, 3):
            trackers.log(step, {"timing_s/step": float(step)})
        trackers.close()
    assert bad.calls == 1
    assert [r.getMessage() for r in caplog.records] == [
        "tracker exploding is off for the rest of the run: it failed at step 1: "
        "RuntimeError: the tracker's server went away"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_tracker_whose_package_is_missing_is_one_warning_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with caplog.at_level(logging.WARNING, logger="tidal.trackers"):
        trackers = build_trackers(["wandb", "file"], tmp_path, "tiny-1", config(tmp_path, "wandb", "file"))
    assert [t.name for t in trackers] == ["file"]
    assert [r.getMessage() for r in caplog.records] == [
        "tracker wandb is off: import of wandb halted; None in sys.modules "
        "(install it, or drop wandb from trainer.logger)"]


def test_each_session_adds_its_span_to_the_run_clock(tmp_path):
    first = StepTrackers(tmp_path, [], started_at=100.0)
    first.clock.tick(now=130.0)
    second = StepTrackers(tmp_path, [], started_at=500.0)
    second.clock.tick(now=512.5)
    assert read_sessions(tmp_path) == [{"started_at": 100.0, "ended_at": 130.0},
                                       {"started_at": 500.0, "ended_at": 512.5}]
    assert elapsed_s(tmp_path) == 42.5
    assert elapsed_s(tmp_path / "nothing-here") is None


def test_a_run_folder_that_cannot_be_written_is_one_warning_and_never_stops_the_run(tmp_path, caplog):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="tidal.trackers"):
        trackers = StepTrackers(blocked, [])
        trackers.log(1, {"timing_s/step": 1.0})
        trackers.log(2, {"timing_s/step": 2.0})
        trackers.close()
    assert trackers.last_step == 2
    assert [r.getMessage()[:len(f"trackers: cannot write in {blocked}")] for r in caplog.records] == [
        f"trackers: cannot write in {blocked}"]
