"""A policy that is never decorated: reachable only as ``custom_policy_pkg.by_path:EveryCyclePolicy``."""

from policies import DynamicScheduleContext, DynamicSchedulePolicyBase


class EveryCyclePolicy(DynamicSchedulePolicyBase):
    """Lend the trainer GPUs after every sync; take them back once a quarter cycle is buffered."""

    def __init__(self, deactivate_ratio: float = 0.25, only_hybrid: bool = False):
        self.deactivate_ratio = deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        return True
