"""Wasted-work counters: adding, and converting to and from ``waste/*`` metrics."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrics import (
    WASTE_ABORTED_REQUESTS,
    WASTE_ABORTED_TOKENS,
    WASTE_REPREFILLED_TOKENS,
    WASTE_SWITCH_S,
    WastedWork,
    aggregate_cycle,
)


def test_wasted_work_defaults_to_nothing() -> None:
    assert WastedWork().as_metrics() == {
        WASTE_ABORTED_REQUESTS: 0.0,
        WASTE_ABORTED_TOKENS: 0.0,
        WASTE_REPREFILLED_TOKENS: 0.0,
        WASTE_SWITCH_S: 0.0,
    }


def test_add_returns_a_new_object_with_field_wise_sums_and_leaves_both_operands_alone() -> None:
    a = WastedWork(aborted_requests=2, aborted_tokens=100, reprefilled_tokens=150, switch_s=1.5)
    b = WastedWork(aborted_requests=1, aborted_tokens=30, reprefilled_tokens=40, switch_s=0.25)
    total = a.add(b)
    assert total == WastedWork(aborted_requests=3, aborted_tokens=130,
                               reprefilled_tokens=190, switch_s=1.75)
    assert total is not a and total is not b
    assert a == WastedWork(2, 100, 150, 1.5)
    assert b == WastedWork(1, 30, 40, 0.25)


def test_wasted_work_is_immutable() -> None:
    w = WastedWork(aborted_tokens=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.aborted_tokens = 6  # type: ignore[misc]


def test_as_metrics_uses_the_waste_names() -> None:
    w = WastedWork(aborted_requests=2, aborted_tokens=100, reprefilled_tokens=150, switch_s=1.5)
    assert w.as_metrics() == {
        "waste/aborted_requests": 2.0,
        "waste/aborted_tokens": 100.0,
        "waste/reprefilled_tokens": 150.0,
        "waste/switch_s": 1.5,
    }


def test_from_metrics_ignores_other_names_and_counts_missing_ones_as_zero() -> None:
    w = WastedWork.from_metrics({WASTE_ABORTED_TOKENS: 12.0, "timing_s/step": 3.0})
    assert w == WastedWork(aborted_tokens=12)


def test_from_metrics_rounds_counts_that_travelled_as_floats() -> None:
    w = WastedWork.from_metrics({WASTE_REPREFILLED_TOKENS: 2.9999999999})
    assert w.reprefilled_tokens == 3
    assert isinstance(w.reprefilled_tokens, int)


@pytest.mark.parametrize(
    "field", ["aborted_requests", "aborted_tokens", "reprefilled_tokens", "switch_s"]
)
def test_negative_wasted_work_is_rejected(field) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be a finite number >= 0"):
        WastedWork(**{field: -1})


def test_summing_waste_metrics_over_a_cycle_matches_adding_the_counters() -> None:
    steps = [WastedWork(1, 10, 20, 0.5), WastedWork(0, 0, 0, 0.0), WastedWork(3, 40, 45, 2.0)]
    total = WastedWork()
    for step in steps:
        total = total.add(step)
    aggregated = aggregate_cycle([s.as_metrics() for s in steps])
    assert WastedWork.from_metrics(aggregated) == total == WastedWork(4, 50, 65, 2.5)


_count = st.integers(min_value=0, max_value=10**12)
_wasted = st.builds(
    WastedWork,
    aborted_requests=_count,
    aborted_tokens=_count,
    reprefilled_tokens=_count,
    switch_s=st.floats(min_value=0.0, max_value=1e9),
)


@given(_wasted)
def test_metrics_round_trip_gives_back_the_same_counters(w) -> None:
    assert WastedWork.from_metrics(w.as_metrics()) == w


@given(_wasted, _wasted)
def test_add_is_commutative_and_zero_is_its_identity(a, b) -> None:
    assert a.add(b) == b.add(a)
    assert a.add(WastedWork()) == a
