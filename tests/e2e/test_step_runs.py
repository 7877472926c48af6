"""Step flow runs created ahead (`flows.step_runs.StepRuns`) against Prefect's own API.

Each test runs a parent flow whose body drives a small step flow through `StepRuns`, then reads
the parent's flow runs back: the step runs must look exactly like subflow calls (a child of the
parent, named by the template, the parameters they ran with, a stand-in task run in the parent in
the same final state), be created only once the previous step's data plane is busy, and leave
nothing behind when the run ends before a prepared step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prefect import flow, get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.context import FlowRunContext
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.asyncutils import run_coro_as_sync
from driver_support import seed_prefect_home

from flows.runners import on_data_plane_phase, run_phase, step_flow_client
from flows.step_runs import StepRuns

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _server(tmp_path_factory):
    """Tidal's own Prefect server (what `tidal run` starts), for this module's flow runs: Prefect's
    ephemeral one answers concurrent writes with 503 and a fixed 2 s retry (DESIGN §8)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.prefect_server import LocalPrefectServer

    from prefect.logging.handlers import APILogWorker

    with LocalPrefectServer(home=str(seed_prefect_home(tmp_path_factory.mktemp("prefect-home")))) as server, \
            temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield server
        APILogWorker.drain_all(timeout=5)  # while the server still answers


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def _train(step: int, pause_s: float) -> int:
    time.sleep(pause_s)
    return step * 10


@flow(name="probe-step", flow_run_name="{label}-step-{step:05d}", validate_parameters=False)
def _step(label: str, step: int, pause_s: float = 0.0, fail: bool = False) -> dict[str, Any]:
    started = time.time()
    value = run_phase(_train, step, pause_s)
    if fail:
        raise RuntimeError(f"step {step} failed on purpose")
    return {"value": value, "started": started}


STEP = _step.with_options(task_runner=ThreadPoolTaskRunner(max_workers=2))


def _drive(label: str, steps: list[dict[str, Any]], nexts: list[dict[str, Any] | None]) -> dict[str, Any]:
    """In a parent flow: each of ``steps`` through one ``StepRuns``, with ``nexts`` as the
    predicted next parameters. Returns the parent's id, the results (or the error) per step."""

    @flow(name=f"probe-parent-{label}")
    def parent() -> dict[str, Any]:
        out: dict[str, Any] = {"id": FlowRunContext.get().flow_run.id, "results": []}
        with step_flow_client(), StepRuns(STEP) as runs, on_data_plane_phase(runs.release):
            for params, then in zip(steps, nexts, strict=True):
                try:
                    out["results"].append(runs.run(params, then=then))
                except RuntimeError as exc:
                    out["results"].append(str(exc))
                    break
        return out

    return parent()


def _children(parent_id: Any) -> tuple[list[Any], dict[Any, Any]]:
    """The parent's flow runs (by name) and its task runs by id."""
    async def read() -> tuple[list[Any], dict[Any, Any]]:
        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
            tasks = await client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[parent_id])))
        return sorted(runs, key=lambda r: r.name), {t.id: t for t in tasks}

    return run_coro_as_sync(read())


def _params(label: str, step: int, **extra: Any) -> dict[str, Any]:
    return {"label": label, "step": step, **extra}


def test_step_runs_look_like_subflow_calls_named_with_their_parameters_and_states():
    steps = [_params("a", n, pause_s=0.05) for n in (1, 2, 3)]
    out = _drive("a", steps, [steps[1], steps[2], None])
    runs, tasks = _children(out["id"])
    assert [r["value"] for r in out["results"]] == [10, 20, 30]
    assert [r.name for r in runs] == ["a-step-00001", "a-step-00002", "a-step-00003"]
    assert [r.state.type.value for r in runs] == ["COMPLETED"] * 3
    assert [r.parameters for r in runs] == steps
    stand_ins = [tasks[r.parent_task_run_id] for r in runs]
    assert [(t.name.rsplit("-", 1)[0], t.state.type.value) for t in stand_ins] == [("probe-step", "COMPLETED")] * 3
    assert len(tasks) == 3  # nothing else was created in the parent


def test_a_next_step_predicted_wrong_runs_and_is_recorded_with_its_real_parameters():
    real = [_params("b", 1), _params("b", 2, pause_s=0.01)]
    out = _drive("b", real, [_params("b", 2), None])  # step 2's pause was not known in advance
    runs, _ = _children(out["id"])
    assert [r.parameters for r in runs] == real


def test_the_next_run_is_created_once_the_data_plane_is_busy_not_at_the_step_start():
    steps = [_params("c", 1, pause_s=0.5), _params("c", 2)]
    out = _drive("c", steps, [steps[1], None])
    runs, _ = _children(out["id"])
    first_started, second = out["results"][0]["started"], runs[1]
    # submitted with step 1's `train` phase (which sleeps 0.5 s): after step 1 began, before it ended
    assert first_started <= second.created.timestamp() < first_started + 0.5, (first_started, second.created)


def test_a_run_that_ends_before_its_prepared_step_leaves_no_flow_run_or_stand_in_behind():
    steps = [_params("d", 1, fail=True)]
    out = _drive("d", steps, [_params("d", 2)])
    runs, tasks = _children(out["id"])
    assert out["results"] == ["step 1 failed on purpose"]
    assert [(r.name, r.state.type.value) for r in runs] == [("d-step-00001", "FAILED")]
    assert [t.state.type.value for t in tasks.values()] == ["FAILED"]


def test_a_resume_deletes_the_step_run_its_dead_driver_prepared_and_marks_the_rest_crashed():
    from prefect.states import Running

    from flows.driver import _mark_crashed
    from flows.lifecycle import Record

    @flow(name="probe-parent-dead")
    def dies_after_step_1() -> Any:
        runs = StepRuns(STEP)  # never closed: its driver "dies" with step 2 prepared
        with step_flow_client(), on_data_plane_phase(runs.release):
            runs.run(_params("e", 1, pause_s=0.05), then=_params("e", 2))
            runs._ahead.future.result(timeout=30)  # step 2's flow run exists (Pending)
        return FlowRunContext.get().flow_run.id

    parent_id = dies_after_step_1()
    runs, _ = _children(parent_id)
    assert [(r.name, r.state.type.value) for r in runs] == [("e-step-00001", "COMPLETED"), ("e-step-00002", "PENDING")]

    async def reopen() -> None:  # as the dead driver left it: its flow run never finished
        async with get_client() as client:
            await client.set_flow_run_state(parent_id, Running(), force=True)

    run_coro_as_sync(reopen())
    _mark_crashed(Record("flow-run", info={"id": str(parent_id)}))
    runs, tasks = _children(parent_id)
    parent = run_coro_as_sync(_read(parent_id))
    assert [(r.name, r.state.type.value) for r in runs] == [("e-step-00001", "COMPLETED")]
    assert (len(tasks), parent.state.type.value) == (1, "CRASHED")  # step 2's stand-in went with it


async def _read(flow_run_id: Any) -> Any:
    async with get_client() as client:
        return await client.read_flow_run(flow_run_id)
