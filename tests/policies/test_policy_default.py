"""`default`: adaptive ratio, clamped to [0, 1], and the cost/benefit gate on activation.

Every context here has required_samples=16 and trigger_parameter_sync_step=4, so one cycle is
step_required_samples = 16 × 4 = 64 samples.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies import DefaultDynamicSchedulePolicy, DynamicScheduleContext, build_policy

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)
CONSUMED = 128  # the trainer has consumed two cycles; generated − CONSUMED is the surplus


def with_surplus(surplus: int, **fields: object) -> DynamicScheduleContext:
    return replace(CTX, total_generated_samples=CONSUMED + surplus, expected_samples=CONSUMED, **fields)


def waited(samples: list[int], seconds: list[float] | None = None, **fields: object) -> DynamicScheduleContext:
    """A context whose cycle really waited for ``samples`` (one second per micro-step unless given)."""
    times = seconds if seconds is not None else [1.0] * len(samples)
    return replace(CTX, step_wait_samples=samples, step_wait_times=times, **fields)


# --------------------------------------------------------------------------- construction


def test_a_fresh_policy_keeps_the_configured_ratio_and_waits_for_that_share_of_a_cycle() -> None:
    policy = build_policy("default", deactivate_ratio=0.6, only_hybrid=False)
    assert isinstance(policy, DefaultDynamicSchedulePolicy)
    assert policy.deactivate_ratio == 0.6
    # 16 × 4 × 0.6 = 38.4 → int → 38
    assert policy.deactivate_wait_samples(CTX) == 38


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_a_ratio_outside_zero_to_one_is_rejected(ratio: float) -> None:
    with pytest.raises(ValueError, match="deactivate_ratio"):
        build_policy("default", deactivate_ratio=ratio)


@pytest.mark.parametrize("active", [True, False])
def test_should_deactivate_answers_whether_the_hybrid_is_active(active: bool) -> None:
    policy = build_policy("default", deactivate_ratio=0.3)
    assert policy.should_deactivate(5, active, with_surplus(1000)) is active


def test_request_rebalance_asks_the_controller_to_rebalance() -> None:
    assert build_policy("default").request_rebalance(3, CTX)


# --------------------------------------------------------------------------- ratio adaptation


@pytest.mark.parametrize(
    ("wait_samples", "ratio_after"),
    [
        # 1/64 = 0.015625 < 0.02 → +0.02: 0.3 + 0.02 = 0.32
        ([1, 0, 0, 0], 0.32),
        # (2+1)/64 = 0.046875, inside [0.02, 0.1] → 0.3 + 0.046875 = 0.346875
        ([2, 1, 0, 0], 0.346875),
        # (4+4+2)/64 = 0.15625 > 0.1 → +0.1: 0.3 + 0.1 = 0.4
        ([4, 4, 2, 0], 0.4),
    ],
)
def test_real_waits_raise_the_ratio_by_the_clipped_shortfall_fraction(
    wait_samples: list[int], ratio_after: float
) -> None:
    policy = build_policy("default", deactivate_ratio=0.3)
    policy.update_after_step(1, waited(wait_samples))
    assert policy.deactivate_ratio == pytest.approx(ratio_after)


def test_the_raise_counts_waited_samples_even_when_the_measured_wait_time_is_zero() -> None:
    policy = build_policy("default", deactivate_ratio=0.3)
    # 3/64 = 0.046875 → 0.346875; the ratio is keyed off samples, not seconds
    policy.update_after_step(1, waited([3, 0, 0, 0], seconds=[0.0, 0.0, 0.0, 0.0]))
    assert policy.deactivate_ratio == pytest.approx(0.346875)


@pytest.mark.parametrize(
    ("samples", "seconds"),
    [
        ([], []),  # no micro-step reported anything
        ([0, 0, 0, 0], [0.3, 0.0, 0.0, 0.0]),  # time spent, but every sample was already queued
    ],
)
def test_a_cycle_without_real_waits_lowers_the_ratio_by_two_hundredths(
    samples: list[int], seconds: list[float]
) -> None:
    policy = build_policy("default", deactivate_ratio=0.3)
    policy.update_after_step(1, waited(samples, seconds))
    # 0.3 − 0.02 = 0.28
    assert policy.deactivate_ratio == pytest.approx(0.28)


def test_the_ratio_is_clamped_to_one_at_the_top() -> None:
    policy = build_policy("default", deactivate_ratio=0.95)
    policy.update_after_step(1, waited([10, 0, 0, 0]))  # 0.95 + 0.1 = 1.05 → 1.0
    assert policy.deactivate_ratio == 1.0
    policy.update_after_step(2, waited([1, 0, 0, 0]))  # 1.0 + 0.02 = 1.02 → 1.0
    assert policy.deactivate_ratio == 1.0
    # the whole cycle: 64 × 1.0 = 64
    assert policy.deactivate_wait_samples(CTX) == 64


def test_the_ratio_is_clamped_to_zero_at_the_bottom_unlike_the_reference() -> None:
    policy = build_policy("default", deactivate_ratio=0.03)
    policy.update_after_step(1, CTX)  # 0.03 − 0.02 = 0.01
    assert policy.deactivate_ratio == pytest.approx(0.01)
    policy.update_after_step(2, CTX)  # 0.01 − 0.02 = −0.01 → 0.0 (the reference would keep −0.01)
    assert policy.deactivate_ratio == 0.0
    policy.update_after_step(3, CTX)  # still 0.0
    assert policy.deactivate_ratio == 0.0
    assert policy.deactivate_wait_samples(CTX) == 0
    # gap = 0 × 64 − 0 = 0 → nothing missing, no activation
    assert policy.should_activate_after_step(4, False, with_surplus(0)) is False


@pytest.mark.parametrize("global_steps", [0, -1])
def test_update_before_the_first_real_step_changes_nothing(global_steps: int) -> None:
    policy = build_policy("default", deactivate_ratio=0.3)
    before = policy.state_dict()
    ctx = waited([8, 8, 8, 8], last_activate_duration_s=3.0, last_deactivate_duration_s=2.0)
    policy.update_after_step(global_steps, ctx)
    assert policy.state_dict() == before
    assert policy.deactivate_ratio == 0.3


# --------------------------------------------------------------------------- only-hybrid


def test_only_hybrid_forces_the_whole_cycle_always_activates_and_never_adapts() -> None:
    policy = build_policy("default", deactivate_ratio=0.3, only_hybrid=True)
    assert policy.deactivate_ratio == 1.0
    assert policy.deactivate_wait_samples(CTX) == 64  # 64 × 1.0
    # a backlog of 500 makes the gap 64 − 500 < 0, yet colocated mode re-activates every sync
    assert policy.should_activate_after_step(3, False, with_surplus(500)) is True
    before = policy.state_dict()
    policy.update_after_step(3, waited([8, 8, 8, 8], last_activate_duration_s=4.0))
    policy.update_after_step(4, CTX)
    assert policy.state_dict() == before
    assert policy.deactivate_ratio == 1.0


# --------------------------------------------------------------------------- activation gate


@pytest.mark.parametrize("surplus", [16, 17, 40])
def test_no_activation_without_a_positive_gap(surplus: int) -> None:
    policy = build_policy("default", deactivate_ratio=0.25)
    # gap = 0.25 × 64 − surplus = 16 − surplus ≤ 0
    assert policy.should_activate_after_step(2, False, with_surplus(surplus)) is False


def test_the_pessimistic_prior_activates_on_a_one_sample_gap_before_any_signal() -> None:
    policy = build_policy("default", deactivate_ratio=0.25)
    # gap = 16 − 15 = 1; 1 sample × 1000 s = 1000 s > 10 s default switch cost
    assert policy.should_activate_after_step(1, False, with_surplus(15)) is True


@pytest.mark.parametrize(
    ("surplus", "activates"),
    [
        # per-sample = (3.0 + 1.0) s / (2 + 6) samples = 0.5 s (a mean of ratios would be 0.83 s)
        # gap = 0.5 × 64 − 31 = 1  → 1 × 0.5 = 0.5 s ≤ 10 s: positive gap, still not worth it
        (31, False),
        # gap = 32 − 12 = 20 → 20 × 0.5 = 10.0 s, not > 10 s
        (12, False),
        # gap = 32 − 11 = 21 → 21 × 0.5 = 10.5 s > 10 s
        (11, True),
    ],
)
def test_a_positive_gap_activates_only_when_its_time_value_exceeds_the_switch_cost(
    surplus: int, activates: bool
) -> None:
    policy = build_policy("default", deactivate_ratio=0.5)
    ctx = with_surplus(surplus, step_wait_times=[3.0, 1.0], step_wait_samples=[2, 6])
    assert policy.should_activate_after_step(4, False, ctx) is activates


def test_the_per_sample_estimate_is_remembered_and_reused_on_a_cycle_without_signal() -> None:
    policy = build_policy("default", deactivate_ratio=0.5)
    # per-sample = 4.0 s / 8 samples = 0.5 s; 8/64 = 0.125 → +0.1 → ratio 0.6, threshold 38.4
    policy.update_after_step(1, waited([2, 6], seconds=[3.0, 1.0]))
    assert policy.deactivate_ratio == pytest.approx(0.6)
    # no wait signal now: the remembered 0.5 s is used
    # gap = 38.4 − 18 = 20.4 → 10.2 s > 10 s
    assert policy.should_activate_after_step(2, False, with_surplus(18)) is True
    # gap = 38.4 − 19 = 19.4 → 9.7 s ≤ 10 s
    assert policy.should_activate_after_step(2, False, with_surplus(19)) is False
    # a fresh policy at the same ratio still holds the 1000 s prior: 19.4 × 1000 s > 10 s
    fresh = build_policy("default", deactivate_ratio=0.6)
    assert fresh.should_activate_after_step(2, False, with_surplus(19)) is True


def test_the_current_cycles_signal_beats_the_remembered_estimate() -> None:
    policy = build_policy("default", deactivate_ratio=0.5)
    policy.update_after_step(1, waited([2, 6], seconds=[3.0, 1.0]))  # remembers 0.5 s; ratio 0.6
    # this cycle: 4.0 s / 2 samples = 2.0 s per sample; gap = 38.4 − 34 = 4.4 → 8.8 s ≤ 10 s
    # (with the remembered 0.5 s it would be 2.2 s: same answer; so also check the other side)
    assert policy.should_activate_after_step(2, False, with_surplus(34, step_wait_times=[4.0],
                                                                    step_wait_samples=[2])) is False
    # gap = 38.4 − 33 = 5.4 → 5.4 × 2.0 = 10.8 s > 10 s (the remembered 0.5 s would give 2.7 s)
    assert policy.should_activate_after_step(2, False, with_surplus(33, step_wait_times=[4.0],
                                                                    step_wait_samples=[2])) is True


def test_the_switch_cost_prior_decides_whether_an_unmeasured_lend_pays_until_one_is_measured() -> None:
    signal = {"step_wait_times": [1.0], "step_wait_samples": [4]}  # 0.25 s per sample
    ctx = with_surplus(20, **signal)  # gap 0.5 × 64 − 20 = 12 → 3 s
    assert build_policy("default", deactivate_ratio=0.5).should_activate_after_step(1, False, ctx) is False  # 10 s
    primed = build_policy("default", deactivate_ratio=0.5, prior_switch_s=1.0)
    assert primed.should_activate_after_step(1, False, ctx) is True  # 3 s > 1 s
    primed.update_after_step(1, replace(CTX, last_activate_duration_s=2.0, last_deactivate_duration_s=2.0))
    assert primed.switch_cost_s() == 4.0  # the measurement replaces the prior
    assert primed.state_dict()["prior_switch_s"] == 1.0
    with pytest.raises(ValueError, match="prior_switch_s"):
        build_policy("default", prior_switch_s=0.0)


def test_switch_cost_is_the_mean_of_the_last_three_measured_switches() -> None:
    policy = build_policy("default", deactivate_ratio=0.5)
    assert policy.switch_cost_s() == 10.0  # nothing measured yet
    # none of these cycles waited, so the ratio falls by 0.02 per update
    policy.update_after_step(1, replace(CTX, last_activate_duration_s=2.0, last_deactivate_duration_s=4.0))
    assert policy.switch_cost_s() == 6.0  # [6]; ratio 0.48
    policy.update_after_step(2, replace(CTX, last_activate_duration_s=1.0, last_deactivate_duration_s=2.0))
    assert policy.switch_cost_s() == 4.5  # [6, 3] → 4.5; ratio 0.46
    policy.update_after_step(3, CTX)
    assert policy.switch_cost_s() == 4.5  # zero overhead is not a measurement (else [6, 3, 0] → 3); ratio 0.44
    policy.update_after_step(4, replace(CTX, last_activate_duration_s=5.0, last_deactivate_duration_s=4.0))
    assert policy.switch_cost_s() == 6.0  # [6, 3, 9] → 6; ratio 0.42

    signal = {"step_wait_times": [1.0], "step_wait_samples": [2]}  # 0.5 s per sample
    # threshold 0.42 × 64 = 26.88; gap = 26.88 − 12 = 14.88 → 7.44 s > 6 s
    assert policy.should_activate_after_step(5, False, with_surplus(12, **signal)) is True

    policy.update_after_step(5, replace(CTX, last_activate_duration_s=6.0, last_deactivate_duration_s=6.0))
    assert policy.switch_cost_s() == 8.0  # window slides: [3, 9, 12] → 8 (all four would be 7.5)
    # threshold 0.40 × 64 = 25.6; gap = 25.6 − 10 = 15.6 → 7.8 s ≤ 8 s (but > 7.5 s)
    assert policy.should_activate_after_step(6, False, with_surplus(10, **signal)) is False
    # gap = 25.6 − 9 = 16.6 → 8.3 s > 8 s
    assert policy.should_activate_after_step(6, False, with_surplus(9, **signal)) is True


def test_asking_questions_leaves_the_policy_state_untouched() -> None:
    policy = build_policy("default", deactivate_ratio=0.5)
    before = policy.state_dict()
    ctx = with_surplus(3, step_wait_times=[2.0], step_wait_samples=[4], last_activate_duration_s=5.0)
    policy.should_deactivate(2, True, ctx)
    policy.deactivate_wait_samples(ctx)
    policy.should_activate_after_step(2, False, ctx)
    policy.request_rebalance(2, ctx)
    for hook in ("should_deactivate", "deactivate_wait_samples", "should_activate_after_step", "update_after_step"):
        policy.explain(hook, 2, False, ctx)
    assert policy.state_dict() == before


def test_repeated_steps_do_not_let_float_drift_cost_a_sample() -> None:
    policy = build_policy("default", deactivate_ratio=0.6)
    for step in range(1, 6):
        policy.update_after_step(step, CTX)  # no waits: −0.02 each
    # 0.6 − 5 × 0.02 = 0.5 → 64 × 0.5 = 32 (unrounded float arithmetic gives 0.4999999999999999 → 31)
    assert policy.deactivate_ratio == 0.5
    assert policy.deactivate_wait_samples(CTX) == 32
    # gap = 32 − 32 = 0 → no activation
    assert policy.should_activate_after_step(6, False, with_surplus(32)) is False
