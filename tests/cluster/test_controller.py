"""The dynamic resource controller drives fakes in the documented order and remembers its timings.

Every fake appends to one shared event list, and a fake clock advances by a fixed cost per call,
so each test can assert the whole sequence of calls and exact durations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from cluster.controller import (
    ControllerState,
    DecisionRecord,
    DynamicResourceController,
    IllegalTransition,
    SwitchTiming,
)

HYBRIDS = ("h0", "h1")
STANDALONES = ("s0", "s1")
ALL = STANDALONES + HYBRIDS
START = 100.0
# Seconds each fake call costs on the fake clock (binary fractions keep the sums exact).
COSTS = {
    "remove": 1.0,
    "abort": 2.0,
    "sleep": 4.0,
    "wake_up": 8.0,
    "load_weights": 16.0,
    "add": 0.5,
    "resume": 0.25,
    "clear_sticky": 0.125,
    "policy": 0.0625,
}
ABORTED = 5
DEACTIVATE_S = 7.0
SYNC_S = 24.0
ACTIVATE_S = 0.75


@dataclass
class Ctx:
    """The context fields the controller reads or fills (a stand-in for the policies' one)."""

    required_samples: int = 16
    trigger_parameter_sync_step: int = 4
    total_generated_samples: int = 0
    expected_samples: int = 0
    buffer_samples: int = 0
    step_wait_times: list[float] = field(default_factory=list)
    step_wait_samples: list[int] = field(default_factory=list)
    only_hybrid: bool = False
    last_activate_duration_s: float = 0.0
    last_deactivate_duration_s: float = 0.0
    now: float = 0.0
    last_switch_at: float | None = None


class FakeClock:
    def __init__(self, events: list[tuple]) -> None:
        self.events = events
        self.now = START

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.events.append(("wait", seconds))
        self.now += seconds


class FakeLoadBalancer:
    def __init__(self, events: list[tuple], clock: FakeClock, in_flight: list[int]) -> None:
        self.events = events
        self.clock = clock
        self.scripted_in_flight = list(in_flight)

    def add_replicas(self, ids):
        self.events.append(("lb.add_replicas", tuple(ids)))
        self.clock.advance(COSTS["add"])

    def remove_replicas(self, ids):
        self.events.append(("lb.remove_replicas", tuple(ids)))
        self.clock.advance(COSTS["remove"])

    def clear_sticky(self):
        self.events.append(("lb.clear_sticky",))
        self.clock.advance(COSTS["clear_sticky"])
        return 7

    def hold(self):
        self.events.append(("lb.hold",))

    def unhold(self):
        self.events.append(("lb.unhold",))

    def in_flight(self, ids=None):
        self.events.append(("lb.in_flight", None if ids is None else tuple(ids)))
        if len(self.scripted_in_flight) > 1:
            return self.scripted_in_flight.pop(0)
        return self.scripted_in_flight[0] if self.scripted_in_flight else 0


class FakePool:
    def __init__(self, events: list[tuple], clock: FakeClock) -> None:
        self.events = events
        self.clock = clock

    def abort(self, ids):
        self.events.append(("pool.abort", tuple(ids)))
        self.clock.advance(COSTS["abort"])
        return ABORTED

    def sleep(self, ids):
        self.events.append(("pool.sleep", tuple(ids)))
        self.clock.advance(COSTS["sleep"])

    def wake_up(self, ids):
        self.events.append(("pool.wake_up", tuple(ids)))
        self.clock.advance(COSTS["wake_up"])

    def load_weights(self, ids, version):
        self.events.append(("pool.load_weights", tuple(ids), version))
        self.clock.advance(COSTS["load_weights"])

    def resume(self, ids):
        self.events.append(("pool.resume", tuple(ids)))
        self.clock.advance(COSTS["resume"])


class RecordingPolicy:
    """Answers from a script, records each call, and costs COSTS["policy"] on the fake clock."""

    def __init__(self, events: list[tuple], clock: FakeClock, answers: dict | None = None):
        self.events = events
        self.clock = clock
        self.answers = {
            "should_deactivate": True,
            "deactivate_wait_samples": 12,
            "should_activate_after_step": True,
            "request_rebalance": True,
            **(answers or {}),
        }

    def _called(self, hook, *args):
        self.events.append(("policy." + hook, *args))
        self.clock.advance(COSTS["policy"])
        return self.answers.get(hook)

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return self._called("should_deactivate", global_steps, is_hybrid_active)

    def deactivate_wait_samples(self, ctx):
        return self._called("deactivate_wait_samples")

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return self._called("should_activate_after_step", global_steps, is_hybrid_active)

    def request_rebalance(self, global_steps, ctx):
        return self._called("request_rebalance", global_steps)

    def update_after_step(self, global_steps, ctx):
        self._called("update_after_step", global_steps)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class ExplainingPolicy(RecordingPolicy):
    def explain(self, hook, global_steps, is_hybrid_active, ctx):
        return f"{hook} at step {global_steps}, active={is_hybrid_active}"


@dataclass
class Rig:
    events: list[tuple]
    clock: FakeClock
    lb: FakeLoadBalancer
    pool: FakePool
    policy: RecordingPolicy
    controller: DynamicResourceController


def make_rig(
    *,
    hybrid_ids=HYBRIDS,
    standalone_ids=STANDALONES,
    in_flight=(0,),
    policy_cls=ExplainingPolicy,
    answers=None,
    **kwargs,
) -> Rig:
    events: list[tuple] = []
    clock = FakeClock(events)
    lb = FakeLoadBalancer(events, clock, list(in_flight))
    pool = FakePool(events, clock)
    policy = policy_cls(events, clock, answers)
    controller = DynamicResourceController(
        policy,
        hybrid_ids,
        lb,
        pool,
        standalone_ids=standalone_ids,
        clock=clock,
        sleep=clock.sleep,
        **kwargs,
    )
    return Rig(events, clock, lb, pool, policy, controller)


# ---------------------------------------------------------------------------------- switches


def test_deactivate_removes_routing_then_aborts_then_sleeps_the_hybrids():
    rig = make_rig(initial_state=ControllerState.HYBRID_ACTIVE)

    timing = rig.controller.deactivate()

    assert rig.events == [
        ("lb.remove_replicas", HYBRIDS),
        ("pool.abort", HYBRIDS),
        ("pool.sleep", HYBRIDS),
    ]
    assert timing == SwitchTiming(
        kind="deactivate",
        started_at=START,
        duration_s=DEACTIVATE_S,
        phases={"remove": 1.0, "abort": 2.0, "sleep": 4.0},
        aborted=ABORTED,
    )
    assert rig.controller.state is ControllerState.STANDALONE_ONLY
    assert rig.controller.is_hybrid_active is False
    assert rig.controller.switch_log == [timing]
    assert rig.controller.switch_count == 1


def test_hybrid_sync_then_activate_wakes_loads_then_adds_and_resumes_the_hybrids():
    rig = make_rig()

    sync = rig.controller.hybrid_sync(3)
    activate = rig.controller.activate(version=3)

    assert rig.events == [
        ("pool.wake_up", HYBRIDS),
        ("pool.load_weights", HYBRIDS, 3),
        ("lb.add_replicas", HYBRIDS),
        ("pool.resume", HYBRIDS),
    ]
    assert sync == SwitchTiming(
        kind="hybrid_sync",
        started_at=START,
        duration_s=SYNC_S,
        phases={"wake_up": 8.0, "load_weights": 16.0},
        aborted=0,
    )
    assert activate == SwitchTiming(
        kind="activate",
        started_at=START + SYNC_S,
        duration_s=ACTIVATE_S,
        phases={"add": 0.5, "resume": 0.25},
        aborted=0,
    )
    assert rig.controller.state is ControllerState.HYBRID_ACTIVE
    assert rig.controller.synced_version == 3
    assert rig.controller.switch_log == [sync, activate]
    assert rig.controller.switch_count == 1


def test_rebalance_clears_sticky_aborts_every_active_replica_and_waits_for_the_drain():
    rig = make_rig(in_flight=[3, 1, 0])
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    del rig.events[:]
    started = rig.clock.now

    timing = rig.controller.rebalance()

    assert rig.events == [
        ("lb.clear_sticky",),
        ("lb.hold",),  # the aborted requests' retries wait instead of bouncing off paused replicas
        ("pool.abort", ALL),
        ("lb.in_flight", ALL),
        ("wait", 0.01),
        ("lb.in_flight", ALL),
        ("wait", 0.01),
        ("lb.in_flight", ALL),
        ("pool.resume", ALL),
        ("lb.unhold",),
    ]
    assert timing.kind == "rebalance"
    assert timing.started_at == started
    assert timing.aborted == ABORTED
    assert list(timing.phases) == ["clear_sticky", "abort", "drain", "resume"]
    assert timing.phases["drain"] == pytest.approx(0.02)
    assert timing.duration_s == pytest.approx(0.125 + 2.0 + 0.02 + 0.25)
    assert rig.controller.state is ControllerState.HYBRID_ACTIVE
    assert rig.controller.switch_log[-1] == timing
    assert rig.controller.switch_count == 1  # a rebalance is not a state switch


def test_a_replaced_standalone_takes_the_dead_ones_place_in_every_later_switch():
    rig = make_rig()
    dead = STANDALONES[0]
    rig.controller.replace_standalone(dead, f"{dead}.r1")
    assert rig.controller.standalone_ids == (f"{dead}.r1", *STANDALONES[1:])
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    del rig.events[:]

    rig.controller.rebalance()

    ids = (f"{dead}.r1", *STANDALONES[1:], *HYBRIDS)
    assert rig.events == [("lb.clear_sticky",), ("lb.hold",), ("pool.abort", ids), ("lb.in_flight", ids),
                          ("pool.resume", ids), ("lb.unhold",)]
    with pytest.raises(ValueError, match="already in use"):
        rig.controller.replace_standalone(STANDALONES[1], f"{dead}.r1")


def test_rebalance_that_times_out_resumes_the_replicas_before_raising():
    rig = make_rig(in_flight=[2], rebalance_timeout_s=0.025)
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    log_before = rig.controller.switch_log
    del rig.events[:]

    with pytest.raises(TimeoutError) as raised:
        rig.controller.rebalance()

    assert str(raised.value) == (
        "rebalance: 2 requests still in flight on 4 replicas after 0.025s; "
        "the replicas were resumed"
    )
    assert rig.events == [
        ("lb.clear_sticky",),
        ("lb.hold",),
        ("pool.abort", ALL),
        ("lb.in_flight", ALL),
        ("wait", 0.01),
        ("lb.in_flight", ALL),
        ("wait", 0.01),
        ("lb.in_flight", ALL),
        ("wait", 0.01),
        ("lb.in_flight", ALL),
        ("pool.resume", ALL),
        ("lb.unhold",),
    ]
    assert rig.controller.state is ControllerState.HYBRID_ACTIVE
    assert rig.controller.switch_log == log_before


def test_only_hybrid_run_cycles_deactivate_sync_activate_twice():
    rig = make_rig(
        standalone_ids=(), only_hybrid=True, initial_state=ControllerState.HYBRID_ACTIVE
    )

    for version in (1, 2):
        rig.controller.deactivate()
        assert rig.controller.active_replica_ids() == ()
        rig.controller.hybrid_sync(version)
        rig.controller.activate(version=version)
        assert rig.controller.active_replica_ids() == HYBRIDS

    cycle = lambda version: [  # noqa: E731
        ("lb.remove_replicas", HYBRIDS),
        ("pool.abort", HYBRIDS),
        ("pool.sleep", HYBRIDS),
        ("pool.wake_up", HYBRIDS),
        ("pool.load_weights", HYBRIDS, version),
        ("lb.add_replicas", HYBRIDS),
        ("pool.resume", HYBRIDS),
    ]
    assert rig.events == cycle(1) + cycle(2)
    assert [t.kind for t in rig.controller.switch_log] == [
        "deactivate", "hybrid_sync", "activate"
    ] * 2
    assert rig.controller.switch_count == 4
    assert rig.controller.state is ControllerState.HYBRID_ACTIVE


def test_an_active_hybrid_that_is_also_listed_as_standalone_is_counted_once():
    rig = make_rig(hybrid_ids=("h0", "x"), standalone_ids=("s0", "x"))

    assert rig.controller.active_replica_ids() == ("s0", "x")
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    assert rig.controller.active_replica_ids() == ("s0", "x", "h0")


# ------------------------------------------------------------------------ illegal transitions

ACTIVE = ControllerState.HYBRID_ACTIVE
IDLE = ControllerState.STANDALONE_ONLY


@pytest.mark.parametrize(
    ("initial_state", "action", "message"),
    [
        (ACTIVE, lambda c: c.activate(), "cannot activate: hybrid replicas are already active"),
        (IDLE, lambda c: c.deactivate(), "cannot deactivate: hybrid replicas are not active"),
        (
            ACTIVE,
            lambda c: c.hybrid_sync(2),
            "cannot hybrid_sync while hybrid replicas are active; deactivate first",
        ),
        (IDLE, lambda c: c.rebalance(), "cannot rebalance: hybrid replicas are not active"),
        (IDLE, lambda c: c.activate(), "cannot activate: no hybrid_sync since the last deactivate"),
    ],
    ids=["activate-twice", "deactivate-idle", "sync-active", "rebalance-idle", "activate-unsynced"],
)
def test_an_illegal_switch_raises_and_calls_nothing(initial_state, action, message):
    rig = make_rig(initial_state=initial_state)

    with pytest.raises(IllegalTransition) as raised:
        action(rig.controller)

    assert str(raised.value) == message
    assert rig.events == []
    assert rig.controller.state is initial_state
    assert rig.controller.switch_log == []


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda c: c.deactivate(), "no hybrid replicas to deactivate"),
        (lambda c: c.hybrid_sync(1), "no hybrid replicas to sync"),
        (lambda c: c.activate(), "no hybrid replicas to activate"),
        (lambda c: c.rebalance(), "no hybrid replicas to rebalance"),
    ],
    ids=["deactivate", "hybrid_sync", "activate", "rebalance"],
)
def test_a_controller_without_hybrids_refuses_every_switch(action, message):
    rig = make_rig(hybrid_ids=())

    with pytest.raises(IllegalTransition) as raised:
        action(rig.controller)

    assert str(raised.value) == message
    assert rig.events == []
    assert rig.controller.active_replica_ids() == STANDALONES


