"""`predictive` on hand-computed contexts: it lends k of m only when its cycle model says it wins.

Every context: required_samples=16, trigger_parameter_sync_step=4 (N = 64 samples per cycle), one
standalone replica with 8 samples in flight, nothing queued, a staleness cap of 96 samples: the
headroom is 96 − 8 − 0 = 88, so k hybrids add ρ_k = min(k / 1, 88 / 8) = k times the
standalone's generation. A no-lend cycle takes 60 s of which the trainer waits ``wait`` s; the
switch seconds are 6 until measured. The cycles ending at steps 1 and 2 are the start-up's (not
measured) and five no-lend cycles are measured before a lend (steps 3-7): the first lend is asked
at step 8. A sample's latency is L = 8 × 60 / 64 = 7.5 s (Little's law), no more than the lend
windows here unless a test says so, so ρ_k counts whole. The predicted gain of lending k is
ρ_k (W − C) / (1 + ρ_k), and a lend needs gain > 1 standard error + 2 % of T0 (1.2 s here).
"""

from __future__ import annotations

import math

import json
from dataclasses import replace

import pytest

from policies import DynamicScheduleContext, PredictiveDynamicSchedulePolicy, build_policy
from policies import predictive
from policies.predictive import hybrid_share

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4, standalone_replicas=1,
                             max_required_samples=96, in_flight_samples=8)


def measuring(**kw):
    """``predictive`` with neither clear wins nor probes: every lend waits for the cycle model."""
    return PredictiveDynamicSchedulePolicy(clear_gain=1e9, probes=False, **kw)


SWITCH = {k: (2.0, 1.0) for k in range(1, 5)}
"""k lent → (activation s, take-back s)."""


def drive(policy, cycles, *, hybrids=1, wait=30.0, waited=0, switch=SWITCH, ctx=CTX, start_step=1,
          start_now=0.0, lent_before=0):
    """Per step: ask the lend question, then ``update_after_step`` with what was lent. A lend's
    activation (``switch[k][0]`` s) is reported in the cycle that lends, its take-back
    (``switch[k][1]`` s) in the next one, as the controller reports them. Returns the answers and
    where the clock stopped."""
    answers, now, before = [], start_now, lent_before
    for step, cycle_s in enumerate(cycles, start=start_step):
        now += cycle_s
        asked = replace(ctx, now=now, hybrid_replicas=hybrids, step_wait_times=[wait], step_wait_samples=[waited])
        answer = policy.should_activate_after_step(step, False, asked)
        answers.append(answer)
        lent = hybrids if answer is True else int(answer)
        policy.update_after_step(step, replace(asked, lent_replicas=lent,
                                               last_activate_duration_s=switch[lent][0] if lent else 0.0,
                                               last_deactivate_duration_s=switch[before][1] if before else 0.0))
        before = lent
    return answers, now


def test_a_training_bound_run_never_lends_because_no_wait_can_pay_for_the_switch():
    policy = build_policy("predictive")

    answers, _ = drive(policy, [60.0] * 40, wait=5.0)  # W 5 s < C 6 s: the gain is negative

    assert answers == [0] * 40
    # no switch measured: each half of C is the prior's 3 s, known no better than its own size
    assert policy.predictions(41, replace(CTX, hybrid_replicas=1)) == {0: (60.0, 0.0), 1: (60.5, 0.5 * math.hypot(3.0, 3.0))}


