"""The dynamic resource controller drives fakes in the documented order and remembers its timings.

Every fake appends to one shared event list, and a fake clock advances by a fixed cost per call,
so each test can assert the whole sequence of calls and exact durations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from loop.controller import ControllerState, DynamicResourceController, IllegalTransition
from loop.membership import Membership
from loop.plans import RolloutCounters
from loop import STRANDED_REFILL, DecisionRecord, DeactivatePlan, LendPlan, MicroSummary, RunSizes, SwitchReport
from policies import DynamicSchedulePolicyBase

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


SIZES = RunSizes(required_samples=16, trigger_parameter_sync_step=4, buffer_samples=8,
                 standalone_replicas=2, hybrid_replicas=2, consumed_before=32, generated_before=32)
COUNTERS = RolloutCounters(generated_total=40, queue_size=6)


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
    def __init__(self, events: list[tuple], clock: FakeClock, drain: tuple[float, int]) -> None:
        self.events = events
        self.clock = clock
        self.drain_s, self.left = drain

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

    def wait_drained(self, ids, timeout_s):
        """Drained after ``drain_s`` (``left`` = 0), or ``left`` still in flight at the timeout."""
        self.events.append(("lb.wait_drained", tuple(ids)))
        self.clock.advance(timeout_s if self.left else self.drain_s)
        return self.left


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


class RecordingPolicy(DynamicSchedulePolicyBase):
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
    drain=(0.0, 0),
    policy_cls=ExplainingPolicy,
    answers=None,
    counters=COUNTERS,
    **kwargs,
) -> Rig:
    events: list[tuple] = []
    clock = FakeClock(events)
    lb = FakeLoadBalancer(events, clock, drain)
    pool = FakePool(events, clock)
    policy = policy_cls(events, clock, answers)

    def read_counters() -> RolloutCounters:
        events.append(("rollout.counters",))
        return counters

    controller = DynamicResourceController(
        policy,
        hybrid_ids,
        lb,
        pool,
        standalone_ids=standalone_ids,
        sizes=kwargs.pop("sizes", SIZES),
        counters=read_counters,
        clock=clock,
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
    assert timing == SwitchReport(
        kind="deactivate",
        started_at=START,
        duration_s=DEACTIVATE_S,
        phases={"remove": 1.0, "abort": 2.0, "sleep": 4.0},
        aborted=ABORTED,
        replicas=HYBRIDS,
        ops=("remove", "abort", "sleep"),
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
    assert sync == SwitchReport(
        kind="hybrid_sync",
        started_at=START,
        duration_s=SYNC_S,
        phases={"wake_up": 8.0, "load_weights": 16.0},
        aborted=0,
        replicas=HYBRIDS,
        ops=("wake_up", "load_weights"),
    )
    assert activate == SwitchReport(
        kind="activate",
        started_at=START + SYNC_S,
        duration_s=ACTIVATE_S,
        phases={"add": 0.5, "resume": 0.25},
        aborted=0,
        replicas=HYBRIDS,
        ops=("add", "resume"),
    )
    assert rig.controller.state is ControllerState.HYBRID_ACTIVE
    assert rig.controller.synced_version == 3
    assert rig.controller.switch_log == [sync, activate]
    assert rig.controller.switch_count == 1


def test_rebalance_clears_sticky_aborts_every_active_replica_and_waits_for_the_drain():
    rig = make_rig(drain=(0.02, 0))
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    del rig.events[:]
    started = rig.clock.now

    timing = rig.controller.rebalance()

    assert rig.events == [
        ("lb.clear_sticky",),
        ("lb.hold",),  # the aborted requests' retries wait instead of bouncing off paused replicas
        ("pool.abort", ALL),
        ("lb.wait_drained", ALL),  # woken by the completions: no poll
        ("pool.resume", ALL),
        ("lb.unhold",),
    ]
    assert timing.kind == "rebalance"
    assert timing.replicas == ALL
    assert timing.started_at == started
    assert timing.aborted == ABORTED
    assert list(timing.phases) == ["clear_sticky", "abort", "drain", "resume"]
    assert timing.phases["drain"] == pytest.approx(0.02)
    assert timing.duration_s == pytest.approx(0.125 + 2.0 + 0.02 + 0.25)
    assert rig.controller.state is ControllerState.HYBRID_ACTIVE
    assert rig.controller.switch_log[-1] == timing
    assert rig.controller.switch_count == 1  # a rebalance is not a state switch


def test_a_replaced_standalone_takes_the_dead_ones_place_in_every_later_switch():
    members = Membership(STANDALONES, HYBRIDS)
    rig = make_rig(membership=members)
    dead = STANDALONES[0]
    members.died(dead)
    assert rig.controller.standalone_ids == STANDALONES[1:]
    members.replacing(dead, f"{dead}.r1")
    members.joined(dead, f"{dead}.r1")
    assert rig.controller.standalone_ids == (f"{dead}.r1", *STANDALONES[1:])
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    del rig.events[:]

    rig.controller.rebalance()

    ids = (f"{dead}.r1", *STANDALONES[1:], *HYBRIDS)
    assert rig.events == [("lb.clear_sticky",), ("lb.hold",), ("pool.abort", ids), ("lb.wait_drained", ids),
                          ("pool.resume", ids), ("lb.unhold",)]


def test_rebalance_that_times_out_resumes_the_replicas_before_raising():
    rig = make_rig(drain=(0.0, 2), rebalance_timeout_s=0.025)
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
        ("lb.wait_drained", ALL),
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


# ------------------------------------------------------------------------- graded lending

THREE = ("h0", "h1", "h2")


def test_lending_two_of_three_hybrids_wakes_adds_rebalances_and_takes_back_only_those_two():
    rig = make_rig(hybrid_ids=THREE)

    rig.controller.hybrid_sync(4, count=2)
    rig.controller.lend(7, [], count=2)
    assert rig.controller.lent_ids == ("h0", "h1")
    assert rig.controller.active_replica_ids() == STANDALONES + ("h0", "h1")
    rig.controller.deactivate()

    lent = ("h0", "h1")
    assert [e for e in rig.events if not e[0].startswith(("policy.", "rollout."))] == [
        ("pool.wake_up", lent),
        ("pool.load_weights", lent, 4),
        ("lb.add_replicas", lent),
        ("pool.resume", lent),
        ("lb.clear_sticky",),
        ("lb.hold",),
        ("pool.abort", STANDALONES + lent),
        ("lb.wait_drained", STANDALONES + lent),
        ("pool.resume", STANDALONES + lent),
        ("lb.unhold",),
        ("lb.remove_replicas", lent),
        ("pool.abort", lent),
        ("pool.sleep", lent),
    ]
    assert [(t.kind, t.replicas) for t in rig.controller.switch_log] == [
        ("hybrid_sync", lent), ("activate", lent), ("rebalance", STANDALONES + lent), ("deactivate", lent)]
    assert rig.controller.state is ControllerState.STANDALONE_ONLY
    assert rig.controller.lent_ids == ()


def test_a_second_lend_while_some_hybrids_are_lent_is_illegal_and_calls_nothing():
    rig = make_rig(hybrid_ids=THREE)
    rig.controller.hybrid_sync(1, count=1)
    rig.controller.activate()
    del rig.events[:]

    with pytest.raises(IllegalTransition) as raised:
        rig.controller.hybrid_sync(1, count=1)

    assert str(raised.value) == "cannot hybrid_sync while hybrid replicas are active; deactivate first"
    assert rig.events == []
    assert rig.controller.lent_ids == ("h0",)


@pytest.mark.parametrize("count", [0, 4])
def test_a_hybrid_sync_of_no_or_too_many_hybrids_is_illegal(count):
    rig = make_rig(hybrid_ids=THREE)

    with pytest.raises(IllegalTransition) as raised:
        rig.controller.hybrid_sync(1, count=count)

    assert str(raised.value) == f"cannot hybrid_sync {count} of 3 hybrid replicas"
    assert rig.events == []


def test_lend_refuses_a_count_other_than_what_was_synced():
    rig = make_rig(hybrid_ids=THREE)
    rig.controller.hybrid_sync(1, count=2)
    del rig.events[:]

    with pytest.raises(IllegalTransition) as raised:
        rig.controller.lend(1, [], count=3)

    assert str(raised.value) == "cannot lend 3 hybrids: 2 were synced"
    assert rig.events == []


def test_a_policy_answering_a_count_gets_a_plan_of_that_many_and_the_context_counts_the_lent():
    rig = make_rig(hybrid_ids=THREE, answers={"should_activate_after_step": 2})

    plan = rig.controller.should_activate(3, [])
    rig.controller.hybrid_sync(3, count=plan.count)
    rig.controller.activate()

    assert plan == LendPlan(step=3, count=2, of=3)
    assert rig.controller.context().lent_replicas == 2
    assert rig.controller.state_dict()["lent"] == 2


def test_a_resumed_run_that_had_one_of_three_lent_relends_one():
    original = make_rig(hybrid_ids=THREE)
    original.controller.hybrid_sync(2, count=1)
    original.controller.activate()
    state = dict(json.loads(json.dumps(original.controller.state_dict())), state="STANDALONE_ONLY")
    restored = make_rig(hybrid_ids=THREE)

    restored.controller.load_state_dict(state)
    plan = restored.controller.relend_after_resume(2)

    assert plan == LendPlan(step=0, count=1, of=3)


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
        (
            {"hybrid_ids": ("h0", "x"), "standalone_ids": ("s0", "x")},
            "replica ids both standalone and hybrid: ['x']",
        ),
    ],
    ids=["only-hybrid-with-standalone", "only-hybrid-empty", "active-empty", "zero-timeout", "id-in-both"],
)
def test_construction_rejects_an_impossible_setup(kwargs, message):
    with pytest.raises(ValueError) as raised:
        make_rig(**kwargs)

    assert str(raised.value) == message


# --------------------------------------------------------------------------------- decisions

MICRO = [MicroSummary(samples=16, wait_s=1.5, wait_samples=3), MicroSummary(samples=16, wait_s=2.5, wait_samples=4)]


def inputs(*, now: float, active: bool, micro=(), lost: bool = False) -> dict:
    """The summary a decision record keeps of the context the rig's controller builds."""
    return {
        "total_generated_samples": SIZES.generated_before + COUNTERS.generated_total,
        "expected_samples": SIZES.consumed_before + sum(m.samples for m in micro),
        "buffer_samples": SIZES.buffer_samples,
        "sum_step_wait_times": float(sum(m.wait_s for m in micro)),
        "sum_step_wait_samples": sum(m.wait_samples for m in micro),
        "mq_size": COUNTERS.queue_size,
        "standalone_lost": lost,
        "now": now,
        "is_hybrid_active": active,
    }