def test_activate_refuses_weights_older_than_the_current_version():
    rig = make_rig()
    rig.controller.hybrid_sync(3)
    events_after_sync = list(rig.events)

    with pytest.raises(IllegalTransition) as raised:
        rig.controller.activate(version=4)

    assert str(raised.value) == (
        "cannot activate: hybrid replicas hold version 3 but the current version is 4; "
        "call hybrid_sync(4) first"
    )
    assert rig.events == events_after_sync
    assert rig.controller.state is ControllerState.STANDALONE_ONLY


def test_activate_after_a_deactivate_needs_a_fresh_hybrid_sync():
    rig = make_rig()
    rig.controller.hybrid_sync(1)
    rig.controller.activate(version=1)
    rig.controller.deactivate()
    events_before = list(rig.events)

    with pytest.raises(IllegalTransition, match="no hybrid_sync since the last deactivate"):
        rig.controller.activate(version=1)

    assert rig.events == events_before
    assert rig.controller.synced_version is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"only_hybrid": True}, "only_hybrid runs have no standalone replicas, got 2"),
        (
            {"hybrid_ids": (), "standalone_ids": (), "only_hybrid": True},
            "only_hybrid needs at least one hybrid replica",
        ),
        (
            {"hybrid_ids": (), "initial_state": ControllerState.HYBRID_ACTIVE},
            "cannot start HYBRID_ACTIVE with no hybrid replicas",
        ),
        ({"rebalance_timeout_s": 0.0}, "rebalance_timeout_s must be > 0, got 0.0"),
    ],
    ids=["only-hybrid-with-standalone", "only-hybrid-empty", "active-empty", "zero-timeout"],
)
def test_construction_rejects_an_impossible_setup(kwargs, message):
    with pytest.raises(ValueError) as raised:
        make_rig(**kwargs)

    assert str(raised.value) == message


