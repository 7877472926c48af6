"""One Prefect task per phase of a training step: thin adapters around one actor call each.

Every task takes the run's ``RunRef`` (small, JSON-serialisable: Prefect records it as a
parameter) and finds the actors by name in the run's Ray namespace, so the tasks run the same in
the driver (in-process runner) and on Ray workers (``RayTaskRunner``). Retries only on the
idempotent reads; switches and training are never retried.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray
from prefect import task

from cluster.actors import CONTROLLER, ROLLOUT_SERVICE, TRAINER
from policies import DynamicScheduleContext
from tasks.faults import crash_point
from tasks.run_ref import MicroReport, RunRef


def _actor(run: RunRef, name: str) -> Any:
    if not ray.is_initialized():
        ray.init(address=run.ray_address or "auto", namespace=run.namespace, log_to_driver=False)
    return ray.get_actor(name, namespace=run.namespace)


def _controller(run: RunRef, method: str, *args: Any) -> Any:
    return ray.get(_actor(run, CONTROLLER).call.remote(method, *args))


def build_context(run: RunRef, step: int, micro: list[MicroReport]) -> DynamicScheduleContext:
    """The policy's view now: static sizes, generation counters, this step's waits, switch timings."""
    stats = ray.get(_actor(run, ROLLOUT_SERVICE).stats.remote())
    ctx = DynamicScheduleContext(
        required_samples=run.required_samples,
        trigger_parameter_sync_step=run.trigger_parameter_sync_step,
        total_generated_samples=run.generated_before + int(stats.get("total_generated_samples", 0)),
        expected_samples=run.consumed_before + sum(m.samples for m in micro),
        buffer_samples=run.buffer_samples,
        step_wait_times=[m.wait_s for m in micro],
        step_wait_samples=[m.wait_samples for m in micro],
        only_hybrid=run.only_hybrid,
        mq_size=int(stats.get("queue_size", 0)),
        standalone_replicas=run.standalone_replicas,
        hybrid_replicas=run.hybrid_replicas,
    )
    return _controller(run, "context", ctx)


@task(name="should_deactivate", retries=1)
def should_deactivate(run: RunRef, step: int) -> dict[str, Any]:
    """Ask the policy whether to take the hybrids back before training, and how many samples to wait for."""
    ctx = build_context(run, step, [])
    controller = _actor(run, CONTROLLER)
    active = ray.get(controller.hybrid_active.remote())
    answer = _controller(run, "should_deactivate", step, ctx) if active else False
    wait = _controller(run, "deactivate_wait_samples", step, ctx) if answer else 0
    if answer and _standalone_lost(run):  # nothing else will generate while the trainer trains
        wait = ctx.step_required_samples
    return {"deactivate": bool(answer), "wait_samples": int(wait), "hybrid_active": bool(active)}


def _standalone_lost(run: RunRef) -> bool:
    """Every standalone replica of a run that had some has died: behave as only-hybrid."""
    return run.standalone_replicas > 0 and ray.get(_actor(run, CONTROLLER).standalone_alive.remote()) == 0


@task(name="wait_for_samples")
def wait_for_samples(run: RunRef, step: int, wait_samples: int) -> dict[str, Any]:
    """Let the hybrids generate until ``wait_samples`` are queued (or data runs out), then deactivate."""
    pending = _actor(run, ROLLOUT_SERVICE).wait_for_queue.remote(wait_samples, run.wait_timeout_s)
    crash_point("wait_for_samples", step)
    waited = ray.get(pending)
    timing = _controller(run, "deactivate")
    return {"wait_for_enough_samples_s": waited["waited_s"], "mq_size": waited["mq_size"],
            "deactivate": dataclasses.asdict(timing)}


def _refill_if_stranded(run: RunRef, step: int) -> None:
    """The last standalone replica died while the hybrids were asleep (after this step's
    deactivate): nothing would generate while the trainer waits for its samples. Lend the hybrids
    until one micro-step's samples are queued and take them back, as only-hybrid mode does."""
    if run.hybrid_replicas == 0 or not _standalone_lost(run):
        return
    if ray.get(_actor(run, CONTROLLER).hybrid_active.remote()):
        return  # the hybrids generate while the trainer waits
    rollout = _actor(run, ROLLOUT_SERVICE)
    if ray.get(rollout.queue_size.remote()) >= run.required_samples:
        return
    _controller(run, "hybrid_sync", step - 1)  # the param version in force during step `step`
    _controller(run, "activate")
    try:
        ray.get(rollout.wait_for_queue.remote(run.required_samples, run.wait_timeout_s))
    finally:
        _controller(run, "deactivate")


