"""`predictive` on hand-computed contexts: it lends only when a measured lend wins, k of m.

Every context: required_samples=16, trigger_parameter_sync_step=4 (64 samples per cycle), one
standalone replica, a staleness cap of 16 samples. A no-lend cycle takes 60 s of which the trainer
waits ``wait`` s, so the prior gain of lending k hybrids is wait × k / (1 + k) and the prior
T[k] = 60 − wait·k/(1+k) + 6 s (the assumed switch seconds before one is measured): with a 30 s
wait, T[1] = 51 s and T[2] = 46 s.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from policies import DynamicScheduleContext, PredictiveDynamicSchedulePolicy, build_policy

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4, standalone_replicas=1,
                             max_required_samples=16)


def drive(policy, cycles, *, hybrids=1, wait=30.0, start_step=1, start_now=0.0, active=False):
    """Per step: ask the lend question, then ``update_after_step`` with what was lent (the
    cycle's seconds come from ``cycles``). Returns the answers and where the clock stopped."""
    answers, now = [], start_now
    for step, cycle_s in enumerate(cycles, start=start_step):
        now += cycle_s
        ctx = replace(CTX, now=now, hybrid_replicas=hybrids, step_wait_times=[wait])
        answer = policy.should_activate_after_step(step, active, ctx)
        answers.append(answer)
        lent = hybrids if answer is True else int(answer)
        policy.update_after_step(step, replace(ctx, lent_replicas=lent))
    return answers, now


def test_a_training_bound_run_never_lends_because_no_wait_can_pay_for_the_switch():
    policy = build_policy("predictive")

    answers, _ = drive(policy, [60.0] * 40, wait=0.0)

    assert answers == [0] * 40
    assert policy.effect == {}


def test_a_rollout_bound_run_probes_when_the_prior_wins_and_keeps_lending_after_a_measured_win():
    # steps 1-4: no-lend cycles of 60 s (the first only starts the clock); the prior T[1] = 51 s
    # beats T0 = 60 s, so steps 5 and 6 lend (the probe) and step 7 does not (its closing cycle);
    # the probe's three cycles take 50 s each: effect (150 − 180) / 2 lends = −15 s, spread 0 → a
    # measured win, so step 8 lends again
    policy = PredictiveDynamicSchedulePolicy()

    answers, _ = drive(policy, [60.0] * 4 + [50.0] * 4)

    assert answers == [0, 0, 0, 0, True, True, 0, True]
    assert policy.lending == 1
    assert policy.effect == {"1": {"n": 2, "mean": -15.0, "var": 0.0, "step": 7}}


def test_a_probe_that_loses_backs_off_and_the_next_probe_tries_fewer_of_the_hybrids():
    # two hybrids: T[2] = 46 s beats T[1] = 51 s by the prior: steps 5-6 lend both; those cycles
    # take 70 s: effect (210 − 180) / 2 = +15 s → lost, next probe at 7 + 1 + 24 = 32; then
    # T[2] = 75 s is measured (25 steps ago, still remembered) and the unmeasured T[1] = 51 s
    # beats T0 = 60 s: step 32 lends 1 of the 2
    policy = PredictiveDynamicSchedulePolicy()

    answers, _ = drive(policy, [60.0] * 4 + [70.0] * 3 + [60.0] * 25, hybrids=2)

    assert answers == [0] * 4 + [True, True] + [0] * 25 + [1]
    assert policy.next_probe_step == 32
    assert policy.backoff == 48
    assert policy.effect == {"2": {"n": 2, "mean": 15.0, "var": 0.0, "step": 7}}


def test_a_measured_win_that_turns_into_a_loss_stops_the_lending():
    policy = PredictiveDynamicSchedulePolicy()
    answers, now = drive(policy, [60.0] * 4 + [50.0] * 4)
    assert answers[-1] is True

    # cycle 8 (0→1) is a transition; lending cycles of 66 s then fold +6 s into the effect's mean
    # (−15 over 2): −8, −3.8, −0.86, +1.198 → after the fourth the mean loses, step 13 does not lend
    later, _ = drive(policy, [66.0] * 5, start_step=9, start_now=now, active=True)

    assert later == [True, True, True, True, 0]
    assert policy.lending == 0


def test_the_explanation_gives_the_predicted_times_behind_the_answer():
    policy = PredictiveDynamicSchedulePolicy()
    _, now = drive(policy, [60.0] * 4, hybrids=2)
    ctx = replace(CTX, now=now, hybrid_replicas=2)

    reason = policy.explain("should_activate_after_step", 5, False, ctx)

    assert reason == ("T0 60.0±0.0s; T[1] 51.0±0.0s prior, T[2] 46.0±0.0s prior → lend 2 (probe, 2 lends left); "
                      "in flight 0 + queued 0 of cap 16")


def test_the_deactivation_waits_for_the_samples_the_trainer_would_have_waited_for():
    # 64 samples × 30 s wait / 60 s cycle = 32, but never above the staleness cap
    policy = PredictiveDynamicSchedulePolicy()
    drive(policy, [60.0] * 4)

    assert policy.deactivate_wait_samples(replace(CTX, max_required_samples=96)) == 32
    assert policy.deactivate_wait_samples(CTX) == 16


def test_only_hybrid_mode_lends_every_hybrid_after_every_sync_and_waits_for_a_whole_cycle():
    policy = build_policy("predictive", only_hybrid=True)
    ctx = replace(CTX, hybrid_replicas=3)

    assert (policy.should_activate_after_step(1, False, ctx), policy.deactivate_wait_samples(ctx)) == (True, 64)


@pytest.mark.parametrize("cut", [3, 5, 6, 7, 9])
def test_a_state_round_trip_mid_run_reproduces_every_later_decision(cut):
    cycles = [60.0] * 4 + [50.0] * 4 + [55.0, 58.0, 66.0, 70.0, 61.0] + [60.0] * 20
    whole = PredictiveDynamicSchedulePolicy()
    expected, _ = drive(whole, cycles, hybrids=2)

    first = PredictiveDynamicSchedulePolicy()
    head, now = drive(first, cycles[:cut], hybrids=2)
    restored = PredictiveDynamicSchedulePolicy()
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail, _ = drive(restored, cycles[cut:], hybrids=2, start_step=cut + 1, start_now=now,
                    active=bool(head[-1]))

    assert head + tail == expected
    assert restored.state_dict() == whole.state_dict()


def test_a_long_lending_run_pauses_two_steps_every_48_lends_to_measure_the_no_lend_cycle_again():
    # the win is measured at step 7; steps 8-55 lend (48 lends), 56-57 pause, 58 lends again
    policy = PredictiveDynamicSchedulePolicy()

    answers, _ = drive(policy, [60.0] * 4 + [50.0] * 51 + [60.0] * 3)

    assert answers == [0] * 4 + [True, True, 0] + [True] * 48 + [0, 0, True]
    assert policy.base["n"] == 4
