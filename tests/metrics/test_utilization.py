"""The section 4 utilization formulas, on hand-computed examples and hypothesis properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrics import (
    cluster_resource_utilization,
    rollout_resource_utilization,
    train_resource_utilization,
)

# --------------------------------------------------------------------------- train utilization


def test_train_utilization_is_the_ratio_of_summed_times_not_the_mean_of_ratios() -> None:
    # micro-step 1: 1 s compute of 2 s allocated (0.5); micro-step 2: 9 of 10 (0.9).
    # ratio of sums = (1 + 9) / (2 + 10) = 10/12 = 0.8333...; mean of ratios would be 0.7.
    u = train_resource_utilization([1.0, 9.0], [2.0, 10.0])
    assert u == pytest.approx(10 / 12)
    assert u != pytest.approx(0.7)


def test_train_utilization_of_a_single_micro_step_is_its_own_ratio() -> None:
    # 3 s compute of 4 s allocated = 0.75
    assert train_resource_utilization([3.0], [4.0]) == pytest.approx(0.75)


def test_train_utilization_is_zero_when_nothing_was_allocated() -> None:
    assert train_resource_utilization([], []) == 0.0
    assert train_resource_utilization([0.0, 0.0], [0.0, 0.0]) == 0.0
    # compute without any allocated time is still 0, not a division by zero
    assert train_resource_utilization([1.0], [0.0]) == 0.0


def test_train_utilization_is_clipped_to_one_when_compute_exceeds_allocation() -> None:
    # 3 s compute in 2 s allocated would be 1.5
    assert train_resource_utilization([3.0], [2.0]) == 1.0


def test_train_utilization_rejects_sequences_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="same length"):
        train_resource_utilization([1.0, 2.0], [3.0])


@pytest.mark.parametrize(
    ("compute", "allocated", "bad"),
    [([-1.0], [2.0], "compute_s"), ([1.0], [-2.0], "allocated_s")],
)
def test_train_utilization_rejects_negative_times(compute, allocated, bad) -> None:
    with pytest.raises(ValueError, match=rf"{bad}\[0\] must be >= 0"):
        train_resource_utilization(compute, allocated)


def test_train_utilization_rejects_nan() -> None:
    with pytest.raises(ValueError, match="finite"):
        train_resource_utilization([math.nan], [1.0])


# ------------------------------------------------------------------------- rollout utilization


def test_constant_capacity_half_used_gives_one_half() -> None:
    # [0, 10): 2 active of 4 -> used 20, weight 40 -> 0.5
    assert rollout_resource_utilization([(0.0, 2, 4)], end_t=10.0) == pytest.approx(0.5)


def test_capacity_change_mid_window_weights_each_interval_by_its_own_capacity() -> None:
    # [0, 10):  4 active of cap 4  -> used 10*4 = 40, weight 10*4  = 40
    # [10, 20): 4 active of cap 12 -> used 10*4 = 40, weight 10*12 = 120
    # U = 80 / 160 = 0.5.
    # With the end-of-window capacity (12) for the whole window it would be 80/240 = 1/3;
    # as a time-average of per-interval ratios it would be (1 + 1/3)/2 = 2/3.
    history = [(0.0, 4, 4), (10.0, 4, 12)]
    u = rollout_resource_utilization(history, end_t=20.0)
    assert u == pytest.approx(0.5)
    assert u != pytest.approx(1 / 3)
    assert u != pytest.approx(2 / 3)


def test_zero_capacity_intervals_carry_no_weight_even_with_active_tasks() -> None:
    # [0, 5):  cap 0 (placeholder before the capacity is known) -> skipped
    # [5, 10): 2 active of 4 -> used 10, weight 20
    # U = 10 / 20 = 0.5 (counting the 3 "active" of the first interval would push it above 1)
    history = [(0.0, 3, 0), (5.0, 2, 4)]
    assert rollout_resource_utilization(history, end_t=10.0) == pytest.approx(0.5)


def test_window_with_only_zero_capacity_gives_zero() -> None:
    assert rollout_resource_utilization([(0.0, 3, 0), (5.0, 0, 0)], end_t=10.0) == 0.0


def test_active_above_capacity_is_clamped_to_the_capacity() -> None:
    # [0, 5):  10 active but cap 4 -> used 5*min(4, 10) = 20, weight 20
    # [5, 10): 0 active of 4      -> used 0,                 weight 20
    # U = 20 / 40 = 0.5 (unclamped it would be 50/40, clipped to 1.0)
    history = [(0.0, 10, 4), (5.0, 0, 4)]
    assert rollout_resource_utilization(history, end_t=10.0) == pytest.approx(0.5)


def test_trailing_idle_interval_up_to_end_t_counts_as_unused_capacity() -> None:
    # [0, 6):  4 of 4 -> used 24, weight 24
    # [6, 10): 0 of 4 -> used 0,  weight 16 (the drain/idle tail closed by end_t)
    # U = 24 / 40 = 0.6 (ignoring the tail it would be 1.0)
    history = [(0.0, 4, 4), (6.0, 0, 4)]
    assert rollout_resource_utilization(history, end_t=10.0) == pytest.approx(0.6)


def test_repeated_timestamps_make_zero_length_intervals_that_count_nothing() -> None:
    # [0, 2): 1 of 4 -> used 2, weight 8
    # [2, 2): 4 of 4 -> zero length, nothing
    # [2, 4): 2 of 4 -> used 4, weight 8
    # U = 6 / 16 = 0.375
    history = [(0.0, 1, 4), (2.0, 4, 4), (2.0, 2, 4)]
    assert rollout_resource_utilization(history, end_t=4.0) == pytest.approx(0.375)


def test_window_may_close_exactly_at_the_last_change_point() -> None:
    # [0, 10): 2 of 4 -> 20 / 40; the last point (t=10) spans nothing
    history = [(0.0, 2, 4), (10.0, 4, 4)]
    assert rollout_resource_utilization(history, end_t=10.0) == pytest.approx(0.5)


def test_window_times_need_not_start_at_zero() -> None:
    # [100, 103): 3 of 6 -> used 9, weight 18; [103, 104): 6 of 6 -> used 6, weight 6
    # U = 15 / 24 = 0.625
    history = [(100.0, 3, 6), (103.0, 6, 6)]
    assert rollout_resource_utilization(history, end_t=104.0) == pytest.approx(0.625)


def test_empty_history_or_zero_length_window_gives_zero() -> None:
    assert rollout_resource_utilization([], end_t=10.0) == 0.0
    assert rollout_resource_utilization([(5.0, 2, 4)], end_t=5.0) == 0.0


def test_rollout_utilization_rejects_decreasing_times() -> None:
    with pytest.raises(ValueError, match="must not decrease"):
        rollout_resource_utilization([(0.0, 1, 4), (5.0, 1, 4), (4.0, 1, 4)], end_t=10.0)


def test_rollout_utilization_rejects_end_t_before_the_last_change_point() -> None:
    with pytest.raises(ValueError, match="before the last change point"):
        rollout_resource_utilization([(0.0, 1, 4), (5.0, 1, 4)], end_t=4.0)


@pytest.mark.parametrize("point", [(0.0, -1, 4), (0.0, 1, -4)])
def test_rollout_utilization_rejects_negative_counts(point) -> None:
    with pytest.raises(ValueError, match="counts must be >= 0"):
        rollout_resource_utilization([point], end_t=1.0)


def test_rollout_utilization_rejects_non_finite_times() -> None:
    with pytest.raises(ValueError, match="finite"):
        rollout_resource_utilization([(0.0, 1, 4)], end_t=math.inf)


# ------------------------------------------------------------------------- cluster utilization


def test_cluster_utilization_weights_each_side_by_its_gpu_time() -> None:
    # x = 3/10 = 0.3, a = 8 hybrid, b = 24 standalone
    # train side:   (1 - 0.3) * 8 * 0.8    = 4.48
    # rollout side: (0.3 * 8 + 24) * 0.6   = 26.4 * 0.6 = 15.84
    # U = (4.48 + 15.84) / 32 = 20.32 / 32 = 0.635
    u = cluster_resource_utilization(0.8, 0.6, wait_s=3.0, step_s=10.0,
                                     hybrid_gpus=8, standalone_gpus=24)
    assert u == pytest.approx(0.635)


def test_wait_longer_than_step_clips_x_to_one() -> None:
    # x = clip(15/10) = 1: all hybrid time is rollout -> (0 + (8 + 24) * 0.6) / 32 = 0.6.
    # Unclipped x = 1.5 would give (-0.5*8*0.8 + 36*0.6) / 32 = 18.4 / 32 = 0.575.
    u = cluster_resource_utilization(0.8, 0.6, wait_s=15.0, step_s=10.0,
                                     hybrid_gpus=8, standalone_gpus=24)
    assert u == pytest.approx(0.6)


def test_zero_step_time_means_hybrid_gpus_only_trained() -> None:
    # step_s = 0 -> x = 0: (8 * 0.8 + 24 * 0.6) / 32 = (6.4 + 14.4) / 32 = 0.65
    u = cluster_resource_utilization(0.8, 0.6, wait_s=5.0, step_s=0.0,
                                     hybrid_gpus=8, standalone_gpus=24)
    assert u == pytest.approx(0.65)


def test_negative_wait_clips_x_to_zero() -> None:
    # x = clip(-2/10) = 0 -> same as no wait: 0.65
    u = cluster_resource_utilization(0.8, 0.6, wait_s=-2.0, step_s=10.0,
                                     hybrid_gpus=8, standalone_gpus=24)
    assert u == pytest.approx(0.65)


def test_only_hybrid_cluster_splits_time_between_train_and_rollout() -> None:
    # b = 0, x = 5/10 = 0.5: (0.5 * 4 * 0.8 + 0.5 * 4 * 0.6) / 4 = 0.4 + 0.3 = 0.7
    u = cluster_resource_utilization(0.8, 0.6, wait_s=5.0, step_s=10.0,
                                     hybrid_gpus=4, standalone_gpus=0)
    assert u == pytest.approx(0.7)


def test_no_hybrid_gpus_gives_the_rollout_utilization() -> None:
    # a = 0: (0 + 16 * 0.6) / 16 = 0.6, whatever x is
    u = cluster_resource_utilization(0.8, 0.6, wait_s=5.0, step_s=10.0,
                                     hybrid_gpus=0, standalone_gpus=16)
    assert u == pytest.approx(0.6)


def test_cluster_without_gpus_gives_zero() -> None:
    assert cluster_resource_utilization(0.8, 0.6, 5.0, 10.0, 0, 0) == 0.0


@pytest.mark.parametrize(("a", "b"), [(-1, 4), (4, -1)])
def test_cluster_utilization_rejects_negative_gpu_counts(a, b) -> None:
    with pytest.raises(ValueError, match="GPU counts must be >= 0"):
        cluster_resource_utilization(0.5, 0.5, 1.0, 2.0, a, b)


@pytest.mark.parametrize(("u_train", "u_rollout"), [(1.5, 0.5), (0.5, -0.1), (math.nan, 0.5)])
def test_cluster_utilization_rejects_utilizations_outside_the_unit_interval(
    u_train, u_rollout
) -> None:
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        cluster_resource_utilization(u_train, u_rollout, 1.0, 2.0, 4, 4)


# ---------------------------------------------------------------------- hypothesis properties

_times = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
_counts = st.integers(min_value=0, max_value=10_000)
_unit = st.floats(min_value=0.0, max_value=1.0)


@given(st.lists(st.tuples(_times, _times), max_size=30))
def test_train_utilization_always_lies_in_the_unit_interval(pairs) -> None:
    compute = [c for c, _ in pairs]
    allocated = [a for _, a in pairs]
    assert 0.0 <= train_resource_utilization(compute, allocated) <= 1.0


@st.composite
def _histories(draw):
    """A valid history: non-decreasing times from some start, and an end_t after the last one."""
    t = draw(st.floats(min_value=-1e6, max_value=1e6))
    history = []
    for _ in range(draw(st.integers(min_value=0, max_value=30))):
        history.append((t, draw(_counts), draw(_counts)))
        t += draw(st.floats(min_value=0.0, max_value=1e4))
    return history, t + draw(st.floats(min_value=0.0, max_value=1e4))


@given(_histories())
def test_rollout_utilization_always_lies_in_the_unit_interval(drawn) -> None:
    history, end_t = drawn
    assert 0.0 <= rollout_resource_utilization(history, end_t) <= 1.0


@given(_histories())
def test_rollout_utilization_is_full_exactly_when_capacity_time_exists_and_is_saturated(
    drawn,
) -> None:
    history, end_t = drawn
    saturated = [(t, cap + active, cap) for t, active, cap in history]
    ends = [t for t, _, _ in history[1:]] + [end_t]
    has_weight = any(cap > 0 and t_next > t for (t, _, cap), t_next in zip(history, ends))
    u = rollout_resource_utilization(saturated, end_t)
    assert u == (pytest.approx(1.0) if has_weight else 0.0)


@given(_histories(), st.integers(min_value=0, max_value=29), st.integers(min_value=1, max_value=50))
def test_raising_one_active_count_never_lowers_rollout_utilization(drawn, index, extra) -> None:
    history, end_t = drawn
    if not history:
        return
    k = index % len(history)
    t, active, cap = history[k]
    busier = [*history[:k], (t, active + extra, cap), *history[k + 1 :]]
    before = rollout_resource_utilization(history, end_t)
    assert rollout_resource_utilization(busier, end_t) >= before - 1e-12


@given(
    _unit,
    _unit,
    st.floats(min_value=-1e6, max_value=1e6),
    st.floats(min_value=-1e6, max_value=1e6),
    st.integers(min_value=0, max_value=1000),
    st.integers(min_value=0, max_value=1000),
)
def test_cluster_utilization_lies_between_the_train_and_rollout_utilizations(
    u_train, u_rollout, wait_s, step_s, a, b
) -> None:
    u = cluster_resource_utilization(u_train, u_rollout, wait_s, step_s, a, b)
    assert 0.0 <= u <= 1.0
    if a + b > 0:
        lo, hi = min(u_train, u_rollout), max(u_train, u_rollout)
        assert lo - 1e-12 <= u <= hi + 1e-12