STRANDED_POLL_S = 5.0
"""How often a trainer waiting for samples re-checks that something can still generate them."""


@task(name="train")
def train(run: RunRef, step: int, micro_step: int) -> MicroReport:
    """One micro-step: pull ``required_samples`` from the queue and update the policy model.

    The pull is made in slices of ``STRANDED_POLL_S``: if the last standalone replica dies while
    the trainer waits, the next slice lends the hybrids to refill the queue instead of waiting
    for samples nothing would generate.
    """
    deadline = time.monotonic() + (run.wait_timeout_s or float("inf"))
    earlier_wait_s, size_at_start = 0.0, None
    while True:
        _refill_if_stranded(run, step)
        poll = min(STRANDED_POLL_S, max(0.0, deadline - time.monotonic()))
        pending = _actor(run, TRAINER).train_micro_step.remote(poll)
        crash_point("train", step)
        report = ray.get(pending)
        if size_at_start is None:
            size_at_start = report.get("size_at_start")
        if not report.get("timed_out"):
            break
        earlier_wait_s += report["wait_s"]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"step {step}: no {run.required_samples} samples after {run.wait_timeout_s}s "
                               f"({report['mq_size']} queued)")
    if earlier_wait_s:  # one pull, as the policy sees it, spread over several slices
        report["wait_s"] += earlier_wait_s
        report["allocated_s"] = report.get("allocated_s", 0.0) + earlier_wait_s
        if size_at_start is not None:
            report["wait_samples"] = max(0, run.required_samples - size_at_start)
    return MicroReport.from_actor(report)


@task(name="broadcast_sync")
def broadcast_sync(run: RunRef, step: int, version: int) -> dict[str, Any]:
    """Trainer → standalone replicas at ``version``; closes the rollouter's staleness window."""
    timing = ray.get(_actor(run, CONTROLLER).broadcast.remote(version))
    crash_point("broadcast_sync", step)
    window = ray.get(_actor(run, ROLLOUT_SERVICE).on_weight_sync.remote(version))
    return {**timing, "window": window}


@task(name="should_activate", retries=1)
def should_activate(run: RunRef, step: int, micro: list[MicroReport]) -> bool:
    """Ask the policy whether to lend the trainer's GPUs to rollout until the next step."""
    if run.hybrid_replicas == 0:
        return False
    wanted = bool(_controller(run, "should_activate", step, build_context(run, step, micro)))
    return wanted or _standalone_lost(run)


@task(name="hybrid_sync")
def hybrid_sync(run: RunRef, step: int, version: int) -> dict[str, Any]:
    """Wake the hybrid engines and load ``version`` in-process (only on steps that activate)."""
    return dataclasses.asdict(_controller(run, "hybrid_sync", version))


@task(name="activate")
def activate(run: RunRef, step: int, micro: list[MicroReport]) -> dict[str, Any]:
    """Put the hybrids behind the load balancer; rebalance when enabled and the policy asks."""
    out: dict[str, Any] = {"activate": dataclasses.asdict(_controller(run, "activate"))}
    if _controller(run, "request_rebalance", step, build_context(run, step, micro)):
        out["rebalance"] = dataclasses.asdict(_controller(run, "rebalance"))
    return out


@task(name="update_policy")
def update_policy(run: RunRef, step: int, micro: list[MicroReport]) -> dict[str, Any]:
    """Let the policy adapt; returns its new state (what the store keeps)."""
    _controller(run, "update_policy", step, build_context(run, step, micro))
    return ray.get(_actor(run, CONTROLLER).policy_state.remote())


@task(name="commit_step")
def commit_step(run: RunRef, step: int, version: int, summary: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint the trainer, then write the step's rows in one transaction."""
    from prefect.artifacts import create_markdown_artifact

    from tasks.artifact import artifact_key, step_markdown
    from tasks.commit import commit

    result = commit(run, step, version, summary, time.time())
    create_markdown_artifact(
        key=artifact_key(run.uid, step),
        markdown=step_markdown(step, result["decisions"], result["switch_events"], summary["metrics"]),
        description=f"Tidal run {run.uid}: step {step} decisions, switches and metrics",
    )
    return result
