"""The `training_step` flow: one Tidal step, phase by phase (DESIGN §2).

It drives ``loop.step_sequence`` (what happens next, from the answers so far) and maps each
intent to one task (how); the ``match`` below reads like the step's table of contents.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from flows.runners import run_phase
from loop import (
    Activate,
    BroadcastSync,
    Commit,
    HybridSync,
    ShouldActivate,
    ShouldDeactivate,
    Train,
    UpdateAfterStep,
    Skipped,
    WaitForSamples,
    step_sequence,
)
from tasks.phases import (
    activate,
    broadcast_sync,
    commit,
    hybrid_sync,
    should_activate,
    should_deactivate,
    summaries,
    train,
    update_after_step,
    wait_for_samples,
)
from tasks.run_ref import MicroReport, RunRef
from tasks.summary import step_metrics
from tasks.validation import validate


@flow(name="training-step", flow_run_name="{run.uid}-step-{step:05d}", log_prints=True, validate_parameters=False)
def training_step(run: RunRef, step: int, final: bool = False, lent: bool = True) -> dict[str, Any]:
    """One step. ``final``: the run's last step, after which nothing trains, so the policy is not
    asked to lend the trainer's GPUs (a lend would only cost a hybrid sync, an activation and two
    Prefect tasks before the run ends). ``lent``: the hybrids are lent as the step begins (what the
    controller reported at the end of the last step, ``hybrid_active`` of its result); only then is
    there a take-back question, so a step that begins with them asleep has no ``should_deactivate``."""
    started = time.time()
    micro: list[MicroReport] = []
    got: dict[type, Any] = {}  # the last result of each kind of intent
    skipped: list[tuple[str, str]] = []  # the phases the step said it skipped, with why
    val = run_phase(validate, run, step, True) if step == 1 and run.val_before_train else {}
    phases = step_sequence(step, micro_steps=run.trigger_parameter_sync_step, final=final,
                           has_hybrids=run.hybrid_replicas > 0, overlap_sync=run.overlap_hybrid_sync, lent=lent)
    result: Any = None
    while (intent := _next(phases, result)) is not None:
        match intent:
            case ShouldDeactivate(step=n):
                result = run_phase(should_deactivate, run, n)
            case WaitForSamples(plan=plan):
                result = run_phase(wait_for_samples, run, plan)
            case Train(step=n, micro=i):
                result = run_phase(train, run, n, i)
                if result.samples:
                    micro.append(result)
            case BroadcastSync(step=n, version=version, lend=plan):
                result = run_phase(broadcast_sync, run, n, version, plan)
            case ShouldActivate(step=n):
                result = run_phase(should_activate, run, n, summaries(micro))
            case HybridSync(plan=plan, version=version):
                result = run_phase(hybrid_sync, run, plan, version)
            case Activate(plan=plan):
                result = run_phase(activate, run, plan, summaries(micro))
            case UpdateAfterStep(step=n):
                result = run_phase(update_after_step, run, n, summaries(micro))
            case Skipped(phase=phase, why=why):
                skipped.append((phase, why))
                result = None
            case Commit(step=n, version=version):
                if run.test_freq > 0 and n % run.test_freq == 0:
                    val.update(run_phase(validate, run, n))
                result = _commit(run, n, version, started, micro, got, val, final, tuple(skipped))
        got[type(intent)] = result
    return {**result, "exhausted": any(m.exhausted for m in micro) or len(micro) < run.trigger_parameter_sync_step}


def _next(phases: Any, result: Any) -> Any:
    """The next intent of the step, given the last one's result (None when the step is done)."""
    try:
        return phases.send(result)
    except StopIteration:
        return None


def _commit(run: RunRef, step: int, version: int, started: float, micro: list[MicroReport],
            got: dict[type, Any], val: dict[str, float], final: bool,
            skipped: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The step's metrics (with the step's validation, if any) from the phases' reports, and the
    phases it skipped with why (for the step's artifact), then the commit task (``final``: the
    run's last step, kept and exported whatever ``save_freq`` says)."""
    activation = got.get(Activate)
    metrics = step_metrics(run, micro=micro, wait=got.get(WaitForSamples), sync=got[BroadcastSync],
                           activation=activation, hybrid=got.get(HybridSync), step_s=time.time() - started,
                           version=version) | val
    consumed = [p for m in micro for p in m.prompts]
    summary = {"started_at": started, "outcome": got[UpdateAfterStep], "metrics": metrics, "prompts": consumed,
               "consumed_total": run.consumed_before + len(consumed), "final": final, "skipped": skipped}
    committed = run_phase(commit, run, step, version, summary)
    return {**committed, "metrics": metrics, "hybrid_active": got[UpdateAfterStep].hybrid_active, "trained": len(consumed)}