# --------------------------------------------------------------------------------- decisions


def test_each_policy_call_is_recorded_with_inputs_answer_reason_and_duration():
    rig = make_rig(answers={"deactivate_wait_samples": 12, "request_rebalance": None})
    ctx = Ctx(
        total_generated_samples=40,
        expected_samples=32,
        buffer_samples=8,
        step_wait_times=[1.5, 2.5],
        step_wait_samples=[3, 4],
        now=55.0,
    )

    answers = [
        rig.controller.should_deactivate(7, ctx),
        rig.controller.deactivate_wait_samples(7, ctx),
        rig.controller.should_activate(7, ctx),
        rig.controller.request_rebalance(7, ctx),
        rig.controller.update_policy(7, ctx),
    ]

    assert answers == [True, 12, True, False, None]
    assert rig.events == [
        ("policy.should_deactivate", 7, False),
        ("policy.deactivate_wait_samples",),
        ("policy.should_activate_after_step", 7, False),
        ("policy.request_rebalance", 7),
        ("policy.update_after_step", 7),
    ]
    inputs = {
        "total_generated_samples": 40,
        "expected_samples": 32,
        "buffer_samples": 8,
        "sum_step_wait_times": 4.0,
        "sum_step_wait_samples": 7,
        "now": 55.0,
        "is_hybrid_active": False,
    }
    record = lambda hook, answer: DecisionRecord(  # noqa: E731
        step=7,
        hook=hook,
        answer=answer,
        reason=f"{hook} at step 7, active=False",
        inputs=inputs,
        duration_s=COSTS["policy"],
    )
    assert rig.controller.decisions == [
        record("should_deactivate", True),
        record("deactivate_wait_samples", 12),
        record("should_activate_after_step", True),
        record("request_rebalance", False),
        record("update_after_step", None),
    ]


