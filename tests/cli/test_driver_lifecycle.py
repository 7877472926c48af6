"""The driver's lifecycle pieces on their own (no Prefect server, no Ray): stop signals, the run's
records and what ending them ends, the per-step lines, where Prefect's logs go, and a resume of a
finished run. The whole path through `tidal run` is tests/integration/test_lifecycle.py."""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config import ConfigError, load_config, write_resolved
from flows.driver import prefect_logs_to_file
from flows.lifecycle import (
    RunInterrupted,
    StopSignals,
    end_leftovers,
    interruption,
    read_records,
    record_end,
    write_record,
)
from flows.progress import LineProgress, LiveProgress
from storage import RunStatus, create_run, get_run, migrate, open_store, session_scope, set_run_status, sqlite_url
from storage.lease import process_alive


def test_the_first_stop_signal_raises_once_and_later_ones_are_only_counted():
    with StopSignals() as stop:
        with pytest.raises(RunInterrupted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)  # during the cleanup: no second exception
        time.sleep(0.1)
    assert (raised.value.signum, raised.value.exit_code, stop.signum, stop.count) == (signal.SIGINT, 130, signal.SIGINT, 2)


def test_a_stop_is_found_through_the_exceptions_it_caused():
    try:
        try:
            raise RunInterrupted(signal.SIGTERM)
        except RunInterrupted as exc:
            raise RuntimeError("a flow run crashed") from exc
    except RuntimeError as exc:
        found = interruption(exc)
    assert (found, interruption(ValueError("no"))) == (signal.SIGTERM, None)


def test_ending_leftovers_ends_a_recorded_session_with_its_children_and_deletes_its_dirs(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                              start_new_session=True)
    temp = tmp_path / "ray-temp"
    temp.mkdir()
    time.sleep(1.0)
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _sid(int(p)) == leader.pid]
    write_record(tmp_path, "prefect-server", (leader.pid,), session=True, dirs=(str(temp),))
    ended, others = end_leftovers(tmp_path)
    leader.wait(timeout=10)
    assert (ended, others) == ([f"prefect-server (pids {', '.join(map(str, sorted(children)))})"], [])
    assert [pid for pid in children if process_alive(pid)] == []
    assert (temp.exists(), read_records(tmp_path)) == (False, [])


def test_a_record_whose_pid_now_belongs_to_another_process_ends_nothing(tmp_path):
    write_record(tmp_path, "ray-head", (os.getpid(),))
    path = tmp_path / "driver" / "ray-head.json"
    path.write_text(path.read_text().replace(f"[{os.getpid()}, ", f"[{os.getpid()}, 1"))  # another start tick
    assert end_leftovers(tmp_path) == ([], [])
    assert process_alive(os.getpid())


def _sid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[3])
    except OSError:
        return -1


def _result(reward: float, lent: bool, wait_s: float = 0.0, switch_s: float = 0.0) -> dict:
    return {"hybrid_active": lent, "metrics": {"timing_s/step": 1.5, "train/reward_mean": reward,
                                               "dynamic_resource/mq_size": 4,
                                               "dynamic_resource/resource_utilization": 0.75,
                                               "timing_s/wait_for_enough_samples": wait_s, "waste/switch_s": switch_s}}


def test_a_non_terminal_gets_one_plain_line_per_step_and_a_summary():
    cfg = load_config("tiny-cpu", ["trainer.total_training_steps=2"])
    out = io.StringIO()
    progress = LineProgress("r1", cfg, out=out)
    progress.begin(1, 2)
    progress.step(1, _result(0.25, True, wait_s=1.0, switch_s=0.5))  # lends at its end: step 2 is lent
    progress.step(2, _result(0.5, False))
    progress.done({"markdown": "/runs/r1/report.md"})
    lines = out.getvalue().splitlines()
    assert [line.split("  eta")[0] for line in lines[1:3]] == [
        "step    1/2    1.50s  reward 0.250  queue   4  util 0.75  hybrid lent",
        "step    2/2    1.50s  reward 0.500  queue   4  util 0.75  hybrid training"]
    assert lines[0] == (f"tidal run r1: {cfg.trainer_gpus} trainer GPU(s), {cfg.standalone_gpus} rollout GPU(s), policy "
                        f"{cfg.async_training.dynamic_schedule_policy}; steps 1..2")
    assert lines[3].startswith("done: 2 step(s) in ") and lines[3].endswith(
        "s, reward 0.250 → 0.500; lent on 1 of 2 steps; report /runs/r1/report.md")  # no step without a lend
    # after the start-up step to compare with: the count only (metrics.lending_gain)
    assert len(lines) == 4


