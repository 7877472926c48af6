"""GuardedPolicy: bounds on the wait, a minimum dwell before re-activation, state passed through.

Contexts: required_samples=16, trigger_parameter_sync_step=4 → 64 samples per cycle.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from custom_policy_pkg.reference_style import MyDynamicSchedulePolicy

from policies import DynamicScheduleContext, GuardedPolicy, build_policy

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)
# fixed_ratio 0.5 with no backlog: gap = 32 − 0 = 32 > 0, so the inner policy wants to activate
WANTS_ACTIVATION = replace(CTX, last_switch_at=100.0)


@pytest.mark.parametrize(
    ("inner_ratio", "inner_wait", "guarded_wait"),
    [
        (1.5, 96, 64),  # 64 × 1.5 = 96 > 64 → the whole cycle
        (-0.5, -32, 0),  # 64 × −0.5 = −32 → 0
        (0.25, 16, 16),  # inside the bounds: unchanged
    ],
)
def test_bounds_clamp_the_wait_to_between_zero_and_one_cycle(
    inner_ratio: float, inner_wait: int, guarded_wait: int
) -> None:
    # the reference-style policy does not validate its ratio, so it can ask for anything
    inner = MyDynamicSchedulePolicy(deactivate_ratio=inner_ratio)
    assert inner.deactivate_wait_samples(CTX) == inner_wait
    assert GuardedPolicy(inner).deactivate_wait_samples(CTX) == guarded_wait


@pytest.mark.parametrize(
    ("now", "activates"),
    [
        (100.0, False),  # 0 s since the last switch
        (110.0, False),  # 10 s
        (129.9, False),  # 29.9 s
        (130.0, True),  # 30 s = min_dwell_s
        (500.0, True),
    ],
)
def test_dwell_blocks_activation_until_min_dwell_seconds_after_the_last_switch(now: float, activates: bool) -> None:
    guarded = GuardedPolicy(build_policy("fixed_ratio", deactivate_ratio=0.5), min_dwell_s=30.0)
    assert guarded.should_activate_after_step(3, False, replace(WANTS_ACTIVATION, now=now)) is activates


def test_dwell_does_not_apply_before_the_first_switch() -> None:
    guarded = GuardedPolicy(build_policy("fixed_ratio", deactivate_ratio=0.5), min_dwell_s=30.0)
    assert guarded.should_activate_after_step(1, False, replace(CTX, now=0.0, last_switch_at=None)) is True


def test_dwell_never_adds_an_activation_the_inner_policy_did_not_want() -> None:
    guarded = GuardedPolicy(build_policy("static_fully_async"), min_dwell_s=30.0)
    assert guarded.should_activate_after_step(3, False, replace(WANTS_ACTIVATION, now=1000.0)) is False


def test_dwell_never_blocks_deactivation() -> None:
    guarded = GuardedPolicy(build_policy("fixed_ratio", deactivate_ratio=0.5), min_dwell_s=30.0)
    just_switched = replace(WANTS_ACTIVATION, now=101.0)  # 1 s after the last switch
    assert guarded.should_deactivate(4, True, just_switched) is True
    assert guarded.deactivate_wait_samples(just_switched) == 32  # 64 × 0.5


def test_explain_mentions_the_dwell_only_while_it_holds_activation_off() -> None:
    guarded = GuardedPolicy(build_policy("fixed_ratio", deactivate_ratio=0.5), min_dwell_s=30.0)
    held = guarded.explain("should_activate_after_step", 3, False, replace(WANTS_ACTIVATION, now=110.0))
    assert "min dwell" in held
    assert "20.0s left" in held  # 30 − (110 − 100)
    free = guarded.explain("should_activate_after_step", 3, False, replace(WANTS_ACTIVATION, now=130.0))
    assert "dwell" not in free


def test_a_negative_dwell_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_dwell_s"):
        GuardedPolicy(build_policy("default"), min_dwell_s=-1.0)


def test_the_wrapper_passes_rebalance_and_attributes_through() -> None:
    inner = build_policy("default", deactivate_ratio=0.4)
    guarded = GuardedPolicy(inner, min_dwell_s=5.0)
    assert guarded.deactivate_ratio == 0.4
    assert guarded.request_rebalance(1, CTX)
    assert not GuardedPolicy(build_policy("static_fully_async")).request_rebalance(1, CTX)


def test_the_wrapper_state_is_the_inner_policys_state() -> None:
    inner = build_policy("default", deactivate_ratio=0.4)
    guarded = GuardedPolicy(inner, min_dwell_s=5.0)
    guarded.update_after_step(1, replace(CTX, step_wait_samples=[2, 1], step_wait_times=[1.0, 0.5],
                                         last_activate_duration_s=3.0))
    # 3/64 = 0.046875 → 0.446875, adapted in the inner policy
    assert inner.deactivate_ratio == pytest.approx(0.446875)
    assert guarded.state_dict() == inner.state_dict()

    other = build_policy("default", deactivate_ratio=0.9)
    GuardedPolicy(other, min_dwell_s=5.0).load_state_dict(guarded.state_dict())
    assert other.state_dict() == inner.state_dict()