def test_drain_decisions_returns_the_records_once():
    rig = make_rig()
    rig.controller.should_deactivate(1, Ctx())
    rig.controller.should_activate(1, Ctx())

    drained = rig.controller.drain_decisions()

    assert [d.hook for d in drained] == ["should_deactivate", "should_activate_after_step"]
    assert rig.controller.decisions == []
    assert rig.controller.drain_decisions() == []


def test_a_policy_without_explain_gets_an_empty_reason():
    rig = make_rig(policy_cls=RecordingPolicy, initial_state=ControllerState.HYBRID_ACTIVE)

    answer = rig.controller.should_deactivate(2, Ctx())

    assert answer is True
    assert rig.events == [("policy.should_deactivate", 2, True)]
    [decision] = rig.controller.decisions
    assert decision.reason == ""
    assert decision.inputs["is_hybrid_active"] is True


@pytest.mark.parametrize(("raw", "clamped"), [(-5, 0), (0, 0), (9, 9)])
def test_deactivate_wait_samples_never_goes_below_zero(raw, clamped):
    rig = make_rig(answers={"deactivate_wait_samples": raw})

    assert rig.controller.deactivate_wait_samples(1, Ctx()) == clamped
    assert rig.controller.decisions[-1].answer == clamped


def test_disabled_rebalance_never_asks_the_policy():
    rig = make_rig(enable_rebalance=False, answers={"request_rebalance": True})

    assert rig.controller.request_rebalance(4, Ctx()) is False
    assert rig.events == []
    assert rig.controller.decisions == []