def record(step, hook, answer, *, now, active, micro=(), reason=None, duration_s=COSTS["policy"]):
    return DecisionRecord(step=step, hook=hook, answer=answer,
                          reason=f"{hook} at step {step}, active={active}" if reason is None else reason,
                          inputs=inputs(now=now, active=active, micro=micro), duration_s=duration_s)


def test_a_lending_step_asks_the_policy_in_the_deciders_order_and_records_every_answer():
    rig = make_rig(initial_state=ControllerState.HYBRID_ACTIVE)

    plan = rig.controller.should_deactivate(7)
    rig.controller.deactivate()
    after_deactivate = rig.clock.now
    lend = rig.controller.should_activate(7, MICRO)
    rig.controller.hybrid_sync(7)
    switches = rig.controller.lend(7, MICRO)
    after_lend = rig.clock.now
    rig.controller.update_after_step(7, MICRO)

    assert plan == DeactivatePlan(step=7, deactivate=True, wait_samples=12, hybrid_active=True)
    assert lend == LendPlan(step=7, count=2, of=2)
    assert [s.kind for s in switches] == ["activate", "rebalance"]
    assert rig.events == [
        ("rollout.counters",), ("policy.should_deactivate", 7, True), ("policy.deactivate_wait_samples",),
        ("lb.remove_replicas", HYBRIDS), ("pool.abort", HYBRIDS), ("pool.sleep", HYBRIDS),
        ("rollout.counters",), ("policy.should_activate_after_step", 7, False),
        ("pool.wake_up", HYBRIDS), ("pool.load_weights", HYBRIDS, 7),
        ("lb.add_replicas", HYBRIDS), ("pool.resume", HYBRIDS),
        ("rollout.counters",), ("policy.request_rebalance", 7),
        ("lb.clear_sticky",), ("lb.hold",), ("pool.abort", ALL), ("lb.wait_drained", ALL), ("pool.resume", ALL),
        ("lb.unhold",),
        ("rollout.counters",), ("policy.update_after_step", 7),
    ]
    policy_s = COSTS["policy"]
    assert rig.controller.drain_decisions() == [
        record(7, "should_deactivate", True, now=START, active=True),
        record(7, "deactivate_wait_samples", 12, now=START, active=True),
        record(7, "should_activate_after_step", 2, now=after_deactivate, active=False, micro=MICRO),
        record(7, "request_rebalance", True, now=after_deactivate + policy_s + SYNC_S + ACTIVATE_S, active=True,
               micro=MICRO),
        record(7, "update_after_step", None, now=after_lend, active=True, micro=MICRO),
    ]
    assert rig.controller.decisions == []