def test_a_rollout_bound_run_lends_once_five_no_lend_cycles_are_measured():
    # the first cycle only starts the clock, the second is the start-up's; after steps 3-7,
    # T0 = 60 s and W = 30 s; step 8's gain with one hybrid: ρ 1 (window (30 − 6) / 2 = 12 s ≥ L)
    # → (30 − 6) / 2 = 12 s > 1.2 s; steps 9 and 10 are lent at both ends (50 s each), so after
    # step 10 it pauses three steps (the take-back cycle and two no-lend cycles, 60 s each) to
    # measure what the streak gave: 60 − 50 = 10 s. From then on the measured switch (1 + 2 = 3 s
    # per lend cycle) makes the model's T[1] 60 − (30 − 3) / 2 = 46.5 s, but the streak is
    # believed over the model: T[1] = 50 s, still a win, so step 14 lends again
    policy = measuring()

    answers, now = drive(policy, [60.0] * 8 + [50.0] * 2 + [60.0] * 3)

    assert answers == [0] * 7 + [True] * 3 + [0] * 3
    assert policy.base["n"] == 7
    assert policy.realized_gain_s(14) == 10.0
    ctx = replace(CTX, now=now, hybrid_replicas=1)
    assert policy.predictions(14, ctx) == {0: (60.0, 0.0), 1: (50.0, 0.0)}
    assert policy.should_activate_after_step(14, False, ctx) is True


def test_a_streak_that_measures_slower_than_the_cycles_around_it_stops_the_lending():
    # the same run, but the lent cycles take 62 s: the streak lost 2 s a cycle against the
    # no-lend cycles before and after it, so the model's 13.5 s win is not believed
    policy = measuring()

    answers, _ = drive(policy, [60.0] * 8 + [62.0] * 2 + [60.0] * 3 + [60.0] * 5)

    assert answers == [0] * 7 + [True] * 3 + [0] * 8
    assert policy.realized_gain_s(19) == -2.0


def test_a_drift_between_the_cycles_before_and_after_a_streak_cancels():
    # the no-lend cycles fall from 60 s to 40 s while the streak runs at 50 s: a trend measured
    # before the streak would call it a 10 s win; the cycles on both sides (60, 60 and 40, 40 s)
    # say it gave nothing
    policy = measuring()

    drive(policy, [60.0] * 8 + [50.0] * 2 + [40.0] * 3)

    assert policy.realized_gain_s(14) == 0.0


def test_no_staleness_headroom_means_no_lend_however_long_the_trainer_waits():
    # 8 in flight + 88 queued of a cap of 96: no sample can start on a lent hybrid
    full = replace(CTX, mq_size=88)
    policy = measuring()

    answers, _ = drive(policy, [60.0] * 20, hybrids=2, wait=50.0, ctx=full)

    assert answers == [0] * 20
    assert hybrid_share(2, full) == 0.0


def test_the_headroom_bounds_what_more_hybrids_add():
    # two standalones with 32 in flight, 8 queued, cap 64: headroom 24 → ρ_k = min(k/2, 24/32)
    ctx = replace(CTX, standalone_replicas=2, in_flight_samples=32, mq_size=8, max_required_samples=64)

    assert [hybrid_share(k, ctx) for k in range(5)] == [0.0, 0.5, 0.75, 0.75, 0.75]


def test_it_lends_k_of_m_when_lending_more_costs_more_switch_seconds_than_it_adds():
    # steps 1-13 with one hybrid: it lends from step 8, C_1 = 2 + 1 = 3 s, and pauses after step
    # 10 to measure its streak. A second hybrid comes back at step 14; C_2 is unmeasured, so it is
    # the any-k one (3 s): the model's gain for two is 18 s, but the streak measured 13.5 s (as fast
    # as the model says for one), which caps it for both; a tie goes to the larger k, so step 14
    # lends both. That activation takes 16 s: C_2 =
    # 16 + 1 (any-k take-back) = 17 s, a window of 13 / 3 s of L 7.5 s: ρ 1.16, T[2] = 53.0 s >
    # T[1] = 46.5 s: step 13 lends 1 of 2; its take-back of the two takes 11 s, so C_2 = 27 s: a
    # 1 s window, ρ 2 / 7.5 and T[2] = 60 − (ρ / (1 + ρ)) × 3 = 59.4 s from then on
    policy = measuring()
    head, now = drive(policy, [60.0] * 8 + [46.5] * 2 + [60.0] * 3)
    tail, _ = drive(policy, [46.5] * 4, hybrids=2, switch={**SWITCH, 2: (16.0, 11.0)}, start_step=14,
                    start_now=now)

    assert (head, tail) == ([0] * 7 + [True] * 3 + [0] * 3, [True, 1, 1, 1])
    ctx = replace(CTX, hybrid_replicas=2)
    rho = 2 / 7.5
    assert {k: t for k, (t, _) in policy.predictions(16, ctx).items()} == pytest.approx(
        {0: 60.0, 1: 46.5, 2: 60.0 - rho / (1 + rho) * 3.0})