# ---------------------------------------------------------------------------------- context


def test_context_before_any_switch_only_fills_the_clock():
    rig = make_rig()
    ctx = Ctx(now=1.0, last_switch_at=3.0, last_activate_duration_s=9.0)

    filled = rig.controller.context(ctx)

    assert filled == Ctx(now=START)
    assert ctx == Ctx(now=1.0, last_switch_at=3.0, last_activate_duration_s=9.0)


def test_context_reports_sync_plus_activate_and_the_last_deactivate():
    rig = make_rig()
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    rig.controller.deactivate()
    rig.clock.advance(2.0)

    filled = rig.controller.context(Ctx(total_generated_samples=5))

    end_of_deactivate = START + SYNC_S + ACTIVATE_S + DEACTIVATE_S
    assert filled == Ctx(
        total_generated_samples=5,
        now=end_of_deactivate + 2.0,
        last_switch_at=end_of_deactivate,
        last_activate_duration_s=SYNC_S + ACTIVATE_S,
        last_deactivate_duration_s=DEACTIVATE_S,
    )


# ------------------------------------------------------------------------------- persistence


def drive(rig: Rig, version: int) -> list:
    """One step's switches from HYBRID_ACTIVE and the observations a caller can make."""
    rig.controller.deactivate()
    rig.controller.hybrid_sync(version)
    rig.controller.activate(version=version)
    rig.controller.rebalance()
    return [
        rig.controller.context(Ctx()),
        rig.controller.state_dict(),
        rig.controller.switch_count,
        rig.controller.switch_log,
        rig.controller.active_replica_ids(),
    ]