def test_a_terminal_gets_the_start_up_stages_then_a_step_bar_and_the_summary():
    from rich.console import Console

    cfg = load_config("tiny-cpu", ["trainer.total_training_steps=2"])
    screen = io.StringIO()
    progress = LiveProgress("r1", cfg, console=Console(file=screen, force_terminal=True, width=120, color_system=None))
    for stage in ("Prefect server", "Ray cluster", "actors", "weights"):
        progress.stage(stage)
    shown_stages = screen.getvalue()
    progress.begin(1, 2)
    progress.phase("train")
    progress.step(1, _result(0.25, True))
    progress.done({"markdown": "/runs/r1/report.md"})
    shown = screen.getvalue()
    assert [f"{mark} {stage} (" in shown_stages for mark, stage in
            [("✓", "Prefect server"), ("✓", "Ray cluster"), ("✓", "actors"), ("…", "weights")]] == [True] * 4
    assert ["phase: train" in shown, "1/2" in shown, "last: step    1/2    1.50s  reward 0.250" in shown,
            "reward 0.250 → 0.250; lent on 0 of 1 steps; report /runs/r1/report.md" in shown] == [True] * 4


@pytest.mark.filterwarnings("ignore:Logger 'prefect")  # no flow run here for the API handler to attach to
def test_prefect_info_goes_to_the_run_log_file_and_only_warnings_reach_the_terminal(tmp_path, monkeypatch):
    from prefect.logging.configuration import ensure_logging_setup

    monkeypatch.delenv("PREFECT_LOGGING_LEVEL", raising=False)
    ensure_logging_setup()
    terminal = io.StringIO()
    console = logging.StreamHandler(terminal)
    logging.getLogger().addHandler(console)
    try:
        with prefect_logs_to_file(tmp_path / "prefect.log"):
            logging.getLogger("prefect.task_runs").info("Task run 'train-5a6' - Finished in state Completed()")
            logging.getLogger("prefect.flow_runs").warning("a warning")
    finally:
        logging.getLogger().removeHandler(console)
    assert terminal.getvalue() == "a warning\n"
    assert [line.split(" | ", 1)[1] for line in (tmp_path / "prefect.log").read_text().splitlines()] == [
        "INFO    | prefect.task_runs - Task run 'train-5a6' - Finished in state Completed()",
        "WARNING | prefect.flow_runs - a warning"]  # outside a flow run: the logger's name, not the run's


def test_resuming_a_finished_run_says_so_in_one_line_without_starting_anything(tmp_path):
    url = sqlite_url(tmp_path / "t.db")
    cfg = load_config("tiny-cpu", [f"storage.url={url}"])
    engine = open_store(url)
    migrate(engine)
    write_resolved(cfg, tmp_path / "r1")
    with session_scope(engine) as s:
        create_run(s, uid="r1", name="n", project="p", policy="default", seed=0, config={},
                   output_dir=str(tmp_path / "r1"))
        set_run_status(s, "r1", "finished")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "resume", "r1", "--storage", url], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    took = time.monotonic() - started
    assert (done.returncode, done.stdout, done.stderr) == (
        0, "run r1 is already finished (0 steps committed); nothing to resume\n", "")
    assert took < 30  # no Prefect server (~15 s and more) nor Ray cluster was started
    assert not (tmp_path / "r1" / "driver").exists()


def test_a_heartbeat_as_long_as_the_lease_timeout_is_refused():
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        load_config("tiny-cpu", ["lifecycle.lease_timeout_s=5", "lifecycle.heartbeat_interval_s=5"])


