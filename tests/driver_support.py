"""The `tidal` CLI as a child process, for the tests that kill the driver (tests/integration/test_resume.py,
tests/faults/test_fault_driver_kill.py): one process group per run, ended by that group id only.

A SIGKILLed driver leaves its ephemeral Prefect server (and its other children) behind: they are in
the driver's process group, so :func:`end_group` after every run ends them, and
:func:`live_group_members` lets a test check that nothing of its groups is left.

:func:`ray_head_cluster` is the local Ray cluster those tests (and the data-plane ones) attach to:
one per session (``tests/conftest.py``'s ``ray_cluster``).

Importable from every test folder: pytest puts ``tests/`` on ``sys.path`` (``tests/conftest.py``).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import IO, Any

POLICY_DIR = Path(__file__).resolve().parent / "integration"
"""Holds ``step_counting_policy``: on the PYTHONPATH of the drivers and of the Ray workers."""

POLICY = "step_counting_policy:StepCountingPolicy"
CLI = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"]


@contextmanager
def ray_head_cluster(env: Mapping[str, str] | None = None) -> Iterator[Any]:
    """A local Ray head of its own (2 CPUs, 4 emulated GPUs, 4 GiB), this process attached to it;
    yields the ``LocalRayCluster`` and ends it after. ``env`` goes to the head and its workers (e.g.
    PYTHONPATH). The session's one is ``tests/conftest.py``'s ``ray_cluster``. A fault campaign
    with a trainer of N ranks (``TIDAL_FAULT_TRAINER_RANKS``) gets N - 1 more emulated GPUs."""
    from cluster.ray_cluster import LocalRayCluster

    ranks = os.environ.get("TIDAL_FAULT_TRAINER_RANKS", "").strip()
    gpus = 3 + (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1)
    with _running_and_attached(LocalRayCluster(num_cpus=2, gpus=gpus, memory_gb=4.0, object_store_memory_gb=0.5,
                                               env=dict(env or {}))) as cluster:
        yield cluster


@contextmanager
def _running_and_attached(cluster: Any) -> Iterator[Any]:
    """Start ``cluster`` and attach this process to it; detach and stop it at the end."""
    import ray

    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


@contextmanager
def ray_head(env: Mapping[str, str] | None = None, *, reuse: bool = False) -> Iterator[str]:
    """:func:`ray_head_cluster`, yielding its address. With ``reuse``, a cluster this process is
    already attached to is yielded instead, left running."""
    import ray

    if reuse and ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    with ray_head_cluster(env) as cluster:
        yield cluster.address


@contextmanager
def detached() -> Iterator[None]:
    """The block runs with this process attached to no Ray cluster: it leaves the one it is attached
    to (the session's, tests/conftest.py's ``ray_cluster``, once an earlier test attached it), and
    attaches back after, once the block's own attachment (if any) is ended."""
    import ray

    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if previous:
        ray.shutdown()
    try:
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if previous:
            ray.init(address=previous, log_to_driver=False, configure_logging=False)


@contextmanager
def attached_to(cluster: Any) -> Iterator[Any]:
    """Start ``cluster`` (a ``LocalRayCluster`` or ``LocalMultiNodeCluster``) and attach this process
    to it, :func:`detached` from the one it was attached to; stop it at the end and attach back."""
    with detached(), _running_and_attached(cluster):
        yield cluster


def pythonpath() -> str:
    """PYTHONPATH with the folder of the test-only policy first (Ray workers import it by name)."""
    return os.pathsep.join(filter(None, [str(POLICY_DIR), os.environ.get("PYTHONPATH", "")]))