def test_state_dict_round_trip_gives_a_controller_that_behaves_identically():
    original = make_rig()
    original.controller.hybrid_sync(3)
    original.controller.activate(version=3)
    original.controller.deactivate()
    original.controller.hybrid_sync(4)
    original.controller.activate(version=4)
    saved = json.loads(json.dumps(original.controller.state_dict()))
    restored = make_rig()
    restored.clock.now = original.clock.now
    del original.events[:]
    original.controller.drain_switch_log()

    restored.controller.load_state_dict(saved)

    assert restored.controller.state is ControllerState.HYBRID_ACTIVE
    assert restored.controller.state_dict() == original.controller.state_dict()
    assert restored.controller.context(Ctx()) == original.controller.context(Ctx())
    assert drive(restored, 5) == drive(original, 5)
    assert restored.events == original.events
    assert restored.controller.switch_count == 5


def test_a_restored_hybrid_sync_lets_activate_proceed_without_syncing_again():
    original = make_rig()
    original.controller.hybrid_sync(6)
    restored = make_rig()
    fresh = make_rig()

    restored.controller.load_state_dict(json.loads(json.dumps(original.controller.state_dict())))
    timing = restored.controller.activate(version=6)

    assert restored.events == [("lb.add_replicas", HYBRIDS), ("pool.resume", HYBRIDS)]
    assert restored.controller.context(Ctx()).last_activate_duration_s == SYNC_S + timing.duration_s
    with pytest.raises(IllegalTransition):
        fresh.controller.activate(version=6)


def test_load_state_dict_rejects_an_unknown_state_name():
    rig = make_rig()
    state = dict(rig.controller.state_dict(), state="HALF_ACTIVE")

    with pytest.raises(ValueError) as raised:
        rig.controller.load_state_dict(state)

    assert str(raised.value) == (
        "unknown controller state 'HALF_ACTIVE'; known: STANDALONE_ONLY, HYBRID_ACTIVE"
    )
    assert rig.controller.state is ControllerState.STANDALONE_ONLY


def test_load_state_dict_refuses_hybrid_active_without_hybrids():
    rig = make_rig(hybrid_ids=())
    state = dict(rig.controller.state_dict(), state="HYBRID_ACTIVE")

    with pytest.raises(ValueError, match="cannot restore HYBRID_ACTIVE with no hybrid replicas"):
        rig.controller.load_state_dict(state)

    assert rig.controller.is_hybrid_active is False
