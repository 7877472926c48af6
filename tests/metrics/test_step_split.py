"""`metrics.step_split`: a step's time in train / wait / switch / sync / other, the steps with the
hybrid lent, and the scalars a tracker logs."""

from __future__ import annotations

import math

from metrics import LendingGain, StepSplit, lending_gain, lent_steps, step_split, tracked_scalars


def test_a_step_splits_into_parts_that_add_up_to_its_time():
    split = step_split({"timing_s/step": 10.0, "dynamic_resource/train_compute_time_s": 4.0,
                        "timing_s/wait_for_enough_samples": 2.0, "timing_s/wait_for_samples_in_train": 0.5,
                        "waste/switch_s": 1.5, "timing_s/param_sync": 0.25})
    assert split == StepSplit(train=4.0, wait=2.5, switch=1.5, sync=0.25, other=1.75)
    assert split.total == 10.0


def test_missing_or_nan_parts_count_as_zero_and_other_is_never_negative():
    assert step_split({"timing_s/step": 1.0, "dynamic_resource/train_compute_time_s": 2.0,
                       "waste/switch_s": math.nan}) == StepSplit(train=2.0, wait=0.0, switch=0.0, sync=0.0, other=0.0)
    assert step_split({}) == StepSplit(0.0, 0.0, 0.0, 0.0, 0.0)


def test_a_step_is_lent_when_the_step_before_it_ended_with_the_hybrid_active():
    rows = [{"step": n, "hybrid_active_after": n in (2, 3, 6)} for n in range(1, 8)]
    assert lent_steps(rows) == [3, 4, 7]
    assert lent_steps([]) == []


def test_trackers_get_the_finite_numbers_in_name_order():
    assert tracked_scalars({"b": 2, "a": 1.5, "nan": math.nan, "inf": math.inf, "none": None, "flag": True,
                            "text": "x"}) == {"a": 1.5, "b": 2.0}
    assert list(tracked_scalars({"b": 2, "a": 1.5})) == ["a", "b"]


def _row(step, wait, switch=0.0, active_after=False, step_s=None, other=0.0):
    # a step of 1 s training + its wait, switch and ``other`` (control plane) seconds
    return {"step": step, "timing_s/step": step_s or 1.0 + wait + switch + other,
            "dynamic_resource/train_compute_time_s": 1.0, "timing_s/wait_for_enough_samples": wait,
            "waste/switch_s": switch, "hybrid_active_after": active_after}


def test_what_lending_bought_is_the_idle_time_lent_steps_did_not_have_less_every_switch():
    # step 1 (start-up) is left out; steps 2 and 6 without a lend wait 2 s; the hybrids lent after
    # step 2 (switch 0.5 s) and kept through step 4; steps 3-5 are lent, wait 0.5 s and pay 0.25 s
    # more of control plane; the take-back in step 5 costs 0.25 s
    rows = [_row(1, 9.0), _row(2, 2.0, 0.5, True), _row(3, 0.5, 0.0, True, other=0.25),
            _row(4, 0.5, 0.0, True, other=0.25), _row(5, 0.5, 0.25, other=0.25), _row(6, 2.0)]
    gain = lending_gain(rows)
    assert gain == LendingGain(steps=6, lent=3, lent_idle_s=0.75, unlent_idle_s=2.0, switch_s=0.75)
    assert gain.bought_s == 3 * 1.25 - 0.75
    assert gain.sentence().endswith("lending bought ≈ 3.0 s (estimated from this run's steps)")
    assert "lent on 3 of 6 steps: a lent step waited and ran control-plane tasks 0.75 s against 2.00 s" in (
        gain.sentence())


def test_lending_that_cost_more_than_it_saved_says_so_and_no_comparison_without_both_kinds_of_step():
    costly = lending_gain([_row(1, 0.1), _row(2, 0.1, 2.0, True), _row(3, 0.1), _row(4, 0.1)])
    assert costly.bought_s < 0 and "lending cost ≈ 2.0 s" in costly.sentence()
    assert lending_gain([_row(1, 1.0), _row(2, 1.0)]) is None  # never lent
    assert lending_gain([_row(1, 1.0, 0.1, True), _row(2, 1.0)]) is None  # only the start-up step is without
    assert lending_gain([]) is None
