"""Fold one step's phase results into the metrics the store keeps and the artifact shows (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from metrics import (
    MQ_SIZE,
    RESOURCE_UTILIZATION,
    ROLLOUT_RESOURCE_UTILIZATION,
    STEP_S,
    TRAIN_ALLOCATED_TIME_S,
    TRAIN_COMPUTE_TIME_S,
    TRAIN_RESOURCE_UTILIZATION,
    WAIT_FOR_ENOUGH_SAMPLES_S,
    WASTE_SWITCH_S,
    aggregate_cycle,
    cluster_resource_utilization,
    train_resource_utilization,
)
from loop.decisions import step_switch_seconds
from loop.plans import BroadcastReport, SwitchReport, WaitReport
from tasks.run_ref import MicroReport, RunRef


def step_metrics(
    run: RunRef,
    *,
    micro: list[MicroReport],
    wait: WaitReport | None,
    sync: BroadcastReport,
    activation: Sequence[SwitchReport] | None,
    hybrid: SwitchReport | None,
    step_s: float,
    version: int,
) -> dict[str, float]:
    """The step's metrics under the reference's names (plus Tidal's own)."""
    per_micro = [
        {(k if "/" in k else f"train/{k}"): v for k, v in m.metrics.items()}  # verl's names stay
        | {f"timing_s/{k}": v for k, v in m.timing_s.items()}
        | {MQ_SIZE: float(m.mq_size), "timing_s/wait_for_samples_in_train": m.wait_s}
        for m in micro
    ]
    out = aggregate_cycle(per_micro) if per_micro else {}
    # a hybrid sync of its own task is on the critical path; one that ran during the broadcast is
    # inside ``sync.broadcast_s`` already (``dynamic_schedule_overlap_hybrid_sync``)
    exposed_s = (hybrid.duration_s if hybrid else 0.0) + sum(part.duration_s for part in activation or ())
    switch_s = step_switch_seconds([wait.deactivate if wait else None, hybrid, sync.hybrid, *(activation or ()),
                                    *(s for m in micro for s in m.refills)])
    compute = [m.compute_s for m in micro]
    allocated = [m.allocated_s for m in micro]
    if allocated:  # the reference counts param sync and activation inside the training turn
        allocated[-1] += sync.broadcast_s + exposed_s
    u_train = train_resource_utilization(compute, allocated) if compute else 0.0
    wait_s = wait.waited_s if wait else 0.0
    u_rollout = sync.window.get(ROLLOUT_RESOURCE_UTILIZATION, 0.0)
    out.update(sync.window)
    out.update({
        TRAIN_COMPUTE_TIME_S: sum(compute),
        TRAIN_ALLOCATED_TIME_S: sum(allocated),
        TRAIN_RESOURCE_UTILIZATION: u_train,
        WAIT_FOR_ENOUGH_SAMPLES_S: wait_s,
        STEP_S: step_s,
        RESOURCE_UTILIZATION: cluster_resource_utilization(
            u_train, u_rollout, wait_s, step_s, run.trainer_gpus, run.standalone_gpus
        ),
        WASTE_SWITCH_S: switch_s,
        "timing_s/param_sync": sync.broadcast_s,
        f"weight_sync/{sync.transport}/seconds": sync.broadcast_s,
        f"weight_sync/{sync.transport}/gb": sync.sent_bytes / 1e9,
        f"weight_sync/{sync.transport}/retries": float(sync.retries),
        "fully_async/param_version": float(version),
        "fully_async/trained_samples": float(sum(m.samples for m in micro)),
        "fully_async/max_staleness": float(max((version - 1 - lo for lo, _ in _versions(micro)), default=0)),
        "dynamic_resource/hybrid_active": 1.0 if activation else 0.0,
    })
    if micro:
        out[MQ_SIZE] = float(micro[-1].mq_size)
    return out


def _versions(micro: list[MicroReport]) -> list[tuple[int, int]]:
    return [v for m in micro for v in m.versions]
