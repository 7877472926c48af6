"""A driver's lifecycle, through the real `tidal` CLI: a clean Ctrl-C, one driver per run, a dead
driver taken over, a dead trainer actor reported, and a terminal with one line per step.

Every driver is a child in a process group of its own (``driver_support.start``); what it
started is read from the run's own records (``<run dir>/driver/*.json``) while it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import re
import signal
import sqlite3
import subprocess
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from driver_support import CLI, POLICY, cli_env, config_args, end_group, final_state, steps_committed, store_url

from storage.lease import process_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 6
FAST_LEASE = ["--set", "lifecycle.lease_timeout_s=3", "--set", "lifecycle.heartbeat_interval_s=0.5"]


def _env() -> dict[str, str]:
    """The driver's environment as a user's: no PREFECT_LOGGING_LEVEL (the console test checks
    what a default run prints), the test policy importable."""
    env = cli_env()
    env.pop("PREFECT_LOGGING_LEVEL", None)
    return env


def _start(args: list[str], tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=_env(), stdout=open(out, "w"),  # noqa: SIM115
                            stderr=open(err, "w"), start_new_session=True)  # noqa: SIM115
    return proc, out, err



def _wait_steps(proc: subprocess.Popen, url: str, n: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while steps_committed(url) < n:
        if proc.poll() is not None:
            logs = "".join(p.read_text()[-2000:] for p in Path(url.removeprefix("sqlite:///")).parent.glob("*.err"))
            raise AssertionError(f"the driver exited with {proc.returncode} before step {n}: {logs}")
        assert time.monotonic() < deadline, f"no step {n} within {timeout}s"
        time.sleep(0.2)


def _run_dir(tmp_path: Path, name: str) -> Path:
    (run,) = (tmp_path / name).iterdir()
    return run


def _records(run_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "driver").glob("*.json")}


def _recorded_pids(records: dict[str, dict]) -> list[int]:
    return [pid for r in records.values() for pid, _ in r["procs"]]


def _checkpoint_shas(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run_dir / "checkpoints").glob("*.pt"))}


def _stop(proc: subprocess.Popen, send) -> tuple[int, float]:
    """``send()`` a stop signal; the driver's exit code and the seconds it took to exit."""
    send()
    sent = time.monotonic()
    code = proc.wait(timeout=60)
    return code, time.monotonic() - sent


def _finish(proc: subprocess.Popen, timeout: float = 900) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        end_group(proc)


def _assert_every_prompt_once(url: str, steps: int) -> None:
    summary, state, rows, prompts = final_state(url)
    assert (summary.status, [r["step"] for r in rows]) == ("finished", list(range(1, steps + 1)))
    assert state.policy_state["steps_seen"] == list(range(1, steps + 1))  # the policy saw each step once
    assert len(prompts) == len(set(prompts)) == state.policy_state["expected_seen"][-1]


def _own_ray_args(tmp_path: Path, name: str) -> list[str]:
    """config_args without ray.address: the run starts (and must stop) a Ray cluster of its own."""
    url = store_url(tmp_path, name)
    keys = [f"storage.url={url}", f"trainer.default_local_dir={tmp_path}/{name}", f"trainer.total_training_steps={STEPS}",
            f"async_training.dynamic_schedule_policy={POLICY}", "async_training.trigger_parameter_sync_step=2",
            "actor_rollout_ref.rollout.response_length=8", "ray.memory_gb=2", "ray.object_store_memory_gb=0.5"]
    return [a for key in keys for a in ("--set", key)]


