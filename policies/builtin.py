"""The three built-in policies: `default`, `fixed_ratio`, `static_fully_async`.

They follow the reference's section 3 with DESIGN §5's deliberate differences:
the adaptive ratio is clamped to [0, 1] both ways; `fixed_ratio` is registered; in only-hybrid
mode every built-in forces the ratio to 1.0 and re-activates after every sync; and the
per-sample-time estimate is refreshed in ``update_after_step`` (the reference refreshes it inside
the activation question, and only on steps whose gap check got that far).
"""

from __future__ import annotations

from policies.base import DynamicScheduleContext, DynamicSchedulePolicyBase
from policies.registry import register_policy

DEFAULT_SWITCH_COST_S = 10.0
"""`default`'s assumed activate + deactivate cost before any switch has been measured (the
reference's constant; ``prior_switch_s`` overrides it)."""
SWITCH_COST_WINDOW = 3
"""Switch cost = mean of the last this-many measured activate + deactivate durations."""
RATIO_INCREASE_MIN = 0.02
RATIO_INCREASE_MAX = 0.1
RATIO_DECREASE_STEP = 0.02
INITIAL_PER_SAMPLE_TIME_S = 1000.0
"""Deliberately pessimistic prior: biases towards activation until a real wait is measured."""


def check_ratio(ratio: float) -> float:
    """``ratio`` as a float, or ValueError unless it is in [0, 1] (every built-in's deactivate ratio)."""
    ratio = float(ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"deactivate_ratio must be in [0, 1], got {ratio}")
    return ratio


def _wait_signal(ctx: DynamicScheduleContext) -> tuple[float, int]:
    return float(sum(ctx.step_wait_times)), int(sum(ctx.step_wait_samples))


