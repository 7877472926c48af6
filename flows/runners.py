"""Which Prefect task runner the step flow uses, and how a phase is run on it (DESIGN §8).

Two paths, both tested (``tests/e2e``):

- **in-process** (``ThreadPoolTaskRunner``): the default when no Prefect server is configured;
  works with Prefect's embedded (ephemeral) API and costs ~10 ms per task.
- **Ray** (``prefect_ray.RayTaskRunner``): when a server is configured (``prefect.api_url`` or
  ``PREFECT_API_URL``). Each phase runs as a Ray task on a worker of the run's *own* cluster —
  the driver has already called ``ray.init`` for the run, so the runner reuses that connection
  and never starts or stops a cluster. Phases are light (they call the run's actors), so they
  reserve no CPU: they can never wait behind the data plane for a slot.

Ephemeral Prefect with the Ray runner is unusable (every Ray worker would start its own temporary
API server), so ``auto`` picks Ray only when this process really talks to a server: the effective
``PREFECT_API_URL`` (environment, profile, or ``prefect.api_url`` applied with
``prefect_settings_for`` before the run flow starts — a flow cannot change its API mid-run).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from prefect_ray import RayTaskRunner

from config import TidalConfig

PHASE_REMOTE_OPTIONS: dict[str, Any] = {"num_cpus": 0}
"""Ray options of every phase task: no CPU reservation (the work happens in the actors)."""


def server_configured() -> bool:
    """Whether this process's Prefect client talks to a server (not the embedded one)."""
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


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
    """prefect-ray's ``RayTaskRunner`` whose workers keep one Prefect API client for every phase.

    Stock, each task builds a new client on its worker (twice: once for its parent's context, once
    for its own), and most of that is creating a fresh SSL context: about two thirds of the
    ~150 ms a phase costs on Ray here (profiled with py-spy). A Ray worker serves one driver and
    runs its tasks one after another in its main thread, where context variables persist, so the
    first phase on a worker opens a client for the run's API and leaves it in Prefect's client
    context; Prefect's own ``get_client`` then hands it to every later phase on that worker.
    """

    @staticmethod
    def _run_prefect_task(*upstream_ray_obj_refs: Any, **kwargs: Any) -> Any:
        _keep_worker_client(kwargs.get("context") or {})
        return RayTaskRunner._run_prefect_task(*upstream_ray_obj_refs, **kwargs)


_WORKER_CLIENT: dict[str, Any] = {}
"""This worker process's long-lived client context and the API URL it talks to."""


def _keep_worker_client(context: dict[str, Any]) -> None:
    from prefect.context import SettingsContext, SyncClientContext

    settings = context.get("settings_context") or {}
    url = ((settings.get("settings") or {}).get("api") or {}).get("url")  # cheap: no settings rebuild
    if SyncClientContext.get() is _WORKER_CLIENT.get("context") is not None and _WORKER_CLIENT.get("url") == url:
        return
    with SettingsContext(**settings) if settings else nullcontext():  # the run's API, once per worker
        client_context = SyncClientContext()
        client_context.__enter__()  # deliberately left open: it lives as long as the worker
    _WORKER_CLIENT.update(context=client_context, url=url)


def _log(message: str) -> None:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:  # called outside a flow run: nothing to attach the line to
        pass


def run_phase(phase: Any, *args: Any) -> Any:
    """Run one phase task on the flow's task runner (a Ray worker or a thread) and wait for its result.

    Calling a Prefect task directly would run it inline in the flow's thread whatever the runner;
    ``submit`` is what hands it to the runner. Failures raise here, like a direct call.
    """
    from prefect_ray.context import remote_options

    with remote_options(**PHASE_REMOTE_OPTIONS):  # read only by the Ray runner
        future = phase.submit(*args)
    return future.result()
