"""A policy whose state depends only on step numbers and sample counts (never on timing), so that
a resumed run must end in exactly the same state as an uninterrupted one."""

from __future__ import annotations

from policies import DynamicScheduleContext, DynamicSchedulePolicyBase


class StepCountingPolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio: float = 0.5, only_hybrid: bool = False):
        self.deactivate_ratio = deactivate_ratio
        self.only_hybrid = only_hybrid
        self.steps_seen: list[int] = []
        self.expected_seen: list[int] = []

    def should_deactivate(self, global_steps, is_hybrid_active, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx) -> bool:
        return global_steps % 2 == 1  # lend after odd steps only: both branches get exercised

    def request_rebalance(self, global_steps, ctx):
        return True

    def update_after_step(self, global_steps, ctx) -> None:
        self.steps_seen.append(global_steps)
        self.expected_seen.append(ctx.expected_samples)


class LendingStepCountingPolicy(StepCountingPolicy):
    """The same state, but it lends after every step: a short run still lends and takes back often."""

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx) -> bool:
        return True
