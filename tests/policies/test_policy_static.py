"""`static_fully_async`: plain fully-async, and classic colocated mode when only-hybrid.

Contexts: required_samples=16, trigger_parameter_sync_step=4 → 64 samples per cycle.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from policy_driver import run_steps

from policies import DynamicScheduleContext, StaticFullyAsyncPolicy, build_policy

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)


@pytest.mark.parametrize("active", [True, False])
def test_should_deactivate_answers_whether_the_hybrid_is_active(active: bool) -> None:
    assert build_policy("static_fully_async").should_deactivate(2, active, CTX) is active


def test_deactivation_does_not_wait_for_any_sample() -> None:
    policy = build_policy("static_fully_async", deactivate_ratio=0.7)
    assert isinstance(policy, StaticFullyAsyncPolicy)
    assert policy.deactivate_wait_samples(CTX) == 0
    assert policy.deactivate_wait_samples(replace(CTX, mq_size=0, total_generated_samples=5)) == 0


@pytest.mark.parametrize("generated", [0, 64, 1000])
def test_the_trainer_gpus_are_never_lent(generated: int) -> None:
    # even with nothing generated for 64 consumed samples (a huge gap)
    ctx = replace(CTX, total_generated_samples=generated, expected_samples=64)
    policy = build_policy("static_fully_async")
    assert policy.should_activate_after_step(1, False, ctx) is False


def test_request_rebalance_is_falsy() -> None:
    assert not build_policy("static_fully_async").request_rebalance(1, CTX)


def test_update_after_step_changes_nothing() -> None:
    policy = build_policy("static_fully_async")
    before = policy.state_dict()
    policy.update_after_step(1, replace(CTX, step_wait_samples=[8] * 4, step_wait_times=[1.0] * 4,
                                        last_activate_duration_s=2.0))
    assert policy.state_dict() == before


def test_only_hybrid_reactivates_after_every_sync_and_waits_for_the_whole_cycle() -> None:
    policy = build_policy("static_fully_async", only_hybrid=True)
    assert policy.deactivate_wait_samples(CTX) == 64  # step_required_samples = 16 × 4
    # a backlog of 100 samples changes nothing: colocated mode always hands the GPUs back
    backlog = replace(CTX, total_generated_samples=164, expected_samples=64)
    assert policy.should_activate_after_step(1, False, backlog) is True
    # three steps as the controller drives them: activate after step 1's sync, then each step
    # takes the GPUs back once the whole cycle (64) is buffered and lends them again after the sync
    events, state = run_steps(policy, [replace(CTX, now=60.0 * k) for k in (1, 2, 3)])
    assert events == [
        ("activate", 1, None),
        ("deactivate", 2, 64),
        ("activate", 2, None),
        ("deactivate", 3, 64),
        ("activate", 3, None),
    ]
    assert state.active is True