def test_a_dead_actor_anywhere_in_the_chain_becomes_one_line_with_the_resume_command():
    from flows.errors import ActorLost, actor_lost

    class RayActorError(Exception):  # matched by name: flows.errors imports no Ray
        pass

    class ActorDiedError(RayActorError):
        pass

    try:
        try:
            raise ActorDiedError("\x1b[36mray::TrainerActor\x1b[39m The actor died\nunexpectedly")
        except ActorDiedError as exc:
            raise RuntimeError("a step flow failed") from exc
    except RuntimeError as exc:
        lost = actor_lost(exc, uid="r1", last_step=3, storage_arg="sqlite:///t.db")
    assert (type(lost), lost.exit_code, str(lost)) == (ActorLost, 3, (
        "an actor of the run died (ActorDiedError: ray::TrainerActor The actor died unexpectedly); the run stopped "
        "after step 3 and every committed step is intact; resume with: tidal resume r1 --storage 'sqlite:///t.db'"))
    assert actor_lost(ValueError("no"), uid="r1", last_step=0, storage_arg="x") is None


def test_a_full_disk_behind_a_task_error_becomes_one_line_with_the_path_and_exit_5():
    import errno

    from flows.errors import DiskFull, disk_full

    class RayTaskError(Exception):  # like Ray's: the remote exception rides in ``cause``
        def __init__(self, cause):
            super().__init__("ray::TrainerActor.save_checkpoint() failed")
            self.cause = cause

    exc = RayTaskError(OSError(errno.ENOSPC, "No space left on device", "/r/checkpoints/global_step_2/actor.pt"))
    full = disk_full(exc, uid="r1", storage_arg="sqlite:///t.db")
    assert (type(full), full.exit_code, str(full)) == (DiskFull, 5, (
        "the disk is full (no space left on device writing /r/checkpoints/global_step_2/actor.pt); the run "
        "stopped, every checkpoint before it is intact and nothing half-written is kept; free some space there, "
        "then resume with: tidal resume r1 --storage 'sqlite:///t.db'"))
    assert disk_full(OSError(errno.EACCES, "denied", "/r"), uid="r1", storage_arg="x") is None


def test_the_api_watch_checks_an_answering_api_every_probe_s_and_its_own_dead_server_at_once():
    """``flows.driver.ApiWatch``: while the API answers, one HTTP health check per ``probe_s`` (not
    one per ``interval_s``); Tidal's own server found dead by its process and restarted."""
    import http.server
    import threading

    from flows.driver import ApiWatch

    hits: list[float] = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(time.monotonic())
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/api"

    class OwnServer:
        exited, restarted, pid = False, 0, 1

        def restart(self, timeout_s):
            self.restarted += 1
            self.exited = False

    server = OwnServer()
    try:
        with ApiWatch(url, 60.0, on_lost=lambda s: pytest.fail("not lost"), server=server,
                      interval_s=0.05, probe_s=0.5):
            time.sleep(1.6)
            healthy_hits = len(hits)
            server.exited = True
            deadline = time.monotonic() + 5
            while not server.restarted and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        httpd.shutdown()
    assert 1 <= healthy_hits <= 8, hits  # 1.6 s at one check per 0.5 s: 3-4 (~30 at one per tick)
    assert server.restarted == 1