def test_the_explanation_gives_the_predicted_times_behind_the_answer():
    policy = measuring()
    _, now = drive(policy, [60.0] * 7, hybrids=2)
    ctx = replace(CTX, now=now, hybrid_replicas=2)

    reason = policy.explain("should_activate_after_step", 8, False, ctx)

    # ρ_1 = 1 → gain 12 s; ρ_2 = 2 (window 24 / 3 = 8 s ≥ L 7.5 s) → (2/3) × 24 = 16 s
    assert reason == ("T0 60.0±0.0s, W 30.0s, C 6.0s, L 7.5s; T[1] 48.0±2.1s, T[2] 44.0±2.8s → lend 2 (predicted win); "
                      "in flight 8 + queued 0 of cap 96")


def test_the_deactivation_queue_starts_from_the_model_and_adapts_to_the_waits_after_the_take_back():
    # model: 1 − (C/2 + busy × (m−1)/m) / T0 = 1 − (3 + 30 × 3/4) / 60 = 0.575 → round(36.8) = 37
    policy = measuring()
    drive(policy, [60.0] * 7)
    assert policy.deactivate_wait_samples(CTX) == 37

    # a lend cycle after which the trainer still waited for 4 samples: up by half the waited share
    # (clipped to [0.01, 0.25]), 0.5 × 4/64 = 0.03125; C is 3 s by then, so the model's start is
    # 1 − (1.5 + 22.5)/60 = 0.6, + 0.03125 = 0.63125 (steps 8 and 9 lend; step 9's cycle began
    # with a take-back)
    drive(policy, [60.0] * 2, waited=4, start_step=8, start_now=420.0)
    assert (policy.ratio, policy.deactivate_wait_samples(CTX)) == (0.63125, 40)

    # two more cycles that began with a take-back and saw no wait: − 0.02 each (step 11 no longer
    # lends: two lend cycles measured 60 s, no win); never above the staleness cap
    drive(policy, [60.0] * 2, start_step=10, start_now=540.0, lent_before=1)
    assert policy.ratio == 0.59125
    assert policy.deactivate_wait_samples(replace(CTX, max_required_samples=24)) == 24


def test_only_hybrid_mode_lends_every_hybrid_after_every_sync_and_waits_for_a_whole_cycle():
    policy = build_policy("predictive", only_hybrid=True)
    ctx = replace(CTX, hybrid_replicas=3)

    assert (policy.should_activate_after_step(1, False, ctx), policy.deactivate_wait_samples(ctx)) == (True, 64)


@pytest.mark.parametrize("cut", [3, 6, 8, 9, 10, 12, 30])
def test_a_state_round_trip_mid_run_reproduces_every_later_decision(cut):
    cycles = [60.0, 61.0, 58.0, 62.0, 59.0, 61.0, 60.0] + [50.0, 52.0, 49.0, 55.0, 58.0, 66.0, 70.0, 61.0] + [60.0] * 50
    whole = measuring()
    expected, _ = drive(whole, cycles, hybrids=2, waited=3)

    first = measuring()
    head, now = drive(first, cycles[:cut], hybrids=2, waited=3)
    restored = measuring()
    restored.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail, _ = drive(restored, cycles[cut:], hybrids=2, waited=3, start_step=cut + 1, start_now=now,
                    lent_before=2 if head[-1] else 0)

    assert head + tail == expected
    assert restored.state_dict() == whole.state_dict()


