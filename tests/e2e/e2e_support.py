"""Helpers of the end-to-end tests: processes we start and end by pid, and reading runs back.

Every process started here runs in its own session with a timeout and is ended by its pid (its
process group). Processes a flow run starts on its own (its Ray cluster) are found by the run's
unique Ray temp dir on their command line, never by a broad name.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flows.prefect_server import LocalPrefectServer

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_STEPS = 3
EMBEDDED_OVERLAP = ("async_training.dynamic_schedule_overlap_hybrid_sync=true",
                    "async_training.dynamic_schedule_policy=step_counting_policy:StepCountingPolicy")
"""The embedded run syncs its hybrids during the broadcast (the deployed run keeps the reference's
order), under a policy that lends after odd steps (``tests/integration/step_counting_policy.py``)."""
"""Steps of the session's embedded-Prefect run (conftest ``embedded_run``)."""
PREFECT = [sys.executable, "-m", "prefect"]
TIDAL = [sys.executable, "-m", "flows.cli"]


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------


def run_cmd(cmd: list[str], env: dict[str, str], timeout_s: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run to completion in its own session; on timeout end its whole group and fail with its output."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} … timed out after {timeout_s:.0f}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def stop_group(proc: subprocess.Popen, first: int = signal.SIGINT, grace_s: float = 5.0) -> None:
    """End a child we started in its own session: ``first`` to its group, once more after ``grace_s``
    (a Prefect CLI that has run a flow treats the second Ctrl-C as "kill"), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((first, grace_s), (first, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def kill_processes_mentioning(marker: str) -> list[int]:
    """SIGKILL every process whose command line contains ``marker`` (a temp dir unique to this test)."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


def client_env(server: LocalPrefectServer | None, home: Path | None = None) -> dict[str, str]:
    """Environment for a CLI/worker/flow process: the server (or ephemeral on ``home``), quiet, CPU-safe."""
    env = server.env() if server is not None else {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    env.update(RAY_AUTH_MODE=env.get("RAY_AUTH_MODE", "disabled"), RAY_USAGE_STATS_ENABLED="0",
               PREFECT_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1", PREFECT_WORKER_QUERY_SECONDS="1",
               PREFECT_CLI_WRAP_LINES="false", COLUMNS="200")
    return env


def run_overrides(tmp: Path, steps: int) -> list[str]:
    """A short tiny-cpu run whose every output lies in ``tmp``."""
    return [f"trainer.total_training_steps={steps}", f"storage.url=sqlite:///{tmp / 'tidal.db'}",
            f"trainer.default_local_dir={tmp / 'runs'}", f"ray.temp_dir={tmp / 'ray'}",
            "ray.memory_gb=3", "ray.object_store_memory_gb=0.3"]


# ------------------------------------------------------------------------------------------------
# reading runs back
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlowRunView:
    """One flow run as the Prefect API shows it, with its task runs in start order."""

    id: Any
    name: str
    state: str
    phases: tuple[str, ...]  # task names (``train-6b3`` → ``train``) in start order
    parameters: dict[str, Any]
    spans: tuple[tuple[float, float], ...] = ()  # each phase's (start, end), epoch seconds


def on_server(api_url: str, coro_fn: Any, *args: Any) -> Any:
    """Run ``coro_fn(*args)`` with this process's Prefect client pointed at ``api_url``."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        return asyncio.run(coro_fn(*args))


async def _views(client: Any, flow_runs: list[Any]) -> list[FlowRunView]:
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    views = []
    for fr in sorted(flow_runs, key=lambda f: f.name):
        tasks = await client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[fr.id])))
        ordered = sorted(tasks, key=lambda t: (t.start_time or t.expected_start_time, t.created))
        phases = tuple(t.name.rsplit("-", 1)[0] for t in ordered)
        spans = tuple((t.start_time.timestamp() if t.start_time else float("nan"),
                       t.end_time.timestamp() if t.end_time else float("nan")) for t in ordered)
        views.append(FlowRunView(fr.id, fr.name, fr.state_name, phases, dict(fr.parameters), spans))
    return views


async def _read_step_runs(parent_id: Any, expect_steps: int, timeout_s: float) -> list[FlowRunView]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    only_children = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))
    async with get_client() as client:
        deadline = time.monotonic() + timeout_s
        while True:  # task runs reach the database through the server's event pipeline: let them settle
            steps = await _views(client, await client.read_flow_runs(flow_run_filter=only_children))
            settled = (len(steps) == expect_steps and all(s.state == "Completed" for s in steps)
                       and all(s.phases[-1:] == ("commit",) for s in steps))
            if settled or time.monotonic() > deadline:
                return steps
            await asyncio.sleep(0.5)


def read_step_runs(api_url: str, parent_id: Any, expect_steps: int, timeout_s: float = 30.0) -> list[FlowRunView]:
    """The `training-step` children of a `training-run` flow run, with their phases in start order."""
    return on_server(api_url, _read_step_runs, parent_id, expect_steps, timeout_s)


async def _read_runs_of_flow(flow_name: str) -> list[FlowRunView]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async with get_client() as client:
        return await _views(client, await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name]))))


def read_runs_of_flow(api_url: str, flow_name: str) -> list[FlowRunView]:
    """Every run of the flow called ``flow_name``, with its task runs."""
    return on_server(api_url, _read_runs_of_flow, flow_name)


async def _read_flow_run(flow_run_id: Any) -> Any:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await client.read_flow_run(flow_run_id)


def read_flow_run(api_url: str, flow_run_id: Any) -> Any:
    return on_server(api_url, _read_flow_run, flow_run_id)


async def _read_logs(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [log.message for log in logs]


def read_logs(api_url: str, flow_run_id: Any) -> list[str]:
    return on_server(api_url, _read_logs, flow_run_id)


def store_decisions(db: Path) -> tuple[dict[int, bool], dict[int, bool], dict[int, bool]]:
    """From the Tidal store: per step, (hybrid active after it, its last should_activate_after_step answer (lent or not),
    whether the policy asked to deactivate before training)."""
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import Decision, Step

    engine = make_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        active = {s: bool(a) for s, a in conn.execute(sa.select(Step.step, Step.hybrid_active_after))}
        rows = conn.execute(sa.select(Decision.step, Decision.hook, Decision.answer_json).order_by(Decision.id)).all()
    engine.dispose()
    activate = {s: bool(answer) for s, hook, answer in rows if hook == "should_activate_after_step"}
    deactivate = {s: bool(answer) for s, hook, answer in rows if hook == "should_deactivate"}
    return active, activate, deactivate


def expected_phases(trigger: int, deactivated: bool, activated: bool, final: bool = False,
                    overlap: bool = False, lent: bool = False) -> tuple[str, ...]:
    """DESIGN §2's order for one step; the run's last step asks no lend (nothing trains after it).
    ``overlap`` (``dynamic_schedule_overlap_hybrid_sync``): the lend is asked before the broadcast,
    which syncs the hybrids itself (no ``hybrid_sync`` task). ``lent``: the hybrids were lent as the
    step began, so it asks whether to take them back (``should_deactivate``); otherwise it has no such task."""
    ask = () if final else ("should_activate",)
    sync = ask + ("broadcast_sync",) if overlap else ("broadcast_sync",) + ask + (("hybrid_sync",) if activated else ())
    return ((("should_deactivate",) if lent else ()) + (("wait_for_samples",) if deactivated else ()) + ("train",) * trigger
            + sync + (("activate",) if activated else ()) + ("update_after_step", "commit"))


def step_run_names(db: Path, steps: int) -> list[str]:
    """The `training-step` flow-run names the UI should show for the store's one run: ``<run id>-step-<NNNNN>``."""
    import sqlalchemy as sa

    from storage import make_engine
    from storage.models import Run

    engine = make_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        (uid,) = conn.execute(sa.select(Run.uid)).scalars().all()
    engine.dispose()
    return [f"{uid}-step-{i:05d}" for i in range(1, steps + 1)]


def step_of(name: str) -> int:
    """The step number of a `training-step` flow-run name."""
    return int(name.rsplit("-step-", 1)[1])


async def _read_artifacts(key: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def read_artifacts(api_url: str, key: str) -> list[Any]:
    """Every version of the artifact ``key``."""
    return on_server(api_url, _read_artifacts, key)