def test_ctrl_c_stops_cleanly_a_second_driver_is_refused_and_the_resume_completes_exactly(tmp_path):
    url = store_url(tmp_path, "c")
    proc, out, err = _start(["run", "tiny-cpu", *_own_ray_args(tmp_path, "c")], tmp_path, "first")
    try:
        _wait_steps(proc, url, 1)
        run_dir = _run_dir(tmp_path, "c")
        records = _records(run_dir)
        assert sorted(records) == ["flow-run", "prefect-server", "ray-head"]
        pids = _recorded_pids(records)
        uid = run_dir.name

        # a second driver of the live run: refused at once, nothing written
        shas = _checkpoint_shas(run_dir)
        started = time.monotonic()
        second = subprocess.run([*CLI, "resume", uid, "--storage", url], cwd=tmp_path, env=_env(),
                                capture_output=True, text=True, timeout=60)
        refused_s = time.monotonic() - started
        assert second.returncode == 2, second.stderr
        if os.getloadavg()[0] < 2 * (os.cpu_count() or 1):  # under heavy load imports alone take longer
            assert refused_s < 10, refused_s
        assert second.stderr.count("\n") == 1 and f"run '{uid}' is already being driven by driver" in second.stderr
        assert {k: v for k, v in _checkpoint_shas(run_dir).items() if k in shas} == shas

        # Ctrl-C: the terminal's SIGINT goes to the whole foreground process group
        code, stopped_s = _stop(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    finally:
        end_group(proc)
    text = out.read_text() + err.read_text()
    assert (code, stopped_s < 15) == (130, True), (stopped_s, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    last = [line for line in text.splitlines() if "resume with" in line]
    assert last == [f"tidal: stopped by SIGINT after step {steps_committed(url)} (every committed step is intact); "
                    f"resume with: tidal resume {uid} --storage '{url}'"]
    assert [pid for pid in pids if process_alive(pid)] == []
    summary, *_ = final_state(url)
    assert summary.status == "interrupted"

    # the resume completes exactly; its terminal shows one plain line per step and no Prefect INFO
    done_before = steps_committed(url)
    resumed, out, err = _start(["resume", uid, "--storage", url], tmp_path, "resume")
    assert _finish(resumed) == 0, err.read_text()[-3000:]
    _assert_every_prompt_once(url, STEPS)
    lines = out.read_text().splitlines() + err.read_text().splitlines()
    assert [line for line in lines if "INFO" in line] == []
    assert [line.split()[1] for line in lines if line.startswith("step ")] == [
        f"{s}/{STEPS}" for s in range(done_before + 1, STEPS + 1)]


ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-B]|\r")


def test_on_a_real_terminal_the_live_display_shows_stages_and_steps_and_sigterm_stops_cleanly(tmp_path):
    """The driver on a pseudo-terminal (stdout and stderr a pty, as in a user's shell): the rich live
    display, not plain lines; then a SIGTERM to the driver alone (as a supervisor sends it), which
    must end everything the driver started, itself."""
    url = store_url(tmp_path, "tty")
    master, slave = pty.openpty()
    env = {**_env(), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    for key in ("CI", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(key, None)
    proc = subprocess.Popen([*CLI, "run", "tiny-cpu", *_own_ray_args(tmp_path, "tty")], cwd=tmp_path, env=env,
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def read() -> None:  # keep the pty drained, or the driver blocks on a full terminal
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_steps(proc, url, 2)
        run_dir = _run_dir(tmp_path, "tty")
        pids = _recorded_pids(_records(run_dir))
        uid = run_dir.name
        code, stopped_s = _stop(proc, lambda: os.kill(proc.pid, signal.SIGTERM))
    finally:
        end_group(proc)
        reader.join(timeout=10)
        os.close(master)
    text = ANSI.sub("", screen.decode("utf-8", "replace"))
    assert (code, stopped_s < 15) == (143, True), (stopped_s, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    assert re.search(r"✓ \S.*\(\d+\.\ds\)", text), text[:3000]  # a start-up stage, ticked off with its time
    assert re.search(r"steps .*\b[12]/6\b.*eta", text), text[-3000:]  # the step bar with its ETA
    assert "phase: " in text and "last: step    1/6" in text, text[-3000:]
    assert not re.search(r"^step +1/6 ", text, re.MULTILINE), "a terminal got the plain per-step lines"
    last = [line.strip() for line in text.splitlines() if "resume with" in line]
    assert len(last) == 1 and last[0].startswith("tidal: stopped by SIGTERM after step "), last
    assert last[0].endswith(f"resume with: tidal resume {uid} --storage '{url}'"), last
    assert [pid for pid in pids if process_alive(pid)] == []
    summary, *_ = final_state(url)
    assert summary.status == "interrupted"


def test_a_sigkilled_driver_reads_interrupted_after_the_timeout_and_the_resume_ends_its_leftovers(
        tmp_path, ray_address):
    from storage import make_engine, run_statuses, session_scope

    url = store_url(tmp_path, "k")
    proc, _, err = _start(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "k", STEPS), *FAST_LEASE],
                          tmp_path, "killed")
    try:
        _wait_steps(proc, url, 1)
        run_dir = _run_dir(tmp_path, "k")
        records = _records(run_dir)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        end_group(proc)
    (server_pid, _), = records["prefect-server"]["procs"]
    assert process_alive(server_pid)  # in a session of its own: the group's SIGKILL did not reach it
    time.sleep(3.5)
    engine = make_engine(url)
    with session_scope(engine) as s:
        assert run_statuses(s) == {run_dir.name: "interrupted"}
    engine.dispose()

    resumed, _, err = _start(["resume", run_dir.name, "--storage", url], tmp_path, "resume")
    assert _finish(resumed) == 0, err.read_text()[-3000:]
    _assert_every_prompt_once(url, STEPS)
    assert process_alive(server_pid) is False
    prefect_db = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
    with closing(sqlite3.connect(prefect_db)) as db:
        (state,) = db.execute("SELECT state_type FROM flow_run WHERE id = ?",
                              (records["flow-run"]["info"]["id"],)).fetchone()
    assert state == "CRASHED"


def test_a_trainer_actor_killed_mid_step_stops_the_run_in_one_line_with_exit_3(tmp_path, ray_address):
    import ray

    from cluster.actors import TRAINER

    url = store_url(tmp_path, "t")
    proc, out, err = _start(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "t", STEPS)], tmp_path, "t")
    try:
        _wait_steps(proc, url, 1)
        uid = _run_dir(tmp_path, "t").name
        ray.kill(ray.get_actor(TRAINER, namespace=uid), no_restart=True)
        code = proc.wait(timeout=120)
    finally:
        end_group(proc)
    lines = err.read_text().splitlines()
    errors = [line for line in lines if line.startswith("tidal: error:")]
    assert code == 3, err.read_text()[-3000:]
    assert len(errors) == 1 and "an actor of the run died" in errors[0], errors
    assert errors[0].endswith(f"resume with: tidal resume {uid} --storage '{url}'")
