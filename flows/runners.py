"""Which Prefect task runner the step flow uses, and how a phase is run on it (DESIGN §8).

Owns: the in-process and Ray paths, ``auto``'s choice between them, and the Prefect settings of the
run and step flows. Must not: start or stop a Ray cluster (the run's own is reused). Why each path
and when ``auto`` picks Ray: ``docs/flows.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from prefect_ray import RayTaskRunner

from config import TidalConfig
from flows.lifecycle import TEMPORARY_SERVER_ENV
from flows.progress import report_phase
from tasks.phases import DATA_PLANE_PHASES

PHASE_REMOTE_OPTIONS: dict[str, Any] = {"num_cpus": 0}
"""Ray options of every phase task: no CPU reservation (the work happens in the actors)."""


def server_configured() -> bool:
    """Whether this process's Prefect client talks to a server (not the embedded or temporary one)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return bool(url) and url != os.environ.get(TEMPORARY_SERVER_ENV)


@contextmanager
def prefect_settings_for(cfg: TidalConfig) -> Iterator[None]:
    """Point this process's Prefect client at ``prefect.api_url`` when the config names one.

    Enter it *before* calling the ``training_run`` flow (the CLI does): the flow run, its step flow
    runs and, through Prefect's serialized settings, the phases on Ray workers then all use it.
    """
    if not cfg.prefect.api_url:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: cfg.prefect.api_url}):
        yield


@contextmanager
def step_flow_settings() -> Iterator[None]:
    """Settings for the ``training_step`` flow runs: no flow-run heartbeats.

    Prefect's heartbeat thread sleeps in whole seconds and a flow run joins it on exit, so every
    flow run that sends heartbeats ends up to 1 s late (measured: 1.10 s per empty subflow with
    them, 0.15 s without). A step lasts seconds to minutes and a heartbeat only says "still alive"
    every 180 s, so step runs skip it; the parent ``training_run`` flow run keeps sending them, and
    that is the run whose liveness matters (a dead driver ends every step run with it; its
    heartbeat thread read the interval when it started, so this context can span the step loop).
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@contextmanager
def step_flow_client() -> Iterator[None]:
    """One async Prefect client for every ``training_step`` flow run this context spans.

    Each subflow run starts with a task run in the parent flow run that stands for it, created
    by a coroutine on Prefect's run-sync event loop through ``get_client()``. Without an open
    async client in context that builds a new ``PrefectClient`` per step (an SSL context loaded
    from the CA bundle, an httpx client, its connection to the API): ~0.1 s of every step
    boundary on a loaded 2-core machine (py-spy). Here the client is started once on that loop
    and put in context, where ``get_client()`` finds it (it matches the loop) and every step
    reuses it and its connection. Enter it inside the ``training_run`` flow run.
    """
    from prefect.context import AsyncClientContext
    from prefect.utilities.asyncutils import run_coro_as_sync

    context = AsyncClientContext()
    run_coro_as_sync(context.client.__aenter__())  # started on the run-sync loop: its client's loop
    try:
        with context:
            yield
    finally:
        run_coro_as_sync(context.client.__aexit__(None, None, None))


def runner_kind(cfg: TidalConfig) -> str:
    """``"ray"`` or ``"thread"``: what ``prefect.task_runner`` resolves to in this environment."""
    choice = cfg.prefect.task_runner
    if choice == "auto":
        choice = "ray" if server_configured() else "thread"
    return choice


def task_runner_for(cfg: TidalConfig, ray_address: str | None) -> Any:
    """`RayTaskRunner` on the run's cluster when a Prefect server is configured (or forced), else threads.

    Says which in the calling flow run's log (so the choice is visible in the UI).
    """
    if runner_kind(cfg) == "ray":
        runner: Any = PhaseRayTaskRunner(address=ray_address)
        where = f"phases run on RayTaskRunner (workers of the run's Ray cluster {ray_address})"
    else:
        from prefect.task_runners import ThreadPoolTaskRunner

        runner = ThreadPoolTaskRunner(max_workers=4)
        where = "phases run on ThreadPoolTaskRunner (in the flow's process)"
    _log(where)
    return runner


class PhaseRayTaskRunner(RayTaskRunner):
    """prefect-ray's ``RayTaskRunner``, with each Ray worker keeping Prefect's settings and API client.

    Stock, every task rebuilds on its worker the Prefect settings it was sent (pydantic-settings
    reads the environment and profile files again) and opens new API clients (each with a fresh
    SSL context): most of the worker-side cost of a phase here (profiled with py-spy). A Ray worker
    serves one driver and runs its tasks one after another in its main thread, where context
    variables persist, so the worker builds the settings once per distinct settings and opens one
    client per API URL, and Prefect's own ``get_client`` hands that client to every later phase.
    """

    @staticmethod
    def _run_prefect_task(*upstream_ray_obj_refs: Any, **kwargs: Any) -> Any:
        context = dict(kwargs.get("context") or {})
        settings = context.pop("settings_context", None)  # entered below instead of rebuilt per task
        with _worker_settings(settings):
            _keep_worker_client(settings or {})
            return RayTaskRunner._run_prefect_task(*upstream_ray_obj_refs, **{**kwargs, "context": context})


_WORKER: dict[str, Any] = {}
"""This worker process's cached settings context and long-lived client context."""