def test_a_step_that_starts_with_the_hybrids_asleep_asks_nothing_before_training():
    rig = make_rig()

    assert rig.controller.should_deactivate(3) == DeactivatePlan(step=3, hybrid_active=False)
    assert rig.events == []
    assert rig.controller.decisions == []


def test_a_retried_question_is_answered_from_memory_and_recorded_once():
    rig = make_rig(initial_state=ControllerState.HYBRID_ACTIVE)

    first = rig.controller.should_deactivate(5)
    again = rig.controller.should_deactivate(5)
    rig.controller.update_after_step(5, MICRO)
    rig.controller.update_after_step(5, MICRO)

    assert again == first == DeactivatePlan(step=5, deactivate=True, wait_samples=12, hybrid_active=True)
    assert [e[0] for e in rig.events if e[0].startswith("policy.")] == [
        "policy.should_deactivate", "policy.deactivate_wait_samples", "policy.update_after_step",
    ]
    assert [d.hook for d in rig.controller.decisions] == [
        "should_deactivate", "deactivate_wait_samples", "update_after_step",
    ]
    assert rig.controller.context().expected_samples == SIZES.consumed_before + 32  # consumed once


@pytest.mark.parametrize(("raw", "clamped"), [(-5, 0), (0, 0), (9, 9)])
def test_deactivate_wait_samples_never_goes_below_zero(raw, clamped):
    rig = make_rig(answers={"deactivate_wait_samples": raw}, initial_state=ControllerState.HYBRID_ACTIVE)

    assert rig.controller.should_deactivate(1).wait_samples == clamped
    assert rig.controller.decisions[-1].answer == clamped