def test_a_long_lending_run_pauses_three_steps_every_48_lends_to_measure_the_no_lend_cycle_again():
    # steps 8-10 lend and 11-13 measure the streak (a 10 s win); steps 14-61 lend (48 lends), 62-64
    # pause (63 and 64 are no-lend cycles: T0 gets its 8th and 9th), 65 lends
    policy = measuring()

    answers, _ = drive(policy, [60.0] * 8 + [50.0] * 2 + [60.0] * 3 + [50.0] * 48 + [60.0] * 4)

    assert answers == [0] * 7 + [True] * 3 + [0] * 3 + [True] * 48 + [0] * 3 + [True]
    assert policy.base["n"] == 9


def test_a_marginal_win_is_re_measured_after_6_lends():
    # with switches of 4 + 3 = 7 s, W 13.5 < 2 × 7: the win is marginal, so after the first
    # streak's measurement (steps 8-13) the pause comes after 6 lends, not 48. The model: window
    # (13.5 − 7) / 2 = 3.25 s against L 7.5 s → ρ 0.43 → gain 0.30 × 6.5 = 1.96 s > 1.2 s + 10 %
    # of C (the streak measured 2 s, which does not cap it)
    policy = measuring(prior_switch_s=2.0)

    answers, _ = drive(policy, [60.0] * 7 + [58.0] * 3 + [60.0] * 3 + [58.0] * 6 + [60.0] * 4, wait=13.5,
                       switch={1: (4.0, 3.0)})

    assert answers == [0] * 7 + [True] * 3 + [0] * 3 + [True] * 6 + [0] * 3 + [True]
    assert policy.marginal


def test_it_rebalances_only_when_the_lent_hybrids_hold_less_than_a_filled_standalone():
    # after the measured no-lend cycles a standalone holds 8 samples; with one hybrid lent, 16 in
    # flight means the headroom filled it: no rebalance; 12 in flight means it holds 4: rebalance.
    # Before the load is measured (a clear win lends at step 1) the headroom tells: 12 in flight
    # of a cap of 96 with nothing queued means the rollouter could start more and did not, so
    # every replica is at its concurrency (no rebalance); 12 in flight + 84 queued leave none, so
    # the hybrid may hold less than the standalone (rebalance)
    policy = measuring()
    fresh = [policy.request_rebalance(1, replace(CTX, lent_replicas=1, in_flight_samples=12, mq_size=q))
             for q in (0, 84)]
    drive(policy, [60.0] * 7)
    lent = replace(CTX, hybrid_replicas=1, lent_replicas=1)

    answers = [policy.request_rebalance(8, replace(lent, in_flight_samples=n)) for n in (16, 12)]

    assert (fresh, answers) == ([False, True], [False, True])


def test_the_switch_cost_prior_decides_whether_the_first_lend_is_tried():
    # W 12 s: against the 6 s prior, a window of (12 − 6) / 2 = 3 s of L 7.5 s gives ρ 0.4 and a
    # gain of (0.4 / 1.4) × 6 = 1.7 s, short of 1.2 s + the prior's own uncertainty ((0.4 / 1.4)
    # × hypot(3, 3) = 1.2 s): nothing is ever measured, so it never lends. With a 1 s prior (a run
    # whose fixed costs are smaller): window 5.5 s, ρ 0.73, gain 4.6 s clears 1.2 + 0.13 s; with
    # the activation measured (5 s) and the take-back still the prior's 0.5 s it lends again
    # (window 3.25 s, gain 2.0 s); once both are (5 + 3 = 8 s): window 2 s, ρ 0.27, gain 0.84 s,
    # and it stops
    slow = {1: (5.0, 3.0)}
    assert drive(measuring(), [60.0] * 11, wait=12.0, switch=slow)[0] == [0] * 11
    primed = measuring(prior_switch_s=1.0)

    answers, _ = drive(primed, [60.0] * 11, wait=12.0, switch=slow)

    assert answers == [0] * 7 + [True, True, 0, 0]
    assert primed.state_dict()["prior_switch_s"] == 1.0
    with pytest.raises(ValueError, match="prior_switch_s"):
        build_policy("predictive", prior_switch_s=0.0)