def _worker_settings(settings: dict[str, Any] | None) -> Any:
    """A fresh copy of the settings context built once for these serialized settings."""
    if not settings:
        return nullcontext()
    from prefect.context import SettingsContext

    if _WORKER.get("settings") != settings:
        _WORKER.update(settings=settings, settings_context=SettingsContext(**settings))
    return _WORKER["settings_context"].model_copy()


def _keep_worker_client(settings: dict[str, Any]) -> None:
    from prefect.context import SyncClientContext

    url = ((settings.get("settings") or {}).get("api") or {}).get("url")
    if SyncClientContext.get() is _WORKER.get("client_context") is not None and _WORKER.get("url") == url:
        return
    client_context = SyncClientContext()  # built under the run's settings (entered by the caller)
    client_context.__enter__()  # deliberately left open: it lives as long as the worker
    _WORKER.update(client_context=client_context, url=url)


def _log(message: str) -> None:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:  # called outside a flow run: nothing to attach the line to
        pass


_DATA_PLANE_LISTENERS: list[Callable[[], None]] = []


@contextmanager
def on_data_plane_phase(listener: Callable[[], None]) -> Iterator[None]:
    """Call ``listener()`` as each phase of this process's step flows that waits on the data plane
    is submitted (``tasks.phases.DATA_PLANE_PHASES``): what the step boundary would otherwise send
    to the Prefect API (``StepRuns.release``, ``RunProgress.release``) goes out then."""
    _DATA_PLANE_LISTENERS.append(listener)
    try:
        yield
    finally:
        _DATA_PLANE_LISTENERS.remove(listener)


def run_phase(phase: Any, *args: Any) -> Any:
    """Run one phase task on the flow's task runner (a Ray worker or a thread) and wait for its result.

    Calling a Prefect task directly would run it inline in the flow's thread whatever the runner;
    ``submit`` is what hands it to the runner. Failures raise here, like a direct call.
    """
    from prefect_ray.context import remote_options

    name = getattr(phase, "name", str(phase))
    report_phase(name)
    if name in DATA_PLANE_PHASES:
        for listener in _DATA_PLANE_LISTENERS:
            listener()
    if os.environ.get(CRASH_DURING_ENV):
        _crash_during(name, args)
    with remote_options(**PHASE_REMOTE_OPTIONS):  # read only by the Ray runner
        future = phase.submit(*args)
    return future.result()


CRASH_DURING_ENV = "TIDAL_CRASH_DURING"
"""Failpoint of the fault tests, ``phase:step`` (a phase whose second argument is the step, e.g.
``broadcast_sync:3``): the driver SIGKILLs itself while that phase's call to the controller is
in flight, submitted and not yet answered (``tasks.faults.CRASH_ENV``'s points fire after a
phase's call returned). Unset (always, outside the fault tests): one environment lookup."""


def _crash_during(name: str, args: tuple[Any, ...]) -> None:
    """Arm ``CRASH_DURING_ENV`` for this phase: its task's first ``ray.get`` (the phase's call to
    the controller, already submitted) waits 5 ms for the answer, says on stderr whether the call
    was still in flight, then SIGKILLs this process. Only on the in-process (thread) runner."""
    import signal

    import ray

    step = args[1] if len(args) > 1 else None
    if os.environ.get(CRASH_DURING_ENV) != f"{name}:{step}":
        return
    original = ray.get

    def get(refs: Any, *a: Any, **kw: Any) -> Any:
        from prefect.context import TaskRunContext

        context = TaskRunContext.get()
        if context is None or context.task.name != name:
            return original(refs, *a, **kw)
        ready, _ = ray.wait(list(refs) if isinstance(refs, list) else [refs], timeout=0.005)
        state = "answered" if ready else "in flight"
        # to fd 2 itself: the terminal's progress display may hold sys.stderr's lines back
        os.write(2, f"tidal failpoint {CRASH_DURING_ENV}={name}:{step}: SIGKILL with the phase's call {state}\n"
                 .encode())
        os.kill(os.getpid(), signal.SIGKILL)
        return original(refs, *a, **kw)  # not reached

    ray.get = get
