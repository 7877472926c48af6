"""`fixed_ratio`: `default` without adaptation, and activation is a pure gap check.

Contexts: required_samples=16, trigger_parameter_sync_step=4 → 64 samples per cycle.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies import DynamicScheduleContext, FixedRatioDynamicSchedulePolicy, build_policy

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)


def with_surplus(surplus: int, **fields: object) -> DynamicScheduleContext:
    return replace(CTX, total_generated_samples=64 + surplus, expected_samples=64, **fields)


def test_fixed_ratio_is_registered_by_default_and_waits_for_its_share_of_a_cycle() -> None:
    policy = build_policy("fixed_ratio", deactivate_ratio=0.6)
    assert isinstance(policy, FixedRatioDynamicSchedulePolicy)
    # 64 × 0.6 = 38.4 → 38
    assert policy.deactivate_wait_samples(CTX) == 38


@pytest.mark.parametrize("active", [True, False])
def test_should_deactivate_answers_whether_the_hybrid_is_active(active: bool) -> None:
    assert build_policy("fixed_ratio", deactivate_ratio=0.5).should_deactivate(2, active, CTX) is active


def test_a_one_sample_gap_activates_even_when_it_is_worth_less_than_a_switch() -> None:
    # per-sample = 0.01 s / 1 sample; gap = 0.5 × 64 − 31 = 1 → 0.01 s, far below the 10 s switch cost
    ctx = with_surplus(31, step_wait_times=[0.01], step_wait_samples=[1])
    assert build_policy("fixed_ratio", deactivate_ratio=0.5).should_activate_after_step(3, False, ctx) is True
    # the same context does not pass default's cost/benefit gate
    assert build_policy("default", deactivate_ratio=0.5).should_activate_after_step(3, False, ctx) is False


@pytest.mark.parametrize("surplus", [32, 33, 200])
def test_no_activation_once_the_backlog_reaches_the_ratio(surplus: int) -> None:
    # gap = 32 − surplus ≤ 0
    policy = build_policy("fixed_ratio", deactivate_ratio=0.5)
    assert policy.should_activate_after_step(3, False, with_surplus(surplus)) is False


def test_update_after_step_never_changes_anything() -> None:
    policy = build_policy("fixed_ratio", deactivate_ratio=0.5)
    before = policy.state_dict()
    contexts = [
        replace(CTX, step_wait_samples=[16, 16, 16, 16], step_wait_times=[9.0] * 4),  # default: +0.1
        replace(CTX, last_activate_duration_s=3.0, last_deactivate_duration_s=4.0),  # default: −0.02
        CTX,
    ]
    for step, ctx in enumerate(contexts, start=1):
        policy.update_after_step(step, ctx)
    assert policy.state_dict() == before
    assert policy.deactivate_ratio == 0.5
    assert policy.deactivate_wait_samples(CTX) == 32  # 64 × 0.5


def test_only_hybrid_forces_the_whole_cycle_and_always_activates() -> None:
    policy = build_policy("fixed_ratio", deactivate_ratio=0.2, only_hybrid=True)
    assert policy.deactivate_ratio == 1.0
    assert policy.deactivate_wait_samples(CTX) == 64
    # gap = 64 − 1000 < 0, activates anyway
    assert policy.should_activate_after_step(7, False, with_surplus(1000)) is True


def test_request_rebalance_asks_the_controller_to_rebalance() -> None:
    assert build_policy("fixed_ratio").request_rebalance(1, CTX)