def test_the_prior_is_a_config_key_only_for_policies_that_take_one():
    from config import ConfigError
    from flows.configs import load_checked
    from policies import policy_from_config

    cfg = load_checked("sim/qwen35-35b-emulated-tp8-dynamic", [])
    assert (cfg.async_training.dynamic_schedule_policy, policy_from_config(cfg).prior_switch_s) == ("predictive", 0.6)
    default = load_checked("sim/qwen35-35b-emulated-tp8-dynamic", ["async_training.dynamic_schedule_policy=default"])
    assert policy_from_config(default).prior_switch_s == 0.6
    with pytest.raises(ConfigError, match="policy 'fixed_ratio' takes no switch-cost prior"):
        load_checked("sim/qwen35-35b-emulated-tp8-dynamic", ["async_training.dynamic_schedule_policy=fixed_ratio"])


def test_a_lend_window_shorter_than_a_sample_counts_only_its_share_of_the_hybrids():
    # 32 in flight on the standalone: L = 32 × 60 / 64 = 30 s; W 30, C 6: the window of one hybrid
    # (ρ 1, headroom 64 / 32 = 2) is (30 − 6) / 2 = 12 s, so ρ counts 12 / 30 = 0.4: gain
    # (0.4 / 1.4) × 24 = 6.9 s instead of 12 s
    ctx = replace(CTX, in_flight_samples=32, hybrid_replicas=1)
    policy = measuring()
    drive(policy, [60.0] * 7, ctx=ctx)

    assert (policy.latency_s(ctx), policy.effective_share(1, ctx)) == (30.0, 0.4)
    assert policy.predictions(8, ctx)[1][0] == pytest.approx(60.0 - 0.4 / 1.4 * 24.0)


def test_what_is_left_of_the_prompt_budget_bounds_what_the_hybrids_add():
    # headroom 88 of the cap, but only 4 samples left to start: ρ_1 = 4 / 8; none left: nothing
    assert [hybrid_share(1, replace(CTX, samples_to_start=n)) for n in (None, 4, 0)] == [1.0, 0.5, 0.0]


def test_lend_cycles_measured_no_faster_than_the_no_lend_ones_stop_the_lending():
    # the model promises 46.5 s lend cycles, they take 60 s like the no-lend ones around them:
    # the streak's measured gain (none) caps the model's, and it stops; eight no-lend cycles later
    # (14-21) the measurement has aged out and it tries again
    policy = measuring()

    answers, now = drive(policy, [60.0] * 13)
    assert (answers, policy.realized_gain_s(14)) == ([0] * 7 + [True] * 3 + [0] * 3, 0.0)

    more, _ = drive(policy, [60.0] * 9, start_step=14, start_now=now)
    assert (more, policy.realized_gain_s(23)) == ([0] * 8 + [True], None)


def test_the_start_up_cycles_are_not_measured():
    policy = measuring()
    drive(policy, [200.0, 150.0, 60.0])

    assert (policy.base["n"], policy.base["level"]) == (1, 60.0)


def test_a_clear_win_is_lent_from_the_first_step_and_never_paused_to_be_measured():
    # two hybrids against one standalone (ρ_2 = 2) and a 30 s wait from step 1 on: the pessimistic
    # gain 2/3 × (30 − 6) = 16 s is over the bar (C = 6 s), so it lends at step 1 without measuring T0.
    # Measured switches (2 + 1 s) keep it clear, so no A-B-A pause ever comes
    policy = build_policy("predictive")

    answers, _ = drive(policy, [60.0] + [45.0] * 19, hybrids=2)

    assert answers == [True] * 20
    assert (policy.clear, policy.free_waits, policy.base["n"]) == (True, [30.0], 0)


