"""`metrics.step_split`: a step's time in train / wait / switch / sync / other, the steps with the
hybrid lent, and the scalars a tracker logs."""

from __future__ import annotations

import math

from metrics import StepSplit, lent_steps, step_split, tracked_scalars


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