def test_disabled_rebalance_never_asks_the_policy():
    rig = make_rig(enable_rebalance=False, answers={"request_rebalance": True})
    rig.controller.hybrid_sync(4)
    del rig.events[:]

    switches = rig.controller.lend(4, [])

    assert [s.kind for s in switches] == ["activate"]
    assert rig.events == [("lb.add_replicas", HYBRIDS), ("pool.resume", HYBRIDS)]
    assert rig.controller.decisions == []


class WarmUpPolicy(ExplainingPolicy):
    warm_up_lend = True


def test_the_warm_up_asks_a_plain_policy_nothing_and_lends_nothing():
    rig = make_rig()

    assert rig.controller.warm_up(0) == LendPlan(step=0, count=0, of=2)
    assert rig.events == []
    assert rig.controller.decisions == []


def test_the_warm_up_asks_a_policy_that_sets_warm_up_lend_and_records_its_answer():
    rig = make_rig(policy_cls=WarmUpPolicy)

    assert rig.controller.warm_up(0) == LendPlan(step=0, count=2, of=2)
    assert rig.events == [("rollout.counters",), ("policy.should_activate_after_step", 0, False)]
    assert rig.controller.decisions == [record(0, "should_activate_after_step", 2, now=START, active=False)]


def test_a_resumed_run_relends_its_hybrids_as_a_recorded_guard_decision():
    rig = make_rig()

    assert rig.controller.relend_after_resume(4) == LendPlan(step=0, count=2, of=2)
    assert rig.events == [("rollout.counters",)]
    assert rig.controller.decisions == [
        record(0, "relend_after_resume", 2, now=START, active=False, duration_s=0.0,
               reason="the hybrids were lent when the run stopped (param version 4)"),
    ]