def cli_env(crash: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The driver's environment: this one, the policy folder on PYTHONPATH, `TIDAL_CRASH_AT` only
    when ``crash`` names a failpoint (tasks/faults.py)."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "PYTHONUNBUFFERED": "1", **(extra or {})}
    if "PREFECT_HOME" in env:  # the session's (tests/conftest.py): its first driver migrates nothing
        seed_prefect_home(env["PREFECT_HOME"])
    env.pop("TIDAL_CRASH_AT", None)
    if crash:
        env["TIDAL_CRASH_AT"] = crash
    return env


def config_args(tmp_path: Path, ray_address: str, name: str, steps: int) -> list[str]:
    """`--set` overrides of the crash tests: tiny-cpu on the given Ray cluster, its own SQLite store
    ``tmp_path/NAME.db`` and output folder, ``steps`` steps, the timing-independent policy."""
    return [
        "--set", f"storage.url={store_url(tmp_path, name)}", "--set", f"trainer.default_local_dir={tmp_path}/{name}",
        "--set", f"ray.address={ray_address}", "--set", f"trainer.total_training_steps={steps}",
        "--set", f"async_training.dynamic_schedule_policy={POLICY}",
        "--set", "async_training.trigger_parameter_sync_step=2", "--set", "actor_rollout_ref.rollout.response_length=8",
    ]


def store_url(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path}/{name}.db"


def steps_committed(url: str) -> int:
    """Committed steps in a SQLite store (one run in it), read cheaply (read-only, no migration,
    no SQLAlchemy) while a driver writes to it; 0 before the store exists or is migrated."""
    path = Path(url.removeprefix("sqlite:///"))
    if not path.is_file():
        return 0
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute("SELECT count(*) FROM steps").fetchone()[0]
    except sqlite3.OperationalError:  # not migrated yet
        return 0


def actor_nodes() -> dict[str, str]:
    """Every named actor ever created on the attached Ray cluster (dead ones too) → the id of its
    node; for a name several runs used, the newest actor's (the table's order is by actor id, not by
    time). Reads Ray's private state table: tests only."""
    import ray

    actors = sorted(ray._private.state.actors().values(), key=lambda a: a["StartTime"])
    return {a["Name"]: a["Address"]["NodeID"] for a in actors if a["Name"]}


def next_log(tmp_path: Path) -> Path:
    return tmp_path / f"cli-{len(list(tmp_path.glob('cli-*.log')))}.log"


def start(args: list[str], cwd: Path, out: IO[Any], env: Mapping[str, str]) -> subprocess.Popen:
    """Start `tidal ARGS` as the leader of a new process group (its pid is the group id)."""
    return subprocess.Popen([*CLI, *args], cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def end_group(proc: subprocess.Popen) -> int:
    """SIGKILL the process group led by ``proc`` (whatever is still in it), reap ``proc``, return its
    exit code (``-SIGKILL`` when the signal is what ended it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


PREFECT_TEMPLATE_ENV = "TIDAL_TEST_PREFECT_TEMPLATE"
"""A folder (set once per suite by tests/conftest.py) holding a Prefect database migrated to this
Prefect's head: copied into each new Prefect home of the tests (:func:`seed_prefect_home`)."""


def seed_prefect_home(home: str | Path) -> Path:
    """``home``, created, with a copy of the suite's already-migrated Prefect database in it unless
    it has one. A server on an empty home migrates its database first: ~14 s of CPU and ~29 s at a
    load average of 4, against ~6 s and ~11 s on a copy. The first caller in the suite (under
    pytest-xdist, of all workers: a file lock) migrates the template with Prefect's own
    ``prefect server database upgrade``."""
    import fcntl
    import shutil

    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    folder = os.environ.get(PREFECT_TEMPLATE_ENV)
    if not folder or not Path(folder).is_dir() or (home / "prefect.db").exists():
        return home
    template = Path(folder) / "prefect.db"
    with open(Path(folder) / "template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            from flows.prefect_server import LocalPrefectServer

            _, env = LocalPrefectServer(home=str(Path(folder) / "making")).command()
            made = Path(env["PREFECT_API_DATABASE_CONNECTION_URL"].split(":///", 1)[1])
            made.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"prefect server database upgrade failed:\n{(done.stdout + done.stderr)[-3000:]}"
            part = Path(folder) / "prefect.db.part"
            with closing(sqlite3.connect(made)) as src, closing(sqlite3.connect(part)) as dst:
                src.backup(dst)  # one consistent file, whatever is still in the WAL
            os.replace(part, template)
            shutil.rmtree(made.parent, ignore_errors=True)
    shutil.copyfile(template, home / "prefect.db")
    return home


def ray_driver_log(temp_dir: str | Path, pid: int, chars: int = 3000) -> str:
    """The end of Ray's own log of the driver process ``pid`` in a cluster's ``temp_dir`` (its core
    worker's: why Ray ended a driver that left no Python traceback), or a line saying there is none."""
    logs = sorted(Path(temp_dir).glob(f"session_*/logs/python-core-driver-*_{pid}.log"))
    if not logs:
        return f"(no Ray driver log of pid {pid} under {temp_dir})"
    return f"{logs[-1]}:\n" + logs[-1].read_text(errors="replace")[-chars:]


def run_tidal(args: list[str], tmp_path: Path, crash: str | None = None, timeout: float = 240,
              extra: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Run `tidal ARGS` to its end (or ``timeout``); afterwards end what it left behind. Returns
    (exit code, log). ``extra``: more environment (another failpoint)."""
    log = next_log(tmp_path)
    with open(log, "w") as out:
        proc = start(args, tmp_path, out, cli_env(crash, extra))
        try:
            code = proc.wait(timeout=timeout)
        finally:
            end_group(proc)
    return code, log.read_text()


def final_state(url: str) -> tuple[Any, Any, list[dict[str, Any]], list[tuple[int, int]]]:
    """(summary, resume state, per-step rows, trained prompts) of the only run in the store at ``url``."""
    from storage import load_resume_state, make_engine, run_summaries, session_scope
    from storage.store import consumed_prompts, read_step_metrics

    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            (summary,) = run_summaries(s)
            state = load_resume_state(s, summary.uid)
            rows = read_step_metrics(s, summary.uid)
            prompts = consumed_prompts(s, summary.uid)
    finally:
        engine.dispose()
    return summary, state, rows, prompts


def assert_resumed_exactly(straight_url: str, url: str, steps: int) -> tuple[int, int]:
    """Assert that the interrupted run at ``url`` ended as the uninterrupted one at ``straight_url``:
    finished, steps 1..``steps`` committed once each, the same policy state, the same trained
    prompts with none twice. Returns (samples lost, samples duplicated), 0 and 0 once it passed."""
    want_summary, want_state, want_rows, want_prompts = final_state(straight_url)
    got_summary, got_state, got_rows, got_prompts = final_state(url)
    assert got_summary.status == want_summary.status == "finished"
    assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows] == list(range(1, steps + 1))
    assert got_state.policy_state == want_state.policy_state
    assert sorted(got_prompts) == sorted(want_prompts)
    assert len(got_prompts) == len(set(got_prompts))
    return len(set(want_prompts) - set(got_prompts)), len(got_prompts) - len(set(got_prompts))


def switch_kinds(url: str) -> dict[int, list[str]]:
    """The kinds of the switches the store at ``url`` recorded, per step, in start order."""
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import SwitchEvent

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(SwitchEvent.step, SwitchEvent.kind).order_by(SwitchEvent.started_at)).all()
    finally:
        engine.dispose()
    out: dict[int, list[str]] = {}
    for step, kind in rows:
        out.setdefault(step, []).append(kind)
    return out


def live_group_members(pgids: Iterable[int], wait_s: float = 10.0) -> list[str]:
    """Processes still alive (not zombies) in any of the process groups ``pgids``, or in the
    sessions they lead (a child that moved to a group of its own stays in its session), as
    ``"pid pgid state cmdline"``; waits up to ``wait_s`` for ones that are dying."""
    wanted = set(pgids)
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                stat = (proc_dir / "stat").read_text()
                cmd = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            state, _ppid, pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
            if (int(pgrp) in wanted or int(session) in wanted) and state != "Z":
                alive.append(f"{proc_dir.name} {pgrp} {state} {cmd[:200]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
