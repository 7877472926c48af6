"""One Prefect task per phase of a training step: each a few lines around one actor call.

Every task takes the run's ``RunRef`` (small, JSON-serialisable: Prefect records it as a
parameter) and finds the actors by name in the run's Ray namespace, so the tasks run the same in
the driver (in-process runner) and on Ray workers (``RayTaskRunner``). Controller methods are
named by reference (``ControllerHost.should_deactivate``), never by string. The policy questions retry
once: the controller answers a repeated (step, question) from memory, so a retry records nothing
twice. Switches and training are never retried.

Must not: ask a policy, override an answer, or build a policy context (the controller does all
three).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from cluster.actors import CONTROLLER, TRAINER, ControllerHost, actor_gone, call
from loop.guards import STRANDED_POLL_S
from loop.plans import (
    BroadcastReport,
    DeactivatePlan,
    LendPlan,
    MicroSummary,
    StepOutcome,
    SwitchReport,
    WaitReport,
)
from tasks.faults import crash_point, kill_rank_point
from tasks.run_ref import MicroReport, RunRef


DATA_PLANE_PHASES = frozenset({"wait_for_samples", "train", "broadcast_sync"})
"""The phases in which a step waits on the data plane (the rollout, the trainer, the weight sync):
the control plane's own API traffic of the step boundary is best sent meanwhile
(``flows.step_runs``, ``tasks.artifact.RunProgress``)."""


def _actor(run: RunRef, name: str) -> Any:
    if not ray.is_initialized():
        ray.init(address=run.ray_address or "auto", namespace=run.namespace, log_to_driver=False)
    try:
        return ray.get_actor(name, namespace=run.namespace)
    except ValueError as e:
        raise actor_gone(name, e) from e


def _controller(run: RunRef, method: Any, *args: Any) -> Any:
    """Call ``method`` (a ``ControllerHost`` method) on the run's controller actor and wait."""
    return ray.get(call(_actor(run, CONTROLLER), method, *args))


def phase(name: str, **options: Any) -> Any:
    """The Prefect task decorator of a phase: no cache key, no persisted result. Tidal's store keeps
    what outlives a step, so Prefect has nothing to cache; hashing each call's inputs (and the
    task's source) for a cache key it never uses cost about a third of a task run's overhead."""
    return task(name=name, cache_policy=NO_CACHE, persist_result=False, **options)


def summaries(micro: Sequence[MicroReport]) -> list[MicroSummary]:
    """What the policy context needs of this step's micro-steps."""
    return [MicroSummary(samples=m.samples, wait_s=m.wait_s, wait_samples=m.wait_samples) for m in micro]


@phase("should_deactivate", retries=1)
def should_deactivate(run: RunRef, step: int) -> DeactivatePlan:
    """Ask whether to take the hybrids back before training, and how many samples to wait for."""
    return _controller(run, ControllerHost.should_deactivate, step)


@phase("wait_for_samples")
def wait_for_samples(run: RunRef, plan: DeactivatePlan) -> WaitReport:
    """Let the hybrids generate until ``plan.wait_samples`` are queued (or data runs out), then deactivate."""
    pending = call(_actor(run, CONTROLLER), ControllerHost.wait_for_samples, plan, run.wait_timeout_s)
    crash_point("wait_for_samples", plan.step)
    return ray.get(pending)


@phase("train")
def train(run: RunRef, step: int, micro_step: int) -> MicroReport:
    """One micro-step: pull ``required_samples`` from the queue and update the policy model.

    The pull is made in slices of ``loop.guards.STRANDED_POLL_S``: after a slice that timed out,
    the controller lends the hybrids to refill the queue if no standalone replica is left to do it
    (``loop.guards.stranded_refill``, through ``ControllerHost.refill_if_stranded``), instead of
    waiting for samples nothing would generate. The refills' switches go with the micro-step's
    report (the step's switch seconds count them).
    """
    deadline = time.monotonic() + (run.wait_timeout_s or float("inf"))
    earlier_wait_s, first, refills = 0.0, None, []
    while True:
        poll = min(STRANDED_POLL_S, max(0.0, deadline - time.monotonic()))
        pending = _actor(run, TRAINER).train_micro_step.remote(poll)
        crash_point("train", step)
        kill_rank_point("train", step, run.namespace, run.trainer_gpus)
        report: MicroReport = ray.get(pending)
        first = report if first is None else first
        if not report.timed_out:
            break
        earlier_wait_s += report.wait_s
        if time.monotonic() >= deadline:
            raise TimeoutError(f"step {step}: no {run.required_samples} samples after {run.wait_timeout_s}s "
                               f"({report.mq_size} queued)")
        refills += _controller(run, ControllerHost.refill_if_stranded, step, run.wait_timeout_s)
    if earlier_wait_s:  # one pull, as the policy sees it, spread over several slices
        report = dataclasses.replace(report, wait_s=report.wait_s + earlier_wait_s,
                                     allocated_s=report.allocated_s + earlier_wait_s,
                                     wait_samples=max(0, run.required_samples - first.queue_size_at_start))
    return dataclasses.replace(report, refills=tuple(refills))


@phase("broadcast_sync")
def broadcast_sync(run: RunRef, step: int, version: int, lend: LendPlan | None = None) -> BroadcastReport:
    """Trainer → standalone replicas at ``version``; closes the rollouter's staleness window. With
    ``lend``, the lent hybrids wake and load ``version`` meanwhile (``overlap_hybrid_sync``)."""
    report = _controller(run, ControllerHost.broadcast_sync, version, *(() if lend is None else (True, lend)))
    crash_point("broadcast_sync", step)
    return report


@phase("should_activate", retries=1)
def should_activate(run: RunRef, step: int, micro: list[MicroSummary]) -> LendPlan:
    """Ask whether to lend the trainer's GPUs to rollout until the next step."""
    return _controller(run, ControllerHost.should_activate, step, micro)


@phase("hybrid_sync")
def hybrid_sync(run: RunRef, plan: LendPlan, version: int) -> SwitchReport:
    """Wake the hybrid engines and load ``version`` in-process (only on steps that lend)."""
    return _controller(run, ControllerHost.hybrid_sync, plan, version)


@phase("activate")
def activate(run: RunRef, plan: LendPlan, micro: list[MicroSummary]) -> tuple[SwitchReport, ...]:
    """Put the hybrids behind the load balancer; rebalance when enabled and the policy asks."""
    return _controller(run, ControllerHost.activate, plan, micro)


@phase("update_after_step", retries=1)
def update_after_step(run: RunRef, step: int, micro: list[MicroSummary]) -> StepOutcome:
    """Let the policy adapt; returns what the store keeps of the policy, controller and switches."""
    return _controller(run, ControllerHost.update_after_step, step, micro)


@phase("commit")
def commit(run: RunRef, step: int, version: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint the trainer, write the step's rows in one transaction, then show the step in the UI.

    A store lost after the transaction (the UI's step table is read back from it) does not fail
    the step, which is committed: the result carries the loss under ``store_lost`` (message, url,
    reason) and the driver stops after this step (``flows.training_run``), saying it is committed.
    """
    from storage import StoreUnavailable
    from tasks.artifact import publish_step
    from tasks.commit import commit as commit_rows

    result = commit_rows(run, step, version, summary, time.time())
    try:
        publish_step(run, step, result, summary["metrics"], summary.get("skipped", ()))
    except StoreUnavailable as exc:
        return {**result, "store_lost": {"message": str(exc), "url": exc.url, "reason": exc.reason}}
    return result