def test_a_win_under_the_clear_bar_is_measured_first():
    # with a bar of 1.3 × the switch seconds, wait 15 s: 2/3 × (15 − 6) = 6 s < 1.3 × 6 = 7.8 s,
    # not clear: five no-lend cycles are measured first; then the model (window 3 s of L 7.5 s:
    # ρ 0.8, gain 4 s) lends at step 8 (at the default bar, 1 × C, the same wait is a clear win)
    policy = PredictiveDynamicSchedulePolicy(clear_gain=1.3, probes=False)
    assert build_policy("predictive").clear_gain_s(2, replace(CTX, hybrid_replicas=2, step_wait_times=[15.0])) >= 6.0

    answers, now = drive(policy, [60.0] * 7, hybrids=2, wait=15.0)
    gain = policy.clear_gain_s(2, replace(CTX, hybrid_replicas=2, step_wait_times=[15.0]))
    more, _ = drive(policy, [60.0], hybrids=2, wait=15.0, start_step=8, start_now=now)

    assert (answers + more, gain) == ([0] * 7 + [True], pytest.approx(6.0))


def test_one_hybrid_against_many_standalones_is_never_a_clear_win():
    # ρ_1 = 1/4 < 1: however long the wait, the win is measured first
    ctx = replace(CTX, standalone_replicas=4, in_flight_samples=32)
    policy = build_policy("predictive")

    assert drive(policy, [60.0] * 3, wait=50.0, ctx=ctx)[0] == [0] * 3


@pytest.mark.parametrize(("samples_left", "expected"), [(128, [0] * 12), (1920, [0] * 4 + [True] + [0] * 7)])
def test_a_probe_measures_the_switches_only_where_the_run_can_afford_a_switch_as_dear_as_the_prior(
        samples_left, expected):
    # W 8 s against the 6 s prior: no predicted win, but free switches would give ρ W / (1 + ρ) =
    # 3.3 s ≥ a quarter of the prior (two hybrids, window 8 / 3 s of L 7.5 s: ρ 0.71). A probe
    # may cost 6 s + 2 % of T0 = 7.2 s: 0.6 % of 10 steps of 60 s is 3.6 s (no probe), of 38 steps
    # 13.7 s (one probe, at step 5: a probe needs only two measured no-lend cycles). It measures
    # 5 + 3 s: no win, no more lends
    ctx = replace(CTX, samples_to_start=samples_left)
    policy = build_policy("predictive")

    answers, _ = drive(policy, [60.0] * 12, hybrids=2, wait=8.0, ctx=ctx, switch={2: (5.0, 3.0)})

    assert answers == expected


def test_a_clear_streak_whose_lend_cycles_shrink_stops_lending_when_the_wait_they_imply_no_longer_pays():
    # lent from step 1 (30 s wait, ρ_2 = 2); its lend cycles fall from 45 s to 20 s: the wait they
    # imply, 30 + min(1 + ρ, 2) × (the fall beyond 5 % of 45 s), no longer pays the
    # switches at step 8. The no-lend cycles after it wait 30 s again (this script's wait never
    # changes), so at step 10 the win is clear again. A fall to 30 s is not enough to stop it
    policy, steady = build_policy("predictive"), build_policy("predictive")

    answers, _ = drive(policy, [60.0] + [45.0] * 3 + [20.0] * 6, hybrids=2)
    kept, _ = drive(steady, [60.0] + [45.0] * 3 + [30.0] * 6, hybrids=2)

    assert (answers, kept) == ([True] * 7 + [0, 0, True], [True] * 10)


def test_a_model_win_is_re_measured_after_an_eighth_of_a_short_run_and_a_clear_one_later():
    policy = build_policy("predictive")

    assert (policy.refresh_after(), policy.refresh_after(64.0), policy.refresh_after(16.0)) == (48, 8, 6)
    policy.clear, policy.clear_margin = True, 3.0
    assert (policy.refresh_after(64.0), policy.refresh_after()) == (144, 144)
    policy.clear_margin = 20.0
    assert policy.refresh_after() == 8 * 48


