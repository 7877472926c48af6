"""Fold one step's phase results into the metrics the store keeps and the artifact shows (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from metrics import MQ_SIZE, fold_step
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
    """The step's metrics under the reference's names (plus Tidal's own): ``metrics.fold_step``,
    the twin's rule too, over the phases' reports; then what production alone measures."""
    per_micro = [
        {(k if "/" in k else f"train/{k}"): v for k, v in m.metrics.items()}  # verl's names stay
        | {f"timing_s/{k}": v for k, v in m.timing_s.items()}
        | {MQ_SIZE: float(m.mq_size), "timing_s/wait_for_samples_in_train": m.wait_s}
        for m in micro
    ]
    # a hybrid sync of its own task is on the critical path; one that ran during the broadcast is
    # inside ``sync.broadcast_s`` already (``dynamic_schedule_overlap_hybrid_sync``)
    exposed_s = (hybrid.duration_s if hybrid else 0.0) + sum(part.duration_s for part in activation or ())
    taken_back = wait.deactivate if wait else None
    out = fold_step(
        per_micro, compute_s=[m.compute_s for m in micro], allocated_s=[m.allocated_s for m in micro],
        deactivate_s=taken_back.duration_s if taken_back else 0.0, after_train_s=sync.broadcast_s + exposed_s,
        wait_s=wait.waited_s if wait else 0.0, step_s=step_s, window=sync.window,
        switch_s=step_switch_seconds([taken_back, hybrid, sync.hybrid, *(activation or ()),
                                      *(s for m in micro for s in m.refills)]),
        trainer_gpus=run.trainer_gpus, standalone_gpus=run.standalone_gpus)
    out.update({
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
