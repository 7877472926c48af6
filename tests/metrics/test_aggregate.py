"""Per-cycle aggregation rules and the cycle's utilization metrics."""

from __future__ import annotations

import pytest

from metrics import (
    MQ_SIZE,
    RESOURCE_UTILIZATION,
    ROLLOUT_RESOURCE_UTILIZATION,
    STEP_GENERATED_SAMPLES,
    STEP_GENERATED_TOKENS,
    STEP_S,
    TRAIN_ALLOCATED_TIME_S,
    TRAIN_COMPUTE_TIME_S,
    TRAIN_RESOURCE_UTILIZATION,
    WAIT_FOR_ENOUGH_SAMPLES_S,
    WASTE_ABORTED_TOKENS,
    WASTE_SWITCH_S,
    Rule,
    aggregate_cycle,
    cycle_utilizations,
    rule_for,
)


def test_metric_names_use_the_reference_prefixes() -> None:
    assert TRAIN_COMPUTE_TIME_S == "dynamic_resource/train_compute_time_s"
    assert TRAIN_ALLOCATED_TIME_S == "dynamic_resource/train_allocated_time_s"
    assert MQ_SIZE == "dynamic_resource/mq_size"
    assert TRAIN_RESOURCE_UTILIZATION == "dynamic_resource/train_resource_utilization"
    assert ROLLOUT_RESOURCE_UTILIZATION == "dynamic_resource/rollout_resource_utilization"
    assert RESOURCE_UTILIZATION == "dynamic_resource/resource_utilization"
    assert WAIT_FOR_ENOUGH_SAMPLES_S == "timing_s/wait_for_enough_samples"
    assert STEP_S == "timing_s/step"
    assert STEP_GENERATED_SAMPLES == "fully_async/rollouter/step_generated_samples"


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        (TRAIN_COMPUTE_TIME_S, Rule.SUM),
        (TRAIN_ALLOCATED_TIME_S, Rule.SUM),
        (MQ_SIZE, Rule.LAST),
        (STEP_GENERATED_SAMPLES, Rule.LAST),
        (STEP_GENERATED_TOKENS, Rule.LAST),
        (STEP_S, Rule.SUM),
        ("timing_s/update_actor", Rule.SUM),
        (WASTE_ABORTED_TOKENS, Rule.SUM),
        ("waste/anything_new", Rule.SUM),
        ("actor/entropy", Rule.MEAN),
        ("dynamic_resource/something_else", Rule.MEAN),
        # a prefix only matches at the start of the name
        ("actor/timing_s/x", Rule.MEAN),
    ],
)
def test_each_name_gets_the_rule_of_the_table(name, rule) -> None:
    assert rule_for(name) is rule


def test_extra_rules_take_precedence_over_exact_and_prefix_rules() -> None:
    extra = {MQ_SIZE: Rule.MAX, "timing_s/step": Rule.MEAN}
    assert rule_for(MQ_SIZE, extra) is Rule.MAX
    assert rule_for(STEP_S, extra) is Rule.MEAN
    assert rule_for(TRAIN_COMPUTE_TIME_S, extra) is Rule.SUM


def test_aggregate_cycle_sums_times_and_waste_takes_last_snapshots_and_averages_the_rest() -> None:
    micro_steps = [
        {TRAIN_COMPUTE_TIME_S: 1.0, STEP_S: 4.0, WASTE_SWITCH_S: 0.5, MQ_SIZE: 7,
         STEP_GENERATED_SAMPLES: 10, "actor/loss": 2.0},
        {TRAIN_COMPUTE_TIME_S: 9.0, STEP_S: 6.0, WASTE_SWITCH_S: 0.25, MQ_SIZE: 3,
         STEP_GENERATED_SAMPLES: 25, "actor/loss": 4.0},
    ]
    assert aggregate_cycle(micro_steps) == {
        TRAIN_COMPUTE_TIME_S: 10.0,  # 1 + 9
        STEP_S: 10.0,  # 4 + 6
        WASTE_SWITCH_S: 0.75,  # 0.5 + 0.25
        MQ_SIZE: 3.0,  # last snapshot, not the mean 5
        STEP_GENERATED_SAMPLES: 25.0,  # last, not the sum 35
        "actor/loss": 3.0,  # mean of 2 and 4
    }


def test_names_missing_in_some_micro_steps_aggregate_over_the_steps_that_report_them() -> None:
    micro_steps = [
        {"actor/loss": 2.0, MQ_SIZE: 5, STEP_S: 1.0},
        {MQ_SIZE: 8, STEP_S: 2.0},
        {"actor/loss": 4.0},
    ]
    assert aggregate_cycle(micro_steps) == {
        "actor/loss": 3.0,  # (2 + 4) / 2, not (2 + 4) / 3 = 2
        MQ_SIZE: 8.0,  # last step that reported it
        STEP_S: 3.0,  # 1 + 2
    }


