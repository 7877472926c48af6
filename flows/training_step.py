"""The `training_step` flow: one Tidal step, phase by phase (DESIGN §2). Reads like its table of contents."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from flows.runners import run_phase
from tasks.phases import (
    activate,
    broadcast_sync,
    commit_step,
    hybrid_sync,
    should_activate,
    should_deactivate,
    train,
    update_policy,
    wait_for_samples,
)
from tasks.run_ref import RunRef
from tasks.summary import step_metrics
from tasks.validation import validate


@flow(name="training-step", flow_run_name="step-{step:05d}", log_prints=True, validate_parameters=False)
def training_step(run: RunRef, step: int, final: bool = False) -> dict[str, Any]:
    """One step. ``final``: the run's last step, after which nothing trains, so the policy is not
    asked to lend the trainer's GPUs (a lend would only cost a hybrid sync, an activation and three
    Prefect tasks before the run ends)."""
    started = time.time()
    wait = activation = hybrid = None
    val = run_phase(validate, run, step, True) if step == 1 and run.val_before_train else {}
    decision = run_phase(should_deactivate, run, step)
    if decision["deactivate"]:
        wait = run_phase(wait_for_samples, run, step, decision["wait_samples"])
    micro = [run_phase(train, run, step, i) for i in range(run.trigger_parameter_sync_step)]
    micro = [m for m in micro if m.samples]
    version = step  # the weights after step N are param version N
    sync = run_phase(broadcast_sync, run, step, version)
    if not final and run_phase(should_activate, run, step, micro):
        hybrid = run_phase(hybrid_sync, run, step, version)
        activation = run_phase(activate, run, step, micro)
    policy_state = run_phase(update_policy, run, step, micro)
    if run.test_freq > 0 and step % run.test_freq == 0:
        val.update(run_phase(validate, run, step))
    metrics = step_metrics(run, micro=micro, wait=wait, sync=sync, activation=activation, hybrid=hybrid,
                           step_s=time.time() - started, version=version) | val
    consumed = [p for m in micro for p in m.prompts]
    summary = {"started_at": started, "policy_state": policy_state, "metrics": metrics, "prompts": consumed,
               "consumed_total": run.consumed_before + len(consumed)}
    commit = run_phase(commit_step, run, step, version, summary)
    return {**commit, "metrics": metrics, "hybrid_active": activation is not None, "trained": len(consumed),
            "exhausted": any(m.exhausted for m in micro) or len(micro) < run.trigger_parameter_sync_step}