def test_an_only_hybrid_run_lends_every_hybrid_before_step_1_as_a_recorded_guard_decision():
    rig = make_rig(hybrid_ids=THREE)

    assert rig.controller.lend_only_hybrids(0) == LendPlan(step=0, count=3, of=3)
    assert rig.controller.decisions == [
        record(0, "only_hybrid_start", 3, now=START, active=False, duration_s=0.0,
               reason="only-hybrid mode: no standalone replica, so the hybrids generate from the start "
                      "(param version 0)"),
    ]


def test_with_every_standalone_dead_the_guard_forces_the_lend_and_the_record_says_so():
    members = Membership(STANDALONES, HYBRIDS)
    rig = make_rig(membership=members, answers={"should_activate_after_step": False})
    for rid in STANDALONES:
        members.died(rid)

    lend = rig.controller.should_activate(3, [])

    assert lend == LendPlan(step=3, count=2, of=2)
    [decision] = rig.controller.decisions
    assert (decision.hook, decision.answer, decision.inputs["standalone_lost"]) == (
        "should_activate_after_step", 2, True)
    assert decision.reason == "guard: no standalone replica alive; should_activate_after_step at step 3, active=False"


def test_the_stranded_refill_records_a_guard_decision_then_lends_at_the_last_broadcast_version():
    members = Membership(STANDALONES, HYBRIDS)
    rig = make_rig(membership=members)
    for rid in STANDALONES:
        members.died(rid)

    refilled = rig.controller.refill_if_stranded(4, 3, lambda k: rig.events.append(("rollout.wait_for_queue", k)))

    assert refilled is True
    assert rig.events == [
        ("rollout.counters",),
        ("pool.wake_up", HYBRIDS), ("pool.load_weights", HYBRIDS, 3),
        ("lb.add_replicas", HYBRIDS), ("pool.resume", HYBRIDS),
        ("rollout.wait_for_queue", 16),
        ("lb.remove_replicas", HYBRIDS), ("pool.abort", HYBRIDS), ("pool.sleep", HYBRIDS),
    ]
    assert rig.controller.decisions == [DecisionRecord(
        step=4, hook=STRANDED_REFILL, answer=True,
        reason="no standalone replica alive and 6 of 16 samples queued: lend the hybrids at version 3 "
               "until a micro-step is queued",
        inputs={**inputs(now=START, active=False), "standalone_lost": True}, duration_s=0.0)]
    assert rig.controller.state is ControllerState.STANDALONE_ONLY


def test_no_refill_while_a_standalone_replica_is_alive():
    rig = make_rig()

    assert rig.controller.refill_if_stranded(4, 3, lambda k: rig.events.append(("rollout.wait_for_queue", k))) is False
    assert rig.events == [("rollout.counters",)]
    assert rig.controller.decisions == []