def test_a_name_seen_once_keeps_its_value_under_every_rule() -> None:
    assert aggregate_cycle([{MQ_SIZE: 4, STEP_S: 2.5, "x/y": 1.5}]) == {
        MQ_SIZE: 4.0, STEP_S: 2.5, "x/y": 1.5,
    }


def test_max_rule_applies_through_extra_rules() -> None:
    micro_steps = [{"fully_async/staleness": 1.0}, {"fully_async/staleness": 3.0},
                   {"fully_async/staleness": 2.0}]
    assert aggregate_cycle(micro_steps) == {"fully_async/staleness": 2.0}  # mean by default
    assert aggregate_cycle(micro_steps, extra_rules={"fully_async/staleness": Rule.MAX}) == {
        "fully_async/staleness": 3.0
    }


def test_aggregating_no_micro_steps_gives_an_empty_dict() -> None:
    assert aggregate_cycle([]) == {}


def test_aggregate_cycle_does_not_modify_its_input() -> None:
    micro_steps = [{STEP_S: 1.0}, {STEP_S: 2.0}]
    aggregate_cycle(micro_steps)
    assert micro_steps == [{STEP_S: 1.0}, {STEP_S: 2.0}]


def test_cycle_utilizations_compute_train_utilization_from_summed_totals() -> None:
    # micro-step ratios 1/2 and 9/10 (mean 0.7); summed totals 10/12 = 0.8333...
    aggregated = aggregate_cycle([
        {TRAIN_COMPUTE_TIME_S: 1.0, TRAIN_ALLOCATED_TIME_S: 2.0},
        {TRAIN_COMPUTE_TIME_S: 9.0, TRAIN_ALLOCATED_TIME_S: 10.0},
    ])
    out = cycle_utilizations(aggregated, rollout_history=[], window_end_t=0.0,
                             hybrid_gpus=0, standalone_gpus=0)
    assert out[TRAIN_RESOURCE_UTILIZATION] == pytest.approx(10 / 12)


def test_cycle_utilizations_combine_train_rollout_and_cluster_by_hand() -> None:
    aggregated = aggregate_cycle([
        {TRAIN_COMPUTE_TIME_S: 1.0, TRAIN_ALLOCATED_TIME_S: 2.0,
         WAIT_FOR_ENOUGH_SAMPLES_S: 1.0, STEP_S: 4.0},
        {TRAIN_COMPUTE_TIME_S: 9.0, TRAIN_ALLOCATED_TIME_S: 10.0,
         WAIT_FOR_ENOUGH_SAMPLES_S: 2.0, STEP_S: 6.0},
    ])
    # U_train   = 10 / 12 = 5/6
    # U_rollout: [0, 6) 4 of 4 -> 24 / 24; [6, 10) 0 of 4 -> 0 / 16; = 24 / 40 = 0.6
    # x = summed wait / summed step = 3 / 10 = 0.3 (the mean of per-step ratios would be 0.2917)
    # U = ((1 - 0.3) * 8 * 5/6 + (0.3 * 8 + 24) * 0.6) / 32
    #   = (4.6667 + 15.84) / 32 = 20.50667 / 32 = 0.640833...
    out = cycle_utilizations(aggregated, rollout_history=[(0.0, 4, 4), (6.0, 0, 4)],
                             window_end_t=10.0, hybrid_gpus=8, standalone_gpus=24)
    assert out == {
        TRAIN_RESOURCE_UTILIZATION: pytest.approx(5 / 6),
        ROLLOUT_RESOURCE_UTILIZATION: pytest.approx(0.6),
        RESOURCE_UTILIZATION: pytest.approx((0.7 * 8 * 5 / 6 + 26.4 * 0.6) / 32),
    }
    assert out[RESOURCE_UTILIZATION] == pytest.approx(0.6408333, abs=1e-6)


def test_cycle_utilizations_treat_missing_names_as_zero() -> None:
    # no train times -> 0; no wait/step -> x = 0 -> hybrid GPUs count as training at U_train = 0
    # rollout: [0, 10) 2 of 4 -> 0.5; U = (4 * 0 + 4 * 0.5) / 8 = 0.25
    out = cycle_utilizations({}, rollout_history=[(0.0, 2, 4)], window_end_t=10.0,
                             hybrid_gpus=4, standalone_gpus=4)
    assert out == {
        TRAIN_RESOURCE_UTILIZATION: 0.0,
        ROLLOUT_RESOURCE_UTILIZATION: pytest.approx(0.5),
        RESOURCE_UTILIZATION: pytest.approx(0.25),
    }