def test_a_clear_win_its_streaks_confirm_is_trusted_longer_each_time():
    policy = build_policy("predictive")
    policy.clear, policy.clear_margin = True, 2.0

    intervals = []
    for confirmed in range(3):
        policy.confirmed = confirmed
        intervals.append(policy.refresh_after())

    growth = predictive.TRUST_GROWTH
    assert intervals == [96, 96 * growth, 96 * growth ** 2]
    policy.clear = False
    assert policy.refresh_after(64.0) == 8  # a model's win is not trusted longer


def _long_streak(policy, lend_s: float, before_s: float, cycles: int):
    policy.streak = {"before": before_s, "lent": {"n": 0, "mean": 0.0, "var": 0.0},
                     "after": {"n": 0, "mean": 0.0, "var": 0.0}}
    for _ in range(cycles):
        policy.streak["lent"] = predictive._add(policy.streak["lent"], lend_s)


def test_a_long_streak_is_measured_against_the_cycles_after_it_and_the_measurements_are_averaged():
    # the cycles grew from 30 s (before a 10-cycle streak) to 50 s (after it) while the streak ran
    # at 45 s: an A-B-A would say the streak lost 5 s a cycle; the cycles after it say it gave 5 s.
    # A second streak that measures a 1 s loss moves the running mean by 30 %, not to −1 s
    policy = build_policy("predictive")
    policy.wait = {"n": 5, "mean": 20.0, "var": 0.0}
    _long_streak(policy, 45.0, 30.0, 10)
    policy._close_streak(50.0)
    policy._close_streak(50.0)
    first = policy.realized["gain"]
    _long_streak(policy, 51.0, 30.0, 10)
    policy._close_streak(50.0)
    policy._close_streak(50.0)

    assert (first, policy.realized["n"]) == (pytest.approx(5.0), 2)
    assert policy.realized["gain"] == pytest.approx(5.0 + 0.5 * (-1.0 - 5.0))


def test_a_streak_gain_within_its_noise_is_not_a_win():
    # no-lend cycles of 60 ± 5 s: the streak's 4 s gain is under one standard error of a
    # two-cycle A-B-A measurement (5 × √(1/2 + 1/4 × (1/2 + 1/2)) ≈ 4.3 s) plus 2 % of T0 and 10 %
    # of C, so the model's bigger win is not lent on; with steady 60 s cycles the same 4 s is
    noisy, steady = measuring(), measuring()
    cycles = [60.0, 60.0, 55.0, 65.0, 55.0, 65.0, 55.0, 65.0, 56.0, 56.0, 55.0, 65.0, 55.0]
    drive(noisy, cycles)
    drive(steady, [60.0] * 8 + [56.0] * 2 + [60.0] * 3)
    ctx = replace(CTX, hybrid_replicas=1)

    assert noisy.realized["se"] > 4.0 and steady.realized["se"] == 0.0
    assert (noisy.best_lend(14, ctx), steady.best_lend(14, ctx)) == (0, 1)


def test_a_first_lend_with_unmeasured_switches_needs_twice_the_probe_cost_or_the_probe_budget():
    # T0 60 s, W 40 s, one hybrid, a 16-step run: the probe budget (0.6 % × 60 s × 16 steps =
    # 5.8 s) affords no lend with unmeasured switches, so the model's first lend must gain twice
    # what a probe may cost (the prior + 2 % of T0). With the 6 s prior: ρ (W − 6) / (1 + ρ) =
    # 17 s ≥ 2 × 7.2 s, it lends; with a 10 s prior: 15 s < 2 × 11.2 s, it does not
    short = replace(CTX, hybrid_replicas=1, samples_to_start=64 * 8)
    lends, dear = measuring(), measuring(prior_switch_s=10.0)
    drive(lends, [60.0] * 7, ctx=short, wait=40.0)
    drive(dear, [60.0] * 7, ctx=short, wait=40.0)
    asked = replace(short, step_wait_times=[40.0])

    assert (lends.best_lend(8, asked), dear.best_lend(8, asked)) == (1, 0)
