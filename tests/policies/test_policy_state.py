"""A scripted 12-step run with hand-computed decisions, and state_dict round trips mid-run.

Every context: required_samples=16, trigger_parameter_sync_step=4 → 64 samples per cycle; step k
has consumed 64·k samples, so total_generated_samples = 64·k + surplus_k; its weight sync ends at
now = 60·k s, and the deactivation questions were asked 20 s earlier (see ``policy_driver``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest
from policy_driver import ControllerState, run_steps

from policies import DynamicScheduleContext, DynamicSchedulePolicyBase, GuardedPolicy, build_policy

CTX = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)

#            surplus, wait seconds per micro-step, waited samples per micro-step, (activate s, deactivate s)
SCRIPT = [
    (20, [2.0, 1.0, 0.0, 0.0], [8, 4, 0, 0], (0.0, 0.0)),  # step 1
    (10, [5.0, 5.0, 5.0, 5.0], [10, 10, 10, 10], (0.0, 0.0)),  # step 2
    (30, [], [], (4.0, 2.0)),  # step 3
    (5, [], [], (0.0, 0.0)),  # step 4
    (50, [], [], (3.0, 5.0)),  # step 5
    (40, [], [], (0.0, 0.0)),  # step 6
    (0, [3.0, 3.0, 3.0, 3.0], [4, 4, 4, 4], (0.0, 0.0)),  # step 7
    (8, [0.9, 0.0, 0.0, 0.0], [3, 0, 0, 0], (2.0, 2.0)),  # step 8
    (60, [], [], (1.0, 1.0)),  # step 9
    (37, [0.5, 0.0, 0.0, 0.0], [1, 0, 0, 0], (0.0, 0.0)),  # step 10
    (10, [], [], (3.0, 3.0)),  # step 11
    (48, [], [], (0.0, 0.0)),  # step 12
]
CONTEXTS = [
    replace(
        CTX,
        now=60.0 * k,
        expected_samples=64 * k,
        total_generated_samples=64 * k + surplus,
        step_wait_times=times,
        step_wait_samples=samples,
        last_activate_duration_s=act,
        last_deactivate_duration_s=deact,
    )
    for k, (surplus, times, samples, (act, deact)) in enumerate(SCRIPT, start=1)
]

# default, ratio 0.5; r = ratio, T = r × 64 the threshold, gap = T − surplus, per = per-sample s,
# cost = switch cost (mean of the last 3 measured activate + deactivate, 10 s before any).
#  1 off: gap 32−20=12, per 3/12=0.25 → 3.0 ≤ 10 no.        update: 12/64 → +0.1, r 0.6
#  2 off: gap 38.4−10=28.4, per 20/40=0.5 → 14.2 > 10 ON.   update: 40/64 → +0.1, r 0.7
#  3 on → off, wait int(44.8)=44; gap 44.8−30=14.8, per 0.5 (remembered) → 7.4 ≤ 10 no.
#                                                            update: cost [6], r 0.68
#  4 off: gap 43.52−5=38.52 → 19.26 > 6 ON.                 update: r 0.66
#  5 on → off, wait int(42.24)=42; gap 42.24−50 < 0 no.     update: cost [6, 8], r 0.64
#  6 off: gap 40.96−40=0.96 → 0.48 ≤ 7 no.                  update: r 0.62
#  7 off: gap 39.68−0, per 12/16=0.75 → 29.76 > 7 ON.       update: 16/64 → +0.1, r 0.72
#  8 on → off, wait int(46.08)=46; gap 46.08−8=38.08, per 0.9/3=0.3 → 11.424 > 7 ON.
#                                                            update: cost [6, 8, 4], +3/64, r 0.766875
#  9 on → off, wait int(49.08)=49; gap 49.08−60 < 0 no.     update: cost [8, 4, 2] (6 slides out), r 0.746875
# 10 off: gap 47.8−37=10.8, per 0.5/1=0.5 → 5.4 > 14/3≈4.67 ON (the unslid 6.0 would say no).
#                                                            update: 1/64 → +0.02, r 0.766875
# 11 on → off, wait 49; gap 49.08−10=39.08, per 0.5 → 19.54 > 4.67 ON.  update: cost [4, 2, 6], r 0.746875
# 12 on → off, wait int(47.8)=47; gap 47.8−48=−0.2 no.      update: r 0.726875
DEFAULT_EVENTS = [
    ("activate", 2, True),
    ("deactivate", 3, 44),
    ("activate", 4, True),
    ("deactivate", 5, 42),
    ("activate", 7, True),
    ("deactivate", 8, 46),
    ("activate", 8, True),
    ("deactivate", 9, 49),
    ("activate", 10, True),
    ("deactivate", 11, 49),
    ("activate", 11, True),
    ("deactivate", 12, 47),
]

# the same default with a 50 s minimum dwell: activation only when default wants it AND the
# last switch was ≥ 50 s ago. The ratio path is unchanged (it depends only on the contexts).
#  2 ON (no switch yet) at 120 · 3 off at 160 · 4 ON: 240−160=80 · 5 off at 280 · 7 ON: 420−280=140
#  8 off at 460, default wants ON at 480 but 480−460=20 < 50: held off · 9 already off, no wish
# 10 ON: 600−460=140 · 11 off at 640, wants ON at 660: 20 < 50 held off · 12 off, no wish
GUARDED_EVENTS = [
    ("activate", 2, True),
    ("deactivate", 3, 44),
    ("activate", 4, True),
    ("deactivate", 5, 42),
    ("activate", 7, True),
    ("deactivate", 8, 46),
    ("activate", 10, True),
    ("deactivate", 11, 49),
]

# fixed_ratio 0.5: T = 32 always, wait 32, activate iff surplus < 32
# surpluses 20 10 30 5 | 50 40 | 0 8 | 60 37 | 10 | 48
FIXED_EVENTS = [
    ("activate", 1, True),
    ("deactivate", 2, 32), ("activate", 2, True),
    ("deactivate", 3, 32), ("activate", 3, True),
    ("deactivate", 4, 32), ("activate", 4, True),
    ("deactivate", 5, 32),  # 32 − 50 < 0; step 6: 32 − 40 < 0
    ("activate", 7, True),
    ("deactivate", 8, 32), ("activate", 8, True),
    ("deactivate", 9, 32),  # 32 − 60 < 0; step 10: 32 − 37 < 0
    ("activate", 11, True),
    ("deactivate", 12, 32),  # 32 − 48 < 0
]

# static_fully_async only-hybrid: re-activate after every sync, wait for the whole cycle (64)
COLOCATED_EVENTS = [("activate", 1, None)] + [
    event for k in range(2, 13) for event in (("deactivate", k, 64), ("activate", k, None))
]

FACTORIES: dict[str, Callable[[], DynamicSchedulePolicyBase]] = {
    "default": lambda: build_policy("default", deactivate_ratio=0.5),
    "fixed_ratio": lambda: build_policy("fixed_ratio", deactivate_ratio=0.5),
    "static_fully_async": lambda: build_policy("static_fully_async"),
    "static_fully_async_only_hybrid": lambda: build_policy("static_fully_async", only_hybrid=True),
    "guarded_default": lambda: GuardedPolicy(build_policy("default", deactivate_ratio=0.5), min_dwell_s=50.0),
}
EXPECTED_EVENTS = {
    "default": DEFAULT_EVENTS,
    "fixed_ratio": FIXED_EVENTS,
    "static_fully_async": [],  # nothing is ever active, nothing is ever lent
    "static_fully_async_only_hybrid": COLOCATED_EVENTS,
    "guarded_default": GUARDED_EVENTS,
}


# --------------------------------------------------------------------------- the scripted run


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_scripted_twelve_steps_give_the_hand_computed_decisions(name: str) -> None:
    events, _ = run_steps(FACTORIES[name](), CONTEXTS)
    assert events == EXPECTED_EVENTS[name]


@pytest.mark.parametrize("name", ["default", "guarded_default"])
def test_the_scripted_run_leaves_default_at_the_hand_computed_ratio_and_switch_cost(name: str) -> None:
    policy = FACTORIES[name]()
    _, state = run_steps(policy, CONTEXTS)
    assert policy.deactivate_ratio == pytest.approx(0.726875)
    assert policy.switch_cost_s() == pytest.approx(4.0)  # mean of [4, 2, 6]
    assert policy.deactivate_wait_samples(CTX) == 46  # int(64 × 0.726875) = int(46.52)
    assert state.active is False


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_policy_restored_mid_run_from_json_decides_exactly_like_the_uninterrupted_one(name: str) -> None:
    uninterrupted = FACTORIES[name]()
    all_events, _ = run_steps(uninterrupted, CONTEXTS)

    first = FACTORIES[name]()
    first_events, controller = run_steps(first, CONTEXTS[:6])
    snapshot = json.loads(json.dumps(first.state_dict()))
    saved_controller = ControllerState(controller.active, controller.last_switch_at)

    resumed = FACTORIES[name]()
    resumed.load_state_dict(snapshot)
    rest_events, _ = run_steps(resumed, CONTEXTS[6:], first_step=7, state=saved_controller)

    assert first_events + rest_events == all_events
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert json.loads(json.dumps(resumed.state_dict())) == uninterrupted.state_dict()


def test_without_the_snapshot_the_second_half_of_default_would_decide_differently() -> None:
    # shows the round trip above can fail. A fresh default (ratio 0.5, prior 1000 s, cost 10 s):
    #  7 off: gap 32−0=32 → ON; update 16/64 → +0.1, r 0.6
    #  8 on → off after int(64 × 0.6) = 38 samples (the restored policy waits for 46);
    #    gap 38.4−8=30.4, per 0.3 → 9.12 ≤ 10 (nothing measured yet): stays off (restored: ON)
    _, controller = run_steps(FACTORIES["default"](), CONTEXTS[:6])
    fresh_events, _ = run_steps(FACTORIES["default"](), CONTEXTS[6:], first_step=7, state=controller)
    expected_rest = [event for event in DEFAULT_EVENTS if event[1] >= 7]
    assert fresh_events[:2] == [("activate", 7, True), ("deactivate", 8, 38)]
    assert fresh_events != expected_rest


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_load_state_dict_rejects_an_unknown_key_and_changes_nothing(name: str) -> None:
    policy = FACTORIES[name]()
    run_steps(policy, CONTEXTS[:3])
    before = policy.state_dict()
    with pytest.raises(KeyError, match="not_a_field"):
        policy.load_state_dict({**before, "deactivate_ratio": 0.123, "not_a_field": 1})
    assert policy.state_dict() == before


def test_state_dict_is_a_copy_that_later_steps_do_not_change() -> None:
    policy = FACTORIES["default"]()
    run_steps(policy, CONTEXTS[:4])
    snapshot = policy.state_dict()
    frozen = json.dumps(snapshot, sort_keys=True)
    run_steps(policy, CONTEXTS[4:], first_step=5)
    assert json.dumps(snapshot, sort_keys=True) == frozen
    assert policy.state_dict() != snapshot


# --------------------------------------------------------------------------- the context


def test_a_context_needs_only_the_two_static_fields_and_derives_the_cycle() -> None:
    ctx = DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)
    assert ctx.step_required_samples == 64
    assert (ctx.total_generated_samples, ctx.expected_samples, ctx.buffer_samples) == (0, 0, 0)
    assert (ctx.step_wait_times, ctx.step_wait_samples) == ([], [])
    assert (ctx.only_hybrid, ctx.last_activate_duration_s, ctx.last_deactivate_duration_s) == (False, 0.0, 0.0)
    assert ctx.last_switch_at is None


def test_replacing_a_static_field_recomputes_the_cycle_and_surplus_is_generated_minus_consumed() -> None:
    ctx = replace(CTX, required_samples=8, total_generated_samples=70, expected_samples=64)
    assert ctx.step_required_samples == 32  # 8 × 4
    assert ctx.surplus == 6
    assert CTX.step_required_samples == 64