class _GapPolicy(DynamicSchedulePolicyBase):
    """Shared by `default` and `fixed_ratio`: deactivate whenever active, wait for a ratio of the
    cycle's samples, and activate only while the backlog is below that ratio (the "gap")."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False):
        self.deactivate_ratio = 1.0 if only_hybrid else check_ratio(deactivate_ratio)
        self.only_hybrid = bool(only_hybrid)

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def gap(self, ctx: DynamicScheduleContext) -> float:
        """Samples still missing to reach the deactivation threshold: ratio × cycle − backlog."""
        return self.deactivate_ratio * ctx.step_required_samples - ctx.surplus

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        return True

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        if hook == "should_deactivate":
            return "hybrid active: take it back before training" if is_hybrid_active else "hybrid already off"
        if hook == "deactivate_wait_samples":
            return f"ratio {self.deactivate_ratio:.3f} × {ctx.step_required_samples} samples"
        if hook == "should_activate_after_step":
            if self.only_hybrid:
                return "only-hybrid: always re-activate"
            return f"gap {self.gap(ctx):.1f} = {self.deactivate_ratio:.3f}×{ctx.step_required_samples} − backlog {ctx.surplus}"
        return ""


@register_policy("fixed_ratio")
class FixedRatioDynamicSchedulePolicy(_GapPolicy):
    """`default` without adaptation: the ratio never changes and activation is a pure gap check."""

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        return self.only_hybrid or self.gap(ctx) > 0


@register_policy("default")
class DefaultDynamicSchedulePolicy(_GapPolicy):
    """Adaptive ratio and a cost/benefit gate on activation.

    After each step: if any sample really had to be waited for, the ratio rises by
    clip(wait_samples / step_required_samples, 0.02, 0.1) (rollout is the bottleneck: take the
    GPUs back later); otherwise it falls by 0.02 (training is the bottleneck). Clamped to [0, 1].

    Activation needs a positive gap and gap × per-sample time > switch cost, where the switch
    cost is the mean of the last 3 measured activate + deactivate durations (``prior_switch_s``
    before any: the reference's 10 s) and the per-sample time is this cycle's wait seconds / wait
    samples, else the last such estimate, else a pessimistic 1000 s.
    """

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False,
                 prior_switch_s: float = DEFAULT_SWITCH_COST_S):
        super().__init__(deactivate_ratio, only_hybrid)
        if not prior_switch_s > 0:
            raise ValueError(f"prior_switch_s: must be > 0 (got {prior_switch_s})")
        self.prior_switch_s = float(prior_switch_s)
        self.recent_switch_costs_s: list[float] = []
        self.per_sample_time_s: float = INITIAL_PER_SAMPLE_TIME_S
        self.last_ratio_delta: float = 0.0

    def switch_cost_s(self) -> float:
        recent = self.recent_switch_costs_s[-SWITCH_COST_WINDOW:]
        return sum(recent) / len(recent) if recent else self.prior_switch_s

    def estimate_per_sample_time_s(self, ctx: DynamicScheduleContext) -> float:
        wait_s, wait_samples = _wait_signal(ctx)
        if wait_s > 0 and wait_samples > 0:
            return wait_s / wait_samples
        return self.per_sample_time_s

    def expected_benefit_s(self, ctx: DynamicScheduleContext) -> float:
        return max(0.0, self.gap(ctx)) * self.estimate_per_sample_time_s(ctx)

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        if self.only_hybrid:
            return True
        if self.gap(ctx) <= 0:
            return False
        return self.expected_benefit_s(ctx) - self.switch_cost_s() > 0

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        if global_steps <= 0 or self.only_hybrid:
            return
        overhead = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        if overhead > 0:
            self.recent_switch_costs_s = [*self.recent_switch_costs_s, overhead][-SWITCH_COST_WINDOW:]
        self.per_sample_time_s = self.estimate_per_sample_time_s(ctx)
        _, wait_samples = _wait_signal(ctx)
        if wait_samples > 0:
            cycle = ctx.step_required_samples
            raw = wait_samples / cycle if cycle > 0 else RATIO_INCREASE_MAX
            delta = min(RATIO_INCREASE_MAX, max(RATIO_INCREASE_MIN, raw))
        else:
            delta = -RATIO_DECREASE_STEP
        self.last_ratio_delta = delta
        # rounded so float drift cannot cost a sample: 0.6 − 5 × 0.02 would otherwise be
        # 0.4999999999999999, and int(64 × that) = 31 instead of 32
        self.deactivate_ratio = round(min(1.0, max(0.0, self.deactivate_ratio + delta)), 12)

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        if hook == "should_activate_after_step" and not self.only_hybrid:
            gap = self.gap(ctx)
            if gap <= 0:
                return f"no gap: backlog {ctx.surplus} ≥ {self.deactivate_ratio:.3f}×{ctx.step_required_samples}"
            per = self.estimate_per_sample_time_s(ctx)
            return (
                f"gap {gap:.1f} × {per:.3g}s/sample = {gap * per:.3g}s vs switch cost "
                f"{self.switch_cost_s():.3g}s"
            )
        if hook == "update_after_step":
            wait_s, wait_samples = _wait_signal(ctx)
            return f"waited {wait_samples} samples / {wait_s:.2f}s → ratio {self.deactivate_ratio:.3f}"
        return super().explain(hook, global_steps, is_hybrid_active, ctx)


@register_policy("static_fully_async")
class StaticFullyAsyncPolicy(DynamicSchedulePolicyBase):
    """Plain fully-async: trainer GPUs always train; hybrids are taken back at once and never lent.

    Only-hybrid (colocated) mode: hybrids are re-activated after every sync and the trainer
    waits for a whole cycle's samples before taking its GPUs back.
    """

    def __init__(self, deactivate_ratio: float = 0.0, only_hybrid: bool = False):
        self.deactivate_ratio = 1.0 if only_hybrid else check_ratio(deactivate_ratio)
        self.only_hybrid = bool(only_hybrid)

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return ctx.step_required_samples if self.only_hybrid else 0

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        return self.only_hybrid

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        return None

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        if hook == "should_activate_after_step":
            return "only-hybrid: always re-activate" if self.only_hybrid else "static: never lend trainer GPUs"
        return ""
