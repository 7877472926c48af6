"""Step flow runs created one step ahead, so that a step boundary waits for none of the API round
trips that create a subflow run.

Owns: the ``training_step`` flow runs of one ``training_run`` flow run — creating each (the
stand-in task run in the parent, then the flow run, named and Pending) while the step before it
works, starting it through Prefect's own engine, and deleting one that was prepared for a step
that never ran. Must not: decide which step comes next, or what a step does (the driver and the
flow do). Why and what it saves: ``docs/control-plane-overhead.md``, "Step flow runs created ahead".
"""

from __future__ import annotations

import contextvars
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tidal.step_runs")


@dataclass
class _Ahead:
    """The flow run being prepared for the next step's (expected) parameters."""

    parameters: dict[str, Any]
    go: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    future: Future[Any] | None = None


class StepRuns:
    """Runs a subflow (``flow``, already carrying its task runner) once per step, each time in a
    flow run created while the step before it ran.

    Prefect's subflow call makes four API round trips before its flow run exists — the parent's
    stand-in task run, the flow upsert, a look-up for an earlier run of that stand-in, the flow run
    itself — and a fifth to rename it after its template. Here the stand-in and the flow run (its
    name resolved) are created on a background thread, in a copy of the caller's context (the
    parent flow run and its API client), once the previous step's data plane is busy
    (``release``, from ``flows.runners.on_data_plane_phase``). The step then runs in that flow run through
    ``prefect.flow_engine.run_flow``, the path Prefect runs an existing flow run by (a
    deployment's): it proposes Running, runs the flow, proposes the final state. The UI shows the
    same tree as a subflow call: the flow run's parent is the stand-in, whose state the server
    keeps in step with it.

    Enter it inside the parent flow run (and inside ``flows.runners.step_flow_client``).
    """

    def __init__(self, flow: Any) -> None:
        from prefect.context import FlowRunContext

        self._flow = flow
        self._named = flow.with_options()  # the same flow, but its engine does not rename the run:
        self._named.flow_run_name = None  # the run is created with its name already
        self._parent = FlowRunContext.get()
        if self._parent is None or self._parent.flow_run is None:
            raise RuntimeError("StepRuns runs subflows: enter it inside a flow run")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-step-run")
        self._ahead: _Ahead | None = None

    def run(self, parameters: dict[str, Any], then: dict[str, Any] | None = None) -> Any:
        """Run the flow with ``parameters`` (in the flow run prepared for them, else a new one)
        and return its result or raise its error. ``then``: the next step's parameters as far as
        they are known now; its flow run is prepared while this step's data plane works."""
        from prefect.flow_engine import run_flow

        flow_run = self._take(parameters)
        if then is not None:
            ahead = _Ahead(then)
            ahead.future = self._pool.submit(contextvars.copy_context().run, self._prepare, ahead)
            self._ahead = ahead
        return run_flow(flow=self._named, flow_run=flow_run, parameters=parameters)

    def release(self) -> None:
        """The running step's data plane is busy: the preparation may go (made at the step's start
        instead, it would queue at the server behind the step's own API calls)."""
        if self._ahead is not None:
            self._ahead.go.set()

    def _prepare(self, ahead: _Ahead) -> Any:
        ahead.go.wait()
        return None if ahead.cancelled else self._create(ahead.parameters)

    def _take(self, parameters: dict[str, Any]) -> Any:
        """The flow run for ``parameters``: the prepared one (its recorded parameters corrected when
        the step's turned out otherwise), or one created now."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.future is None:
            return self._create(parameters)
        ahead.go.set()
        try:
            flow_run = ahead.future.result()
        except Exception as exc:  # noqa: BLE001 - a failed preparation costs only its time
            log.warning("the flow run prepared for this step could not be created (%s); creating it now", exc)
            return self._create(parameters)
        if ahead.parameters != parameters:
            _call(_update_parameters, flow_run.id, self._flow.serialize_parameters(parameters))
        return flow_run

    def _create(self, parameters: dict[str, Any]) -> Any:
        return _call(_create_subflow_run, self._flow, self._parent, parameters)

    def close(self) -> None:
        """Delete the flow run prepared for a step that never ran (the run ended first)."""
        ahead, self._ahead = self._ahead, None
        try:
            if ahead is None or ahead.future is None:
                return
            ahead.cancelled = True  # not started yet: it never will be
            ahead.go.set()
            try:
                flow_run = ahead.future.result(timeout=10)
            except Exception:  # noqa: BLE001 - nothing was created, or it cannot be known
                return
            if flow_run is not None:
                try:
                    _call(delete_unstarted, flow_run.id, flow_run.parent_task_run_id)
                except Exception as exc:  # noqa: BLE001 - a stale Pending row is not worth a run
                    log.warning("could not delete the unused step flow run %s: %s", flow_run.name, exc)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> StepRuns:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def _call(coroutine_fn: Any, *args: Any) -> Any:
    """Run an API coroutine on Prefect's run-sync loop, where the context's client lives."""
    from prefect.utilities.asyncutils import run_coro_as_sync

    return run_coro_as_sync(coroutine_fn(*args))


async def _create_subflow_run(flow: Any, parent: Any, parameters: dict[str, Any]) -> Any:
    """What Prefect's subflow call creates before it runs (``FlowRunEngine.create_flow_run``): the
    stand-in task run in ``parent`` and a Pending flow run under it, here with its name resolved.

    Prefect's engine also marks its stand-in ``_is_subflow_tracking_task``; that private flag only
    changes the stand-in's key when the subflow is called from inside a task run, and the steps are
    called from the parent flow's body, so the stand-in is a plain ``Task`` here
    (docs/platform-notes.md, "Private Prefect and Ray names we use")."""
    from prefect.client.orchestration import get_client
    from prefect.context import TagsContext
    from prefect.states import Pending
    from prefect.tasks import Task

    stand_in = Task(name=flow.name, fn=flow.fn, version=flow.version)
    task_run = await stand_in.create_run(flow_run_context=parent, parameters=parameters)
    async with get_client() as client:
        return await client.create_flow_run(
            flow=flow, name=run_name(flow, parameters),
            parameters=flow.serialize_parameters(parameters), state=Pending(),
            parent_task_run_id=task_run.id, tags=TagsContext.get().current_tags)


def run_name(flow: Any, parameters: dict[str, Any]) -> str | None:
    """The name Prefect's engine would give a run of ``flow`` once it starts, from the flow's public
    ``flow_run_name``: a template formatted with the run's parameters, or a callable's answer; None
    (the server picks one) when the flow has neither."""
    template = flow.flow_run_name
    if template is None:
        return None
    name = template() if callable(template) else template.format(**parameters)
    if not isinstance(name, str):
        raise TypeError(f"flow_run_name of {flow.name!r} gave {type(name).__name__}, not a string")
    return name


async def _update_parameters(flow_run_id: Any, parameters: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        await client.update_flow_run(flow_run_id, parameters=parameters)


async def delete_unstarted(flow_run_id: Any, stand_in_id: Any) -> None:
    """Delete a step flow run that never started, and its stand-in task run in the parent."""
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        await client.delete_flow_run(flow_run_id)
        if stand_in_id is not None:
            await client.delete_task_run(stand_in_id)