# ---------------------------------------------------------------------------------- context


def test_switch_durations_add_up_over_a_cycle_and_reset_after_update_after_step():
    rig = make_rig(initial_state=ControllerState.HYBRID_ACTIVE)
    rig.controller.deactivate()
    rig.controller.hybrid_sync(1)
    rig.controller.activate()
    rebalance = rig.controller.rebalance()

    during = rig.controller.context(MICRO)
    rig.controller.update_after_step(1, MICRO)
    after = rig.controller.context()

    assert (during.last_deactivate_duration_s, during.last_activate_duration_s) == (
        DEACTIVATE_S, SYNC_S + ACTIVATE_S + rebalance.duration_s)
    assert (after.last_deactivate_duration_s, after.last_activate_duration_s) == (0.0, 0.0)
    assert after.last_switch_at == START + DEACTIVATE_S + SYNC_S + ACTIVATE_S


def test_the_context_is_built_from_sizes_counters_micro_steps_and_membership():
    rig = make_rig()
    rig.clock.advance(2.0)

    ctx = rig.controller.context(MICRO)

    assert rig.events == [("rollout.counters",)]
    assert (ctx.required_samples, ctx.trigger_parameter_sync_step, ctx.buffer_samples) == (16, 4, 8)
    assert (ctx.total_generated_samples, ctx.expected_samples, ctx.mq_size) == (72, 64, 6)
    assert (ctx.step_wait_times, ctx.step_wait_samples) == ([1.5, 2.5], [3, 4])
    assert (ctx.standalone_replicas, ctx.hybrid_replicas, ctx.standalone_lost) == (2, 2, False)
    assert (ctx.now, ctx.last_switch_at) == (START + 2.0, None)


def test_the_context_carries_the_lent_count_the_staleness_cap_and_the_samples_in_flight():
    sizes = RunSizes(required_samples=16, trigger_parameter_sync_step=4, standalone_replicas=2, hybrid_replicas=3,
                     max_required_samples=96)
    rig = make_rig(hybrid_ids=THREE, sizes=sizes,
                   counters=RolloutCounters(generated_total=40, queue_size=6, in_flight=11))
    rig.controller.hybrid_sync(1, count=2)
    rig.controller.activate()

    ctx = rig.controller.context()

    assert (ctx.lent_replicas, ctx.hybrid_replicas, ctx.max_required_samples, ctx.in_flight_samples) == (2, 3, 96, 11)


# ------------------------------------------------------------------------------- persistence


def drive(rig: Rig, version: int) -> list:
    """One step's switches from HYBRID_ACTIVE and the observations a caller can make."""
    rig.controller.deactivate()
    rig.controller.hybrid_sync(version)
    rig.controller.activate(version=version)
    rig.controller.rebalance()
    return [
        rig.controller.context(),
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
    assert restored.controller.context() == original.controller.context()
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
    assert restored.controller.context().last_activate_duration_s == SYNC_S + timing.duration_s
    with pytest.raises(IllegalTransition):
        fresh.controller.activate(version=6)


def test_a_state_dict_from_before_the_per_cycle_durations_loads_with_a_fresh_cycle():
    rig = make_rig()
    old = {"state": "STANDALONE_ONLY", "synced_version": 2, "hybrid_sync_duration_s": 24.0,
           "last_activate_duration_s": 24.75, "last_deactivate_duration_s": 7.0, "last_switch_at": 90.0,
           "switch_count": 3}

    rig.controller.load_state_dict(old)

    assert rig.controller.state_dict() == {
        "state": "STANDALONE_ONLY", "synced_version": 2,
        "switch_durations": {"activate_s": 0.0, "deactivate_s": 0.0}, "last_switch_at": 90.0, "switch_count": 3,
        "lent": 0, "synced": 2,
    }


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
