"""Guard rails that any policy can opt into, applied once, in one visible order, in seconds.

Owns: ``GuardedPolicy`` (bounds, then dwell; the order is in its docstring) and
``LostStandaloneGuard``. Must not: keep state of its own (its inputs are in the context, so
``state_dict`` is the wrapped policy's) or delay a deactivation.
"""

from __future__ import annotations

from typing import Any

from policies.base import DynamicScheduleContext, DynamicSchedulePolicyBase


class PolicyWrapper(DynamicSchedulePolicyBase):
    """A policy that answers every hook with ``inner``'s answer; guards override the hooks they
    change. Attributes not defined here read through; ``state_dict`` is the wrapped policy's."""

    def __init__(self, inner: DynamicSchedulePolicyBase):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not yet set (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return self.inner.should_deactivate(global_steps, is_hybrid_active, ctx)

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return self.inner.deactivate_wait_samples(ctx)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> Any:
        return self.inner.should_activate_after_step(global_steps, is_hybrid_active, ctx)

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool | None:
        return self.inner.request_rebalance(global_steps, ctx)

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        self.inner.update_after_step(global_steps, ctx)

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        return self.inner.explain(hook, global_steps, is_hybrid_active, ctx)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class GuardedPolicy(PolicyWrapper):
    """Wrap ``inner`` with the guard rails; attributes not defined here read through.

    Order, for every wrapped policy:

    1. bounds — ``deactivate_wait_samples`` is clamped to [0, step_required_samples];
    2. dwell  — no activation sooner than ``min_dwell_s`` after the last switch (``ctx.now −
       ctx.last_switch_at``).

    Deactivation is never delayed: the trainer needs its GPUs back before it trains, so a dwell can
    only hold the hybrids off, not keep them on.
    """

    def __init__(self, inner: DynamicSchedulePolicyBase, *, min_dwell_s: float = 0.0):
        if min_dwell_s < 0:
            raise ValueError(f"min_dwell_s must be >= 0, got {min_dwell_s}")
        super().__init__(inner)
        self.min_dwell_s = float(min_dwell_s)

    def dwell_remaining_s(self, ctx: DynamicScheduleContext) -> float:
        """Seconds until activation is allowed again (0 when it is)."""
        if ctx.last_switch_at is None or self.min_dwell_s <= 0:
            return 0.0
        return max(0.0, self.min_dwell_s - (ctx.now - ctx.last_switch_at))

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        wanted = self.inner.deactivate_wait_samples(ctx)
        return max(0, min(int(wanted), ctx.step_required_samples))

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> Any:
        wanted = self.inner.should_activate_after_step(global_steps, is_hybrid_active, ctx)
        return wanted if self.dwell_remaining_s(ctx) == 0.0 else False  # a count stays a count

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        reason = self.inner.explain(hook, global_steps, is_hybrid_active, ctx)
        left = self.dwell_remaining_s(ctx)
        if hook == "should_activate_after_step" and left > 0:
            reason = f"{reason}; held off by min dwell ({left:.1f}s left)".lstrip("; ")
        return reason


class LostStandaloneGuard(PolicyWrapper):
    """Wrap ``inner`` so that a run whose standalone replicas all died behaves as only-hybrid.

    When ``ctx.standalone_lost``: the hybrids are lent after every sync, and a deactivation waits
    for a whole cycle's samples (nothing else would generate while the trainer trains). Otherwise
    every answer is ``inner``'s. Stateless: ``state_dict`` is the wrapped policy's own. The
    ``Decider`` applies it to every policy, so the forced answers are recorded decisions.
    """

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        if ctx.standalone_lost:
            return ctx.step_required_samples
        return self.inner.deactivate_wait_samples(ctx)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> Any:
        wanted = self.inner.should_activate_after_step(global_steps, is_hybrid_active, ctx)
        return True if ctx.standalone_lost else wanted

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        reason = self.inner.explain(hook, global_steps, is_hybrid_active, ctx)
        if ctx.standalone_lost and hook in ("deactivate_wait_samples", "should_activate_after_step"):
            reason = f"guard: no standalone replica alive; {reason}".rstrip("; ")
        return reason