def test_a_runs_end_status_is_written_after_a_lock_held_past_the_busy_timeout_and_a_lasting_one_is_logged(tmp_path, caplog):
    """A stop may arrive while a step's commit holds the SQLite write lock: the end status is still
    written by a later try; a lock held past every try leaves the row alone and says so in a warning."""
    import sqlite3
    import threading

    url = sqlite_url(tmp_path / "t.db")
    engine = open_store(url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid="r1", name="n", project="p", policy="default", seed=0, config={}, output_dir=str(tmp_path))
        set_run_status(s, "r1", RunStatus.RUNNING)

    def hold_lock(seconds: float) -> threading.Thread:
        locked = threading.Event()

        def hold() -> None:
            db = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
            db.execute("BEGIN EXCLUSIVE")
            locked.set()
            time.sleep(seconds)
            db.execute("COMMIT")
            db.close()

        thread = threading.Thread(target=hold)
        thread.start()
        locked.wait(5)
        return thread

    def status() -> str:
        with session_scope(engine) as s:
            return get_run(s, "r1").status

    holder = hold_lock(3.0)
    with caplog.at_level(logging.WARNING, logger="tidal.lifecycle"):
        assert record_end(url, "r1", RunStatus.INTERRUPTED, within_s=0, busy_timeout_ms=100) is False
    holder.join()
    assert status() == "running" and "could not record it interrupted (1 tries)" in caplog.text

    holder = hold_lock(0.8)
    started = time.monotonic()
    assert record_end(url, "r1", RunStatus.INTERRUPTED, within_s=5, busy_timeout_ms=100) is True
    assert time.monotonic() - started < 5
    holder.join()
    assert status() == "interrupted"


class _TimedOutOnce:
    """``init_ray`` as ``training_run._start_ray`` calls it: the first ``fail`` calls start a child
    process and a file in the temp dir, then raise ``error`` (Ray's start-up timeout by default); the
    next one "starts" (a child left running, as Ray's head would be)."""

    def __init__(self, fail: int = 1, error: str = "The current node timed out during startup. This could happen "
                                                   "because some of the raylet failed to startup or the GCS has "
                                                   "become overloaded."):
        self.fail, self.error = fail, error
        self.dirs: list[str] = []
        self.started: list[subprocess.Popen] = []
        self.succeeded = False

    def __call__(self, *, temp_dir, **_):
        self.dirs.append(temp_dir)
        (Path(temp_dir) / "session_latest").write_text("a node")
        self.started.append(subprocess.Popen(["sleep", "120"]))
        if len(self.dirs) <= self.fail:
            raise Exception(self.error)  # noqa: TRY002 - what Ray raises
        self.succeeded = True


@pytest.fixture
def start_ray(monkeypatch, tmp_path):
    from flows import training_run

    cfg = load_config("tiny-cpu", [f"trainer.default_local_dir={tmp_path}"])
    assert cfg.ray.address is None and cfg.ray.temp_dir is None

    def start(fake: _TimedOutOnce) -> str | None:
        monkeypatch.setattr(training_run, "init_ray", fake)
        try:
            return training_run._start_ray(cfg, "u1", tmp_path / "run")
        finally:
            for proc in fake.started[:len(fake.started) - fake.succeeded]:  # the failed starts'
                assert proc.wait(timeout=15) is not None  # ended by _start_ray (reaped here)
    yield start


def test_a_local_ray_whose_start_timed_out_is_ended_and_started_once_more(start_ray, tmp_path, caplog):
    fake = _TimedOutOnce()
    caplog.set_level(logging.WARNING, logger="tidal")
    try:
        owned = start_ray(fake)
        assert owned == fake.dirs[1] and Path(owned).is_dir()
        assert not Path(fake.dirs[0]).exists()  # the failed start's folder is gone with its processes
        assert fake.started[1].poll() is None  # the second start's processes are the run's
        [record] = read_records(tmp_path / "run")
        assert (record.kind, record.dirs, [pid for pid, _ in record.procs]) == (
            "ray-head", (owned,), [fake.started[1].pid])
        assert "u1: Ray's local node did not start in time (The current node timed out during startup" in caplog.text
    finally:
        fake.started[-1].kill()
        fake.started[-1].wait()
        shutil.rmtree(fake.dirs[-1], ignore_errors=True)


@pytest.mark.parametrize("how", [dict(fail=2), dict(error="the object store is too small")],
                         ids=["timed-out-twice", "another-error"])
def test_a_local_ray_start_is_tried_again_only_once_and_only_when_it_timed_out(start_ray, how, tmp_path):
    fake = _TimedOutOnce(**how)
    with pytest.raises(Exception, match=fake.error.split(".")[0]):
        start_ray(fake)
    assert len(fake.dirs) == min(fake.fail, 2)
    assert not any(Path(d).exists() for d in fake.dirs)
    assert read_records(tmp_path / "run") == []
