"""A recording fake of the controller's per-step hook sequence, shared by the policy tests.

Per step it calls the hooks in the base class's order and records what a controller would do:
``("deactivate", step, wait_samples)`` and ``("activate", step, request_rebalance(...))``.
Each scripted context's ``now`` is when that step's weight sync finished; the deactivation
questions are asked ``TRAIN_S`` earlier, before training. The controller's own memory (is the
hybrid active, when was the last switch) lives in ``ControllerState``, apart from the policy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from policies import DynamicScheduleContext, DynamicSchedulePolicyBase

TRAIN_S = 20.0
"""Seconds between the deactivation questions (before training) and the weight sync."""


@dataclass
class ControllerState:
    active: bool = False
    last_switch_at: float | None = None


def run_steps(
    policy: DynamicSchedulePolicyBase,
    contexts: Sequence[DynamicScheduleContext],
    *,
    first_step: int = 1,
    state: ControllerState | None = None,
) -> tuple[list[tuple[str, int, object]], ControllerState]:
    state = replace(state) if state is not None else ControllerState()
    events: list[tuple[str, int, object]] = []
    for step, ctx in enumerate(contexts, start=first_step):
        before = replace(ctx, now=ctx.now - TRAIN_S, last_switch_at=state.last_switch_at)
        if policy.should_deactivate(step, state.active, before):
            events.append(("deactivate", step, policy.deactivate_wait_samples(before)))
            state.active, state.last_switch_at = False, before.now
        after = replace(ctx, last_switch_at=state.last_switch_at)
        if policy.should_activate_after_step(step, state.active, after):
            events.append(("activate", step, policy.request_rebalance(step, after)))
            state.active, state.last_switch_at = True, after.now
        policy.update_after_step(step, after)
    return events, state
